"""Tests for ``dapo.config`` (presets, loading order, validation, error messages) and the CLI.

Expected preset values are written out from the DAPO paper (Yu et al. 2025, Table 1 and
section 3) and the Dr. GRPO paper, not read back from ``dapo.config``.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

import dapo.choices
from dapo.algorithms import ADVANTAGE_SCALES, KL_KINDS, LOSS_AGG_MODES
from dapo.cli import main
from dapo.config import (
    ABLATION_LADDER,
    PRESETS,
    AlgorithmConfig,
    Bounds,
    Config,
    ConfigError,
    RewardConfig,
    RewardFunctionConfig,
    TrainConfig,
    all_keys,
    config_from_dict,
    load_config,
    opt,
    validate,
)
from dapo.config.fields import check_fields
from dapo.config.rules import SECTION_RULES
from dapo.rollout import ENGINES


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "source_scorers":
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def raises_config_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    return str(info.value)


# --------------------------------------------------------------------------------------
# Unknown keys and suggestions
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "named", "suggested"),
    [
        ("algorithm.clip_hgh=0.3", "algorithm.clip_hgh", "algorithm.clip_high"),  # typo
        ("algorithm.epsilon_high=0.3", "algorithm.epsilon_high", "algorithm.clip_high"),  # TRL
        ("clip_ratio_high=0.3", "clip_ratio_high", "algorithm.clip_high"),  # verl, no section
        ("lr=1e-5", "lr", "train.lr"),  # no section (TRL's own names are translated)
        ("algoritm.clip_high=0.3", "algoritm", "algorithm"),  # misspelt section
        ("rollout.num_generation=4", "rollout.num_generation", "rollout.num_generations"),
        ("outptu_dir=runs/x", "outptu_dir", "output_dir"),  # unknown top-level key
    ],
)
def test_unknown_key_names_key_and_suggests(override, named, suggested):
    msg = raises_config_error([override])
    assert f"`{named}`" in msg
    assert f"`{suggested}`" in msg


def test_unknown_top_level_key_without_close_match():
    msg = raises_config_error(["frobnicate=1"])
    assert "`frobnicate`" in msg
    assert "unknown" in msg


def test_unknown_key_in_yaml_file_and_nested_dict(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", "algorithm:\n  clip_hgh: 0.3\n")
    with pytest.raises(ConfigError, match=r"algorithm\.clip_hgh.*algorithm\.clip_high"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"algorithm\.clip_hgh.*algorithm\.clip_high"):
        config_from_dict({"algorithm": {"clip_hgh": 0.3}})


# --------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_loads_validates_and_round_trips(name, tmp_path):
    cfg = load_config(overrides=[f"preset={name}"])
    validate(cfg)
    assert cfg.preset == name
    for key, value in PRESETS[name][1].items():  # the preset's settings are applied
        section, leaf = key.split(".")
        assert getattr(getattr(cfg, section), leaf) == value, key

    text = cfg.to_yaml()
    assert config_from_dict(yaml.safe_load(text)) == cfg
    path = write_yaml(tmp_path / "saved.yaml", text)
    assert load_config(path) == cfg


def _algo(name: str) -> dict[str, Any]:
    return dataclasses.asdict(load_config(overrides=[f"preset={name}"]).algorithm)


def test_grpo_preset_semantics():
    a = _algo("grpo")
    assert a["clip_low"] == 0.2 and a["clip_high"] == 0.2
    assert a["loss_agg"] == "seq-mean-token-mean"
    assert a["advantage_scale"] == "group"
    assert a["dynamic_sampling"] is False
    assert a["overlong_filter"] is False
    assert a["overlong_penalty"] is False
    assert a["beta"] == 0


def test_dapo_preset_semantics():
    a = _algo("dapo")
    assert a["clip_low"] == 0.2 and a["clip_high"] == 0.28
    assert a["loss_agg"] == "token-mean"
    assert a["advantage_scale"] == "group"
    assert a["dynamic_sampling"] is True
    assert a["overlong_filter"] is True
    assert a["overlong_penalty"] is True
    assert a["beta"] == 0
    # It is the default.
    assert load_config().to_dict() == load_config(overrides=["preset=dapo"]).to_dict()


def test_dr_grpo_preset_semantics():
    a = _algo("dr_grpo")
    assert a["advantage_scale"] == "none"
    assert a["loss_agg"] == "seq-mean-token-sum-norm"
    assert a["beta"] == 0


def test_ablation_ladder_adds_one_technique_per_step_in_paper_order():
    # DAPO paper, Table 1: naive GRPO, + overlong filtering, + clip-higher,
    # + soft overlong punishment, + token-level loss, + dynamic sampling (= DAPO).
    expected = [
        ("grpo", None, None),
        ("grpo+overlong_filter", "algorithm.overlong_filter", True),
        ("grpo+clip_higher", "algorithm.clip_high", 0.28),
        ("grpo+soft_punish", "algorithm.overlong_penalty", True),
        ("grpo+token_loss", "algorithm.loss_agg", "token-mean"),
        ("dapo", "algorithm.dynamic_sampling", True),
    ]
    assert [name for name, _, _ in expected] == ABLATION_LADDER
    configs = {n: flat(load_config(overrides=[f"preset={n}"]).to_dict()) for n in ABLATION_LADDER}
    for (prev, _, _), (name, key, value) in itertools.pairwise(expected):
        a, b = configs[prev], configs[name]
        differing = {k for k in a if k != "preset" and a[k] != b[k]}
        assert differing == {key}, (prev, name, differing)
        assert b[key] == value


# --------------------------------------------------------------------------------------
# Precedence: defaults < preset < YAML file < CLI overrides
# --------------------------------------------------------------------------------------


def test_precedence(tmp_path):
    path = write_yaml(
        tmp_path / "run.yaml",
        "preset: grpo\ntrain:\n  lr: 3.0e-5\n  steps: 11\nalgorithm:\n  loss_agg: token-mean\n",
    )
    cfg = load_config(path, ["train.steps=7", "algorithm.clip_low=0.1"])
    defaults = TrainConfig()
    assert cfg.preset == "grpo"
    assert cfg.algorithm.clip_high == 0.2  # preset beats the default (0.28)
    assert cfg.algorithm.dynamic_sampling is False  # preset beats the default (True)
    assert cfg.train.lr == 3e-5  # file beats the default
    assert cfg.algorithm.loss_agg == "token-mean"  # file beats the preset
    assert cfg.train.steps == 7  # CLI beats the file
    assert cfg.algorithm.clip_low == 0.1  # CLI beats the preset
    assert cfg.train.prompts_per_step == defaults.prompts_per_step  # untouched keys: defaults

    # A preset given on the command line beats the one in the file.
    cfg = load_config(path, ["preset=dr_grpo"])
    assert cfg.preset == "dr_grpo"
    assert cfg.algorithm.advantage_scale == "none"
    assert cfg.train.lr == 3e-5


def test_float_in_exponent_notation_is_coerced(tmp_path):
    assert yaml.safe_load("1e-6") == "1e-6"  # why the loader has to coerce (YAML 1.1)
    lr = load_config(overrides=["train.lr=1e-6"]).train.lr
    assert isinstance(lr, float) and lr == 1e-6
    path = write_yaml(tmp_path / "c.yaml", "train:\n  lr: 1e-6\n")
    lr = load_config(path).train.lr
    assert isinstance(lr, float) and lr == 1e-6


# --------------------------------------------------------------------------------------
# Invalid values
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        (["algorithm.clip_high=-0.1"], "algorithm.clip_high", "-0.1"),
        (["rollout.num_generations=1"], "rollout.num_generations", "1"),
        (
            ["rollout.max_completion_length=32", "algorithm.overlong_buffer=32"],
            "algorithm.overlong_buffer",
            "32",
        ),
        (
            ["rollout.max_completion_length=32", "algorithm.overlong_buffer=40"],
            "algorithm.overlong_buffer",
            "40",
        ),
        (
            ["train.prompts_per_step=16", "train.mini_batch_size=5"],
            "train.mini_batch_size",
            "5",
        ),
        (["train.steps=abc"], "train.steps", "abc"),
        (["train.steps=2.5"], "train.steps", "2.5"),
        (["algorithm.dynamic_sampling=maybe"], "algorithm.dynamic_sampling", "maybe"),
        (["train.lr=fast"], "train.lr", "fast"),
        (["algorithm.loss_agg=token_mean"], "algorithm.loss_agg", "token_mean"),
    ],
)
def test_invalid_values_name_key_and_value(overrides, key, value):
    msg = raises_config_error(overrides)
    assert key in msg
    assert value in msg


def test_valid_neighbours_of_invalid_values_load():
    # Guards the tests above against rejecting everything.
    cfg = load_config(
        overrides=[
            "algorithm.clip_high=0",
            "rollout.num_generations=2",
            "rollout.max_completion_length=32",
            "algorithm.overlong_buffer=31",
            "train.prompts_per_step=16",
            "train.mini_batch_size=8",
            "train.steps=3.0",
            "algorithm.dynamic_sampling=false",
        ]
    )
    assert cfg.algorithm.overlong_buffer == 31
    assert cfg.train.mini_batch_size == 8
    assert cfg.train.steps == 3 and isinstance(cfg.train.steps, int)
    assert cfg.algorithm.dynamic_sampling is False


def test_literal_typo_suggests_the_choice():
    msg = raises_config_error(["algorithm.loss_agg=token_mean"])
    assert "'token-mean'" in msg
    assert "did you mean" in msg


def test_unknown_preset_suggests_a_known_one():
    msg = raises_config_error(["preset=dapoo"])
    assert "'dapoo'" in msg
    assert "`dapo`" in msg


def test_malformed_override():
    msg = raises_config_error(["train.steps"])
    assert "'train.steps'" in msg
    assert "key.path=value" in msg


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_yaml_that_is_not_a_mapping(tmp_path, text):
    path = write_yaml(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError, match="mapping") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_invalid_yaml_syntax(tmp_path):
    path = write_yaml(tmp_path / "broken.yaml", "train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_config_default_is_valid_and_matches_load_config():
    validate(Config())
    default = Config()
    assert default.algorithm.overlong_buffer is None  # tied to L_max: load_config resolves it
    default.algorithm.overlong_buffer = round(0.2 * default.rollout.max_completion_length)
    assert load_config() == default


# --------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------


def test_cli_presets_lists_one_line_per_preset(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(PRESETS)
    assert [line.split()[0] for line in lines] == list(PRESETS)
    assert all(len(line.split()) > 1 for line in lines)  # each has a description


def test_cli_train_config_error_returns_2_with_suggestion(capsys):
    assert main(["train", "algorithm.clip_hgh=1"]) == 2
    captured = capsys.readouterr()
    assert "algorithm.clip_hgh" in captured.err
    assert "algorithm.clip_high" in captured.err


def test_cli_print_config(capsys, tmp_path):
    assert main(["train", "--print-config", "train.steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["steps"] == 7
    assert config_from_dict(printed) == load_config(overrides=["train.steps=7"])

    path = write_yaml(tmp_path / "c.yaml", "preset: grpo\ntrain:\n  lr: 1e-5\n")
    assert main(["train", "--print-config", str(path), "train.steps=9"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["preset"] == "grpo"
    assert printed["train"]["lr"] == 1e-5
    assert printed["train"]["steps"] == 9
    assert printed["algorithm"]["clip_high"] == 0.2


def test_cli_help_is_the_short_usage(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dapo train [CONFIG.yaml]")
    assert "--help-config" in out


# --------------------------------------------------------------------------------------
# Help text and choices: one source of truth
# --------------------------------------------------------------------------------------


def _sections(cls: type = Config) -> list[type]:
    """``cls`` and every dataclass reachable from its fields (list items included)."""
    out = [cls]
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            out += _sections(type(default))
    return out


def test_every_field_has_help_text():
    sections = _sections() + [RewardFunctionConfig]  # reward.functions holds these
    assert len(sections) == 13
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in sections
        for f in dataclasses.fields(cls)
        if len(f.metadata.get("help", "").strip()) < 10
    ]
    assert missing == []


def test_help_config_lists_every_key_with_default_and_help(capsys):
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("algorithm.clip_high "))
    assert "0.28" in line and "float" in line
    (clip_high,) = [f for f in dataclasses.fields(AlgorithmConfig) if f.name == "clip_high"]
    assert "Clip-Higher" in clip_high.metadata["help"] and "0.28" in clip_high.metadata["help"]
    flowing = " ".join(out.split())  # the help text is wrapped at spaces only
    assert clip_high.metadata["help"] in flowing
    keys = all_keys()
    for key in keys:
        is_section = any(k.startswith(key + ".") for k in keys)
        assert (f"\n{key}: " if is_section else f"\n  {key} = ") in out, key
    for cls in _sections() + [RewardFunctionConfig]:
        for f in dataclasses.fields(cls):
            assert f.metadata["help"] in flowing, f"{cls.__name__}.{f.name}"
    # Enumerated keys show their choices.
    assert " | ".join(LOSS_AGG_MODES) in out
    assert "L_cache" in out  # overlong_buffer says what it is in the paper's terms


def _choices(cls: type) -> dict[str, tuple[str, ...]]:
    """The allowed names of each enumerated field of a section: its ``Literal`` type's."""
    hints = typing.get_type_hints(cls)
    return {k: typing.get_args(tp) for k, tp in hints.items() if typing.get_origin(tp) is Literal}


def test_enumerated_fields_take_their_choices_from_the_implementations():
    choices = {name: c for cls in _sections() for name, c in _choices(cls).items()}
    assert choices["loss_agg"] is LOSS_AGG_MODES
    assert choices["advantage_scale"] is ADVANTAGE_SCALES
    assert choices["kl_estimator"] is KL_KINDS
    assert choices["engine"] is ENGINES
    # Every enumerated field takes one of dapo.choices' lists, and none is a plain str.
    tuples = [v for v in vars(dapo.choices).values() if isinstance(v, tuple)]
    assert all(any(c is t for t in tuples) for c in choices.values()), choices
    assert len(choices) >= 14
    assert not [
        f for cls in _sections() for f in dataclasses.fields(cls) if "choices" in f.metadata
    ]


def test_loss_agg_accepts_exactly_the_algorithm_modes():
    for mode in LOSS_AGG_MODES:
        assert load_config(overrides=[f"algorithm.loss_agg={mode}"]).algorithm.loss_agg == mode
    msg = raises_config_error(["algorithm.loss_agg=sum"])
    assert "`algorithm.loss_agg`" in msg and "'sum'" in msg
    assert str(list(LOSS_AGG_MODES)) in msg
    # validate() checks the same list on a config built in code.
    cfg = Config()
    cfg.algorithm.loss_agg = "sum"
    with pytest.raises(ConfigError, match="algorithm.loss_agg") as info:
        validate(cfg)
    assert str(list(LOSS_AGG_MODES)) in str(info.value)


# --------------------------------------------------------------------------------------
# Loss variants, corrections, entropy controls
# --------------------------------------------------------------------------------------


def test_variant_presets_set_the_papers_values_on_top_of_dapo():
    dapo = flat(load_config().to_dict())
    expected = {
        "gspo": {
            "algorithm.policy_loss": "gspo",
            "algorithm.clip_low": 3e-4,
            "algorithm.clip_high": 4e-4,
            "algorithm.loss_agg": "seq-mean-token-mean",
        },
        "cispo": {
            "algorithm.policy_loss": "cispo",
            "algorithm.clip_low": 1.0,
            "algorithm.clip_high": 4.0,
        },
        "clip_cov": {
            "algorithm.entropy_control": "clip_cov",
            "algorithm.clip_low": 1.0,
            "algorithm.clip_high": 1.0,
        },  # ratio 2e-4 and window (1, 5) are the defaults
        "kl_cov": {"algorithm.entropy_control": "kl_cov"},  # k 2e-3, beta 1: the defaults
    }
    for name, changes in expected.items():
        cfg = flat(load_config(overrides=[f"preset={name}"]).to_dict())
        differing = {k: cfg[k] for k in cfg if k != "preset" and cfg[k] != dapo[k]}
        assert differing == changes, name
    a = load_config(overrides=["preset=clip_cov"]).algorithm
    assert (a.clip_cov_ratio, a.clip_cov_low, a.clip_cov_high) == (2e-4, 1.0, 5.0)
    a = load_config(overrides=["preset=kl_cov"]).algorithm
    assert (a.kl_cov_ratio, a.kl_cov_coef) == (2e-3, 1.0)


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (
            ["preset=gspo", "algorithm.loss_agg=token-mean"],
            "algorithm.loss_agg",
            "seq-mean-token-mean",
        ),
        (["algorithm.policy_loss=gspo"], "algorithm.loss_agg", "length"),
        (["preset=cispo", "algorithm.clip_c=3"], "algorithm.clip_c", "policy_loss=cispo"),
        (
            ["preset=gspo", "algorithm.entropy_control=kl_cov"],
            "algorithm.entropy_control",
            "policy_loss=ppo",
        ),
        (["algorithm.is_cap=0.5"], "algorithm.is_cap", ">= 1"),
        (["algorithm.entropy_coef=-0.1"], "algorithm.entropy_coef", "positive"),
        (
            ["algorithm.clip_cov_low=5", "algorithm.clip_cov_high=1"],
            "algorithm.clip_cov_high",
            "empty",
        ),
        (["algorithm.kl_cov_ratio=0"], "algorithm.kl_cov_ratio", "(0, 1]"),
        (["algorithm.clip_low=1.5"], "algorithm.clip_low", "[0, 1]"),
        (["algorithm.is_mode=reject"], "algorithm.is_mode", "'mask'"),
        (["algorithm.policy_loss=grpo"], "algorithm.policy_loss", "'ppo'"),
    ],
)
def test_impossible_loss_combinations_are_refused(overrides, key, fragment):
    msg = raises_config_error(overrides)
    assert f"`{key}`" in msg and fragment in msg, msg


@pytest.mark.parametrize(
    ("name", "suggested"),
    [
        ("algorithm.tis_cap", "algorithm.is_cap"),
        ("loss_mode", "algorithm.policy_loss"),
        ("rollout_is", "algorithm.is_level"),
        ("entropy_coeff", "algorithm.entropy_coef"),
        ("clip_cov_lb", "algorithm.clip_cov_low"),
    ],
)
def test_old_and_peer_names_of_the_loss_keys_are_suggested(name, suggested):
    msg = raises_config_error([f"{name}=1"])
    assert f"did you mean `{suggested}`?" in msg


def test_new_enumerations_come_from_dapo_choices():
    from dapo.choices import ENTROPY_CONTROLS, IS_LEVELS, IS_MODES, POLICY_LOSSES

    fields = _choices(AlgorithmConfig)
    assert fields["policy_loss"] is POLICY_LOSSES
    assert fields["is_level"] is IS_LEVELS and fields["is_mode"] is IS_MODES
    assert fields["entropy_control"] is ENTROPY_CONTROLS


# --------------------------------------------------------------------------------------
# Constraints next to their fields: bounds, Literal choices, section rules
# --------------------------------------------------------------------------------------


def _leaves(cls: type = Config, prefix: str = "") -> list[tuple[str, type, dataclasses.Field]]:
    """(key path, section class, field) of every non-section field; list items as [0]."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _leaves(tp, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", cls, f))
    if cls is RewardConfig:  # reward.functions holds RewardFunctionConfig items
        out += _leaves(RewardFunctionConfig, f"{prefix}functions[0].")
    return out


def _set(cfg: Config, path: str, value: Any) -> None:
    """Set ``path`` on a config built in code, bypassing the loader's checks."""
    if path.startswith("reward.functions[0]."):
        cfg.reward.functions = [RewardFunctionConfig()]
    *parents, leaf = path.replace("functions[0]", "functions").split(".")
    node: Any = cfg
    for part in parents:
        node = getattr(node, part)
        node = node[0] if isinstance(node, list) else node
    setattr(node, leaf, value)


def _outside(b: Bounds, tp: Any) -> Any:
    """A value just outside the bounds ``b`` of a field of type ``tp``."""
    if b.nonempty:
        return [] if typing.get_origin(tp) is list else ""
    step = 1 if tp is int else 0.5
    if b.ge is not None:
        return tp(b.ge - step)
    if b.gt is not None:
        return tp(b.gt)
    return tp(b.le + step if b.le is not None else b.lt)


BOUNDED = [(p, c, f) for p, c, f in _leaves() if "bounds" in f.metadata]


# Each bound of a5216fc's validate() (its ~60 `_check` calls), written out from it.
OLD_BOUNDS = {
    "algorithm.clip_low": "in [0, 1]",
    "algorithm.clip_high": ">= 0",
    "algorithm.beta": ">= 0",
    "algorithm.max_gen_rounds": ">= 1",
    "algorithm.max_empty_steps": ">= 1",
    "algorithm.skip_max_prob": "in [0, 1)",
    "algorithm.skip_key": "non-empty",
    "algorithm.overlong_buffer": ">= 0",
    "algorithm.clip_c": "> 1",
    "algorithm.is_cap": ">= 1",
    "algorithm.entropy_coef": ">= 0",
    "algorithm.clip_cov_ratio": "in (0, 1]",
    "algorithm.kl_cov_ratio": "in (0, 1]",
    "algorithm.kl_cov_coef": ">= 0",
    "data.difficulty_key": "non-empty",
    "data.curriculum_start": "in (0, 1]",
    "data.curriculum_steps": ">= 0",
    "data.max_prompt_length": ">= 1",
    "rollout.server_timeout_s": "> 0",
    "rollout.max_staleness": "in [0, 64]",
    "rollout.partial_chunk_tokens": ">= 1",
    "rollout.num_generations": ">= 2",
    "rollout.temperature": "> 0",
    "rollout.top_p": "in (0, 1]",
    "rollout.top_k": ">= 0",
    "rollout.eval_top_p": "in (0, 1]",
    "rollout.eval_temperature": ">= 0",
    "rollout.eval_num_generations": ">= 1",
    "rollout.vllm_sync_every": ">= 1",
    "rollout.vllm_gpu_memory_utilization": "in (0, 1]",
    "rollout.max_completion_length": ">= 1",
    "rollout.generation_batch_size": ">= 1",
    "model.lora.rank": ">= 0",
    "model.lora.alpha": "> 0",
    "model.lora.dropout": "in [0, 1)",
    "model.lora.target_modules": "non-empty",
    "train.steps": ">= 0",
    "train.prompts_per_step": ">= 1",
    "train.mini_batch_size": ">= 1",
    "train.epochs": ">= 1",
    "train.micro_batch_tokens": ">= 1",
    "train.lr": "> 0",
    "train.warmup_steps": ">= 0",
    "train.min_lr_ratio": "in [0, 1]",
    "train.weight_decay": ">= 0",
    "train.max_grad_norm": ">= 0",
    "train.adam_beta1": "in [0, 1)",
    "train.adam_beta2": "in [0, 1)",
    "train.sample_budget": ">= 0",
    "train.max_nonfinite_updates": ">= 1",
    "train.logits_chunk_size": ">= 1",
    "reward.timeout_s": "> 0",
    "reward.num_workers": ">= 0",
    "reward.functions[0].name": "non-empty",
    "checkpoint.save_every": ">= 0",
    "checkpoint.keep_last": ">= 1",
    "logging.eval_every": ">= 0",
    "output_dir": "non-empty",
}


def test_bounded_fields_are_the_ones_validate_checked_before():
    declared = {path: f.metadata["bounds"].rule() for path, _, f in BOUNDED}
    assert {k: declared.get(k) for k in OLD_BOUNDS} == OLD_BOUNDS  # none lost (new ones may come)


@pytest.mark.parametrize(("path", "cls", "f"), BOUNDED, ids=[p for p, _, _ in BOUNDED])
def test_every_declared_bound_is_enforced_and_named(path, cls, f):
    b: Bounds = f.metadata["bounds"]
    tp = typing.get_type_hints(cls)[f.name]
    optional = isinstance(tp, types.UnionType)
    base = next(a for a in typing.get_args(tp) if a is not type(None)) if optional else tp
    bad = _outside(b, base)
    cfg = Config()
    _set(cfg, path, bad)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    msg = str(info.value)
    assert msg.startswith(f"`{path}` = {bad!r} is invalid: "), msg
    assert b.rule() in msg  # the bound itself, e.g. "in [0, 1)" or ">= 2"
    # The same value given as an override or in a file is refused the same way.
    if "[0]" not in path:
        text = "[]" if bad == [] else repr(bad) if bad != "" else ""
        with pytest.raises(ConfigError, match=re.escape(f"`{path}` = {bad!r} is invalid")):
            load_config(overrides=[f"{path}={text}"])
    # An inclusive bound itself passes the field checks.
    for edge in (b.ge, b.le):
        if edge is not None:
            cfg = Config()
            _set(cfg, path, base(edge))
            check_fields(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.lr=0"],
            "`train.lr` = 0.0 is invalid: use a value > 0 "
            "(a positive learning rate, e.g. 1e-6 for large models)",
        ),
        (["rollout.top_p=1.5"], "`rollout.top_p` = 1.5 is invalid: use a value in (0, 1]"),
        (["model.lora.dropout=1"], "`model.lora.dropout` = 1.0 is invalid: use a value in [0, 1)"),
        (
            ["algorithm.is_cap=0.5"],
            "`algorithm.is_cap` = 0.5 is invalid: use a value >= 1 or null "
            "(e.g. 2.0 to truncate, 3.0 to mask)",
        ),
        (
            ["rollout.num_generations=1"],
            "`rollout.num_generations` = 1 is invalid: use a value >= 2 "
            "(group-relative advantages need at least 2 responses per prompt)",
        ),
        (
            ["output_dir="],
            "`output_dir` = '' is invalid: use a non-empty value (the run's directory)",
        ),
        (
            ["algorithm.skip_uniform_prompts=true", "algorithm.skip_key="],
            "`algorithm.skip_key` = '' is invalid: use a non-empty value or null",
        ),
    ],
)
def test_bound_violation_names_field_value_and_bound(overrides, message):
    assert raises_config_error(overrides).startswith(message)


def test_bound_error_for_a_list_item_names_its_index():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"reward": {"functions": [{"name": "dapo_math"}, {"name": ""}]}})
    assert str(info.value).startswith("`reward.functions[1].name` = '' is invalid: use a non-empty")


LITERALS = [(p, c, f) for p, c, f in _leaves() if f.name in _choices(c)]


@pytest.mark.parametrize(("path", "cls", "f"), LITERALS, ids=[p for p, _, _ in LITERALS])
def test_every_enumerated_field_refuses_a_typo_with_its_choices(path, cls, f):
    choices = _choices(cls)[f.name]
    last = str(choices[-1]).lower() if isinstance(choices[-1], bool) else choices[-1]
    typo = last + "x"  # e.g. 'vllm-serverx'; 'falsex' for train.packing's false
    msg = raises_config_error([f"{path}={typo}"])
    assert msg == f"`{path}` = {typo!r} is not one of {list(choices)} (did you mean {last!r}?)"
    # A config built in code is checked against the same type.
    cfg = Config()
    _set(cfg, path, typo)
    with pytest.raises(ConfigError, match=re.escape(str(list(choices)))):
        validate(cfg)
    for name in choices:  # and every choice passes the field checks
        _set(cfg, path, name)
        check_fields(cfg)


SECTION_RULE_CASES = {
    "data": (["data.difficulty_key=level"], "data.difficulty_key", "data.curriculum"),
    "rollout": (["rollout.partial_rollouts=true"], "rollout.partial_rollouts", "max_staleness"),
    "algorithm": (["algorithm.policy_loss=gspo"], "algorithm.loss_agg", "seq-mean-token-mean"),
    "train": (["train.mini_batch_size=5"], "train.mini_batch_size", "divisor"),
}


def test_every_section_rule_has_a_case_here():
    assert set(SECTION_RULE_CASES) == set(SECTION_RULES)


@pytest.mark.parametrize("section", list(SECTION_RULE_CASES))
def test_a_cross_field_rule_fires_from_its_section_function(section):
    overrides, key, fragment = SECTION_RULE_CASES[section]
    msg = raises_config_error(overrides)
    assert msg.startswith(f"`{key}` = ") and "is invalid: " in msg and fragment in msg, msg
    # It is that section's rule (every field is within its own bounds).
    cfg = Config()
    for item in overrides:
        path, value = item.split("=")
        _set(cfg, path, yaml.safe_load(value))
    check_fields(cfg)
    with pytest.raises(ConfigError) as info:
        SECTION_RULES[section](cfg)
    assert msg.startswith(str(info.value))  # load_config may add where an unset value came from
    for other, rule in SECTION_RULES.items():
        if other != section:
            rule(cfg)


def test_help_config_shows_bounds_next_to_defaults_and_choices(capsys):
    assert main(["train", "--help-config"]) == 0
    lines = {
        x.split(" = ")[0].strip(): x for x in capsys.readouterr().out.splitlines() if " = " in x
    }
    assert lines["algorithm.clip_low"].endswith("= 0.2    [float, 0 <= x <= 1]")
    assert lines["rollout.num_generations"].endswith("= 8    [int, x >= 2]")
    assert lines["rollout.top_p"].endswith("[float, 0 < x <= 1]")
    assert lines["algorithm.is_cap"].endswith("= null    [float | null, x >= 1]")
    assert lines["algorithm.skip_max_prob"].endswith("[float, 0 <= x < 1]")
    assert lines["output_dir"].endswith("[str, non-empty]")
    assert lines["rollout.engine"].endswith("= hf    [hf | vllm | vllm-server]")
    assert lines["reward.functions[i].name"].endswith("[str, non-empty]")
    for path, _, f in BOUNDED:
        assert lines[path.replace("[0]", "[i]")].endswith(f"{f.metadata['bounds'].summary()}]")


def test_opt_hint_needs_a_bound():
    with pytest.raises(TypeError, match="hint"):
        opt(1, "help text", hint="e.g. 2")
    assert opt(1, "h", ge=0, hint="e.g. 2").metadata["bounds"] == Bounds(ge=0, hint="e.g. 2")


def test_loss_settings_take_their_defaults_and_types_from_the_algorithm_config():
    from dapo.algorithms import LossSettings

    settings, algo = LossSettings(), AlgorithmConfig()
    loss_hints = typing.get_type_hints(LossSettings)
    algo_hints = typing.get_type_hints(AlgorithmConfig)
    shared = [f.name for f in dataclasses.fields(LossSettings) if f.name in algo_hints]
    assert {f.name for f in dataclasses.fields(LossSettings)} - set(shared) == {
        "temperature",
        "max_len",
    }
    assert len(shared) == 18
    for name in shared:
        assert getattr(settings, name) == getattr(algo, name), name
        assert loss_hints[name] == algo_hints[name], name
    assert (settings.clip_low, settings.clip_high, settings.loss_agg) == (0.2, 0.28, "token-mean")


def test_config_imports_neither_torch_nor_the_algorithms():
    code = (
        "import sys, dapo.config; dapo.config.describe_config(); dapo.config.load_config(); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('dapo.algorithms')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("file_data", "overrides", "expected"),
    [
        (None, [], "builtin:addition"),  # the default run: the default task's held-out split
        (None, ["data.train=builtin:long_addition"], "builtin:long_addition"),
        ({"data": {"train": "builtin:calculator"}}, [], "builtin:calculator"),
        (None, ["data.train=/data/math.parquet"], None),  # a file has no held-out split
        ({"data": {"train": "/data/math.parquet"}}, [], None),
        # Named data.eval always wins, from any layer, null included.
        (
            None,
            ["data.train=/data/math.parquet", "data.eval=/data/aime.parquet"],
            "/data/aime.parquet",
        ),
        (
            {"data": {"eval": "builtin:addition"}},
            ["data.train=builtin:long_addition"],
            "builtin:addition",
        ),
        ({"data": {"train": "builtin:long_addition", "eval": None}}, [], None),
        (
            {"data": {"train": "/data/math.parquet"}},
            ["data.eval=builtin:addition"],
            "builtin:addition",
        ),
    ],
)
def test_eval_follows_train_unless_a_layer_names_it(file_data, overrides, expected):
    # Evaluating data.train=builtin:long_addition on builtin:addition (the old default)
    # measured a task that was not trained.
    assert load_config(file_data, overrides).data.eval == expected


# --------------------------------------------------------------------------------------
# A value the user never set follows, or says where it came from
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("pps", "mbs"), [(4, 4), (2, 2), (24, 24), (32, 16), (16, 16)])
def test_an_unset_mini_batch_size_follows_prompts_per_step(pps, mbs):
    cfg = load_config(None, [f"train.prompts_per_step={pps}"])
    assert (cfg.train.prompts_per_step, cfg.train.mini_batch_size) == (pps, mbs)
    # Set by the user, it is the user's: refused with the rule's own message only.
    msg = raises_config_error([f"train.prompts_per_step={pps}", "train.mini_batch_size=5"])
    assert "you did not set" not in msg and "divisor" in msg


def test_help_config_says_mini_batch_size_follows(capsys):
    assert main(["train", "--help-config"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "train.prompts_per_step=4 alone gives 4" in text


def test_a_rule_refusing_an_unset_value_names_its_source():
    msg = raises_config_error(["algorithm.clip_cov_low=6"])
    assert msg.startswith("`algorithm.clip_cov_high` = 5.0 is invalid")
    assert "you did not set `algorithm.clip_cov_high`: its value is the default" in msg
    msg = raises_config_error(["preset=gspo", "algorithm.loss_agg=token-mean"])
    assert "`algorithm.loss_agg` = 'token-mean' is invalid" in msg and "did not set" not in msg
    msg = raises_config_error(["algorithm.policy_loss=gspo"])
    assert "you did not set `algorithm.loss_agg`: its value is preset dapo's value" in msg


def test_dotted_keys_in_a_yaml_file_mix_with_sections(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", "train.steps: 5\ntrain:\n  lr: 1.0e-5\n")
    cfg = load_config(path)
    assert (cfg.train.steps, cfg.train.lr) == (5, 1e-5)
    path = write_yaml(tmp_path / "twice.yaml", "train.steps: 5\ntrain:\n  steps: 6\n")
    with pytest.raises(
        ConfigError, match=r"`train\.steps` is given twice, as `train\.steps` \(5\)"
    ):
        load_config(path)
    # A dict field's own keys keep their dots.
    cfg = load_config(None, {"reward.source_scorers": {"math.v2": "dapo_math"}})
    assert cfg.reward.source_scorers == {"math.v2": "dapo_math"}
