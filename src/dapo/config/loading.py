"""Loading and validation: YAML files, ``key.path=value`` overrides, type coercion, aliases.

A run's :class:`~dapo.config.schema.Config` is built in this order: defaults, then the named
preset (``preset: dapo`` by default), then the YAML file, then the command-line overrides.
Unknown keys and bad values raise :class:`ConfigError` naming the key, the value and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml

from dapo.config.presets import PRESETS
from dapo.config.schema import Config
from dapo.errors import ConfigError

# Names users bring from other libraries, mapped to ours.
_ALIASES = {
    "epsilon": "algorithm.clip_low",
    "epsilon_low": "algorithm.clip_low",
    "epsilon_high": "algorithm.clip_high",
    "clip_ratio_low": "algorithm.clip_low",
    "clip_ratio_high": "algorithm.clip_high",
    "loss_type": "algorithm.loss_agg",
    "loss_agg_mode": "algorithm.loss_agg",
    "learning_rate": "train.lr",
    "max_steps": "train.steps",
    "n": "rollout.num_generations",
    "max_new_tokens": "rollout.max_completion_length",
    "max_response_length": "rollout.max_completion_length",
    "model_name_or_path": "model.name_or_path",
    # dapo's own renamed keys
    "tis_cap": "algorithm.is_cap",
    # verl / TRL names of the loss variants and corrections
    "loss_mode": "algorithm.policy_loss",
    "importance_sampling_level": "algorithm.policy_loss",
    "vllm_importance_sampling_mode": "algorithm.is_mode",
    "vllm_importance_sampling_clip_max": "algorithm.is_cap",
    "vllm_importance_sampling_cap": "algorithm.is_cap",
    "rollout_is_threshold": "algorithm.is_cap",
    "rollout_is": "algorithm.is_level",
    "entropy_coeff": "algorithm.entropy_coef",
    "clip_cov_lb": "algorithm.clip_cov_low",
    "clip_cov_ub": "algorithm.clip_cov_high",
    "ppo_kl_coef": "algorithm.kl_cov_coef",
    # Precision is a training setting (weights, autocast and optimizer state together).
    "dtype": "train.precision",
    "torch_dtype": "train.precision",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "mixed_precision": "train.precision",
    "entropy_chunk_size": "train.logits_chunk_size",
}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        path = f"{prefix}{f.name}"
        keys.append(path)
        if dataclasses.is_dataclass(tp):
            keys.extend(_all_keys(tp, path + "."))
    return keys


def _unknown_key(path: str) -> ConfigError:
    leaf = path.rsplit(".", 1)[-1]
    suggestion = _ALIASES.get(leaf) or _ALIASES.get(path)
    if suggestion is None:
        keys = _all_keys()
        section = path.rsplit(".", 1)[0] + "." if "." in path else ""
        prefixed = [k for k in keys if k.startswith(section + leaf) and k.count(".") == path.count(".")]
        if len(prefixed) == 1:  # an abbreviation: rollout.temp -> rollout.temperature
            return ConfigError(f"unknown config key `{path}`: did you mean `{prefixed[0]}`?")
        close = difflib.get_close_matches(path, keys, n=1, cutoff=0.6)
        if not close:
            by_leaf = {k.rsplit(".", 1)[-1]: k for k in keys}
            leaf_close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
            close = [by_leaf[leaf_close[0]]] if leaf_close else []
        suggestion = close[0] if close else None
    hint = f"did you mean `{suggestion}`?" if suggestion else "see `dapo train --help-config`"
    return ConfigError(f"unknown config key `{path}`: {hint}")


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the type ``tp``, converting only where it is lossless."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(path, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"`{path}`: invalid value {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"`{path}` must be a mapping of keys, got {value!r}")
        return _build(tp, value, path + ".")
    if origin is list:
        (item_tp,) = get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"`{path}` must be a list, got {value!r}")
        return [_coerce(f"{path}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"`{path}` must be a mapping, got {value!r}")
        return {
            _coerce(f"{path}.<key>", k, key_tp): _coerce(f"{path}.{k}", v, val_tp)
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"`{path}` must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"`{path}` must be an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int beyond the float range
                digits = int(value.bit_length() * math.log10(2)) + 1
                raise ConfigError(
                    f"`{path}` must be a finite number, got an integer of about {digits} digits"
                ) from None
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)  # YAML 1.1 reads "1e-6" as a string
        if number is None:
            raise ConfigError(f"`{path}` must be a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"`{path}` must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"`{path}` must be a string, got {value!r}")
    raise ConfigError(f"`{path}`: unsupported type {tp}")  # pragma: no cover


def _check_choice(path: str, value: Any, choices: tuple[str, ...]) -> None:
    """``value`` must be one of a field's ``choices`` (its metadata): no conversion."""
    if value not in choices:
        close = difflib.get_close_matches(str(value), list(choices), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"`{path}` = {value!r} is not one of {list(choices)}{hint}")


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(f"{prefix}{key}")
        choices = fields[key].metadata.get("choices")
        if choices is not None:
            _check_choice(f"{prefix}{key}", value, choices)
            kwargs[key] = value
        else:
            kwargs[key] = _coerce(f"{prefix}{key}", value, hints[key])
    return cls(**kwargs)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _nest(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in dotted.items():
        parts = path.split(".")
        node = out
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"`{path}`: `{part}` is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """``"train.lr=1e-5"`` -> ``("train.lr", 1e-5)``; the value is read as YAML."""
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} is not of the form key.path=value (e.g. train.steps=100)"
        )
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what the parser expected, and where (1-based line and column)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(exc).split())
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    return f"{problem} at {where}" + (f" ({context})" if context else "")


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
) -> Config:
    """Defaults < preset < YAML file < overrides; validated."""
    file_data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p} (give a YAML file path)")
        try:
            file_data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {p} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                "give a YAML file"
            ) from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {_yaml_problem(exc)}") from exc
        except RecursionError as exc:
            raise ConfigError(f"config file {p} is nested too deeply to be a config") from exc
        if not isinstance(file_data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of keys, got {file_data!r}")
    if isinstance(overrides, dict):
        dotted = dict(overrides)
    else:
        dotted = dict(parse_override(o) for o in overrides or [])
    cli_data = _nest(dotted)
    preset = cli_data.get("preset", file_data.get("preset", "dapo"))
    if not isinstance(preset, str):
        raise ConfigError(
            f"`preset` must be a preset name (a string), got {preset!r}; run `dapo presets`"
        )
    if preset not in PRESETS:
        close = difflib.get_close_matches(str(preset), list(PRESETS), n=1)
        hint = f"did you mean `{close[0]}`? " if close else ""
        raise ConfigError(
            f"`preset` = {preset!r} is not a known preset; {hint}run `dapo presets` to list them"
        )
    data = _merge(_nest(PRESETS[preset][1]), file_data)
    data = _merge(data, cli_data)
    data["preset"] = preset
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a config from a nested dict (e.g. a saved ``config.yaml``)."""
    cfg = _build(Config, data)
    if cfg.preset not in PRESETS:
        raise ConfigError(f"`preset` = {cfg.preset!r} is not a known preset; run `dapo presets`")
    validate(cfg)
    return cfg


def _check(ok: bool, key: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"`{key}` = {value!r} is invalid: {fix}")


def _check_choices(obj: Any, prefix: str = "") -> None:
    """Every enumerated field of ``obj`` and its sections holds one of its choices."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        choices = f.metadata.get("choices")
        if choices is not None:
            _check_choice(f"{prefix}{f.name}", value, choices)
        elif dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}{f.name}.")


def _check_rollout_engine(cfg: Config) -> None:
    """The rollout server and asynchronous rollouts: values and combinations."""
    r, a = cfg.rollout, cfg.algorithm
    if r.engine == "vllm-server":
        _check(
            bool(r.server_url), "rollout.server_url", r.server_url,
            "rollout.engine=vllm-server needs the server's address, e.g. "
            "rollout.server_url=http://HOST:8000 (start the server with dapo vllm-serve MODEL)",
        )  # fmt: skip
    _check(r.server_timeout_s > 0, "rollout.server_timeout_s", r.server_timeout_s, "use a positive number of seconds")
    _check(r.async_steps in (0, 1), "rollout.async_steps", r.async_steps,
           "use 0 (generate, then train) or 1 (generate the next batch while training)")  # fmt: skip
    if r.async_steps:
        _check(
            r.engine != "hf", "rollout.async_steps", r.async_steps,
            "asynchronous rollouts need an engine with its own weights: the hf engine samples "
            "from the very module being trained; use rollout.engine=vllm or vllm-server",
        )  # fmt: skip
        exact = r.top_p == 1.0 and r.top_k == 0
        _check(
            exact or a.is_cap is not None, "rollout.async_steps", r.async_steps,
            "with rollout.top_p < 1 or rollout.top_k > 0 the engine's log-probs are not the "
            "sampling policy's, so the one-step-old batch is uncorrected: set "
            "algorithm.is_cap (e.g. 2.0; algorithm.is_level / is_mode choose the correction), "
            "or sample with top_p=1 and top_k=0",
        )  # fmt: skip


def _validate_loss_variants(cfg: Config) -> None:
    """The policy-loss variant, its corrections and entropy controls: values and the
    combinations that make no sense."""
    a = cfg.algorithm
    if a.policy_loss == "gspo":
        _check(
            a.loss_agg == "seq-mean-token-mean", "algorithm.loss_agg", a.loss_agg,
            "policy_loss=gspo has one ratio per response and optimises 1/G sum_i of the "
            "response terms; a token-level mode would weigh each response by its length. Use "
            "algorithm.loss_agg=seq-mean-token-mean (preset=gspo sets it)",
        )  # fmt: skip
    if a.clip_c is not None:
        _check(a.clip_c > 1, "algorithm.clip_c", a.clip_c, "dual clip needs a value > 1 (e.g. 3.0) or null")
        _check(
            a.policy_loss == "ppo", "algorithm.clip_c", a.clip_c,
            f"dual clip bounds PPO's per-token surrogate; policy_loss={a.policy_loss} has none. "
            "Set algorithm.clip_c=null or algorithm.policy_loss=ppo",
        )  # fmt: skip
        _check(
            a.entropy_control != "kl_cov", "algorithm.clip_c", a.clip_c,
            "dual clip bounds PPO's clipped surrogate; entropy_control=kl_cov replaces it with "
            "the unclipped -r*A plus its penalty. Set algorithm.clip_c=null, or use "
            "entropy_control=clip_cov (which keeps the clip and the dual clip)",
        )  # fmt: skip
    if a.is_cap is not None:
        _check(a.is_cap >= 1, "algorithm.is_cap", a.is_cap, "use a cap >= 1 (e.g. 2.0 to truncate, 3.0 to mask) or null")
    _check(a.entropy_coef >= 0, "algorithm.entropy_coef", a.entropy_coef, "use 0 (off) or a small positive coefficient, e.g. 1e-3")
    if a.entropy_control != "none":
        _check(
            a.policy_loss == "ppo", "algorithm.entropy_control", a.entropy_control,
            f"Clip-Cov and KL-Cov act on PPO's per-token ratio; policy_loss={a.policy_loss} "
            "has another objective. Use algorithm.policy_loss=ppo, or entropy_control=none",
        )  # fmt: skip
    _check(0 < a.clip_cov_ratio <= 1, "algorithm.clip_cov_ratio", a.clip_cov_ratio, "use a share in (0, 1], e.g. 2e-4")
    _check(
        a.clip_cov_low < a.clip_cov_high, "algorithm.clip_cov_high", a.clip_cov_high,
        f"the covariance window (clip_cov_low, clip_cov_high) is empty: use a value above "
        f"algorithm.clip_cov_low ({a.clip_cov_low}), e.g. 5",
    )  # fmt: skip
    _check(0 < a.kl_cov_ratio <= 1, "algorithm.kl_cov_ratio", a.kl_cov_ratio, "use a share in (0, 1], e.g. 2e-3")
    _check(a.kl_cov_coef >= 0, "algorithm.kl_cov_coef", a.kl_cov_coef, "use a value >= 0, e.g. 1")


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` for values that cannot work together."""
    _check_choices(cfg)
    a, r, t, d = cfg.algorithm, cfg.rollout, cfg.train, cfg.data
    _check(0 <= a.clip_low <= 1, "algorithm.clip_low", a.clip_low, "use a value in [0, 1], e.g. 0.2 (1: no lower bound)")
    _check(a.clip_high >= 0, "algorithm.clip_high", a.clip_high, "use a value >= 0, e.g. 0.28")
    _check(a.beta >= 0, "algorithm.beta", a.beta, "use 0 (no KL, DAPO) or a positive coefficient")
    _check(a.max_gen_rounds >= 1, "algorithm.max_gen_rounds", a.max_gen_rounds, "use at least 1")
    _check(a.max_empty_steps >= 1, "algorithm.max_empty_steps", a.max_empty_steps, "use at least 1")
    _check(
        0 <= a.skip_max_prob < 1,
        "algorithm.skip_max_prob",
        a.skip_max_prob,
        "use a value in [0, 1), e.g. 0.9; below 1 so that every prompt is still generated now and then",
    )
    _check(a.skip_key != "", "algorithm.skip_key", a.skip_key, "name a data field, or null for the prompt itself")
    _check(d.difficulty_key != "", "data.difficulty_key", d.difficulty_key, "name a data field, or null for the measured pass rate")
    _check(
        d.difficulty_key is None or d.curriculum != "none",
        "data.difficulty_key",
        d.difficulty_key,
        "it ranks prompts for data.curriculum, which is none; set data.curriculum=easy_first or leave it null",
    )
    measured = d.curriculum != "none" and d.difficulty_key is None
    _check(
        a.skip_key is None or a.skip_uniform_prompts or measured,
        "algorithm.skip_key",
        a.skip_key,
        "it keys the history of algorithm.skip_uniform_prompts (or of data.curriculum by pass "
        "rate), which is off; set algorithm.skip_uniform_prompts=true or leave it null",
    )
    _check(0 < d.curriculum_start <= 1, "data.curriculum_start", d.curriculum_start, "use a share in (0, 1], e.g. 0.2")
    _check(d.curriculum_steps >= 0, "data.curriculum_steps", d.curriculum_steps, "use 0 (half of train.steps) or a step count")
    _check(a.overlong_buffer >= 0, "algorithm.overlong_buffer", a.overlong_buffer, "use a value >= 0")
    _check(
        a.overlong_buffer < r.max_completion_length,
        "algorithm.overlong_buffer",
        a.overlong_buffer,
        f"the overlong buffer must be shorter than rollout.max_completion_length "
        f"({r.max_completion_length}); lower it or raise the maximum length",
    )
    _check(
        r.num_generations >= 2,
        "rollout.num_generations",
        r.num_generations,
        "group-relative advantages need at least 2 responses per prompt",
    )
    _check(r.temperature > 0, "rollout.temperature", r.temperature, "use a value > 0 (1.0 in the paper)")
    _check(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "use a value in (0, 1]")
    _check(r.top_k >= 0, "rollout.top_k", r.top_k, "use 0 (disabled) or a positive integer")
    _check(0 < r.eval_top_p <= 1, "rollout.eval_top_p", r.eval_top_p, "use a value in (0, 1]")
    _check(r.eval_temperature >= 0, "rollout.eval_temperature", r.eval_temperature, "use a value >= 0 (0 = greedy)")
    _check(r.eval_num_generations >= 1, "rollout.eval_num_generations", r.eval_num_generations, "use at least 1")
    _check(r.vllm_sync_every >= 1, "rollout.vllm_sync_every", r.vllm_sync_every, "use at least 1 (every optimizer update)")
    _check(
        0 < r.vllm_gpu_memory_utilization <= 1,
        "rollout.vllm_gpu_memory_utilization",
        r.vllm_gpu_memory_utilization,
        "use a share in (0, 1], e.g. 0.3",
    )
    _validate_loss_variants(cfg)
    _check_rollout_engine(cfg)
    lora = cfg.model.lora
    _check(lora.rank >= 0, "model.lora.rank", lora.rank, "use 0 (no LoRA) or a positive rank, e.g. 16")
    _check(lora.alpha > 0, "model.lora.alpha", lora.alpha, "use a positive alpha, e.g. 2 x the rank")
    _check(0 <= lora.dropout < 1, "model.lora.dropout", lora.dropout, "use a value in [0, 1)")
    _check(bool(lora.target_modules), "model.lora.target_modules", lora.target_modules,
           "name at least one linear layer, e.g. [q_proj, v_proj], or use [all-linear]")
    _check(r.max_completion_length >= 1, "rollout.max_completion_length", r.max_completion_length, "use at least 1")
    _check(r.generation_batch_size >= 1, "rollout.generation_batch_size", r.generation_batch_size, "use at least 1")
    _check(d.max_prompt_length >= 1, "data.max_prompt_length", d.max_prompt_length, "use at least 1")
    _check(t.steps >= 0, "train.steps", t.steps, "use 0 (evaluate only) or more rollout steps")
    _check(t.prompts_per_step >= 1, "train.prompts_per_step", t.prompts_per_step, "use at least 1")
    _check(
        1 <= t.mini_batch_size <= t.prompts_per_step and t.prompts_per_step % t.mini_batch_size == 0,
        "train.mini_batch_size",
        t.mini_batch_size,
        f"use a divisor of train.prompts_per_step ({t.prompts_per_step}); "
        f"{t.prompts_per_step} // mini_batch_size is the number of updates per rollout step",
    )
    _check(t.epochs >= 1, "train.epochs", t.epochs, "use at least 1")
    _check(t.micro_batch_tokens >= 1, "train.micro_batch_tokens", t.micro_batch_tokens, "use a positive token budget")
    _check(t.lr > 0, "train.lr", t.lr, "use a positive learning rate, e.g. 1e-6 for large models")
    _check(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "use a value >= 0")
    _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", t.min_lr_ratio, "use a value in [0, 1]")
    _check(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "use a value >= 0")
    _check(t.max_grad_norm >= 0, "train.max_grad_norm", t.max_grad_norm, "use 0 (no clipping) or a positive norm")
    _check(0 <= t.adam_beta1 < 1, "train.adam_beta1", t.adam_beta1, "use a value in [0, 1)")
    _check(0 <= t.adam_beta2 < 1, "train.adam_beta2", t.adam_beta2, "use a value in [0, 1)")
    _check(t.sample_budget >= 0, "train.sample_budget", t.sample_budget, "use 0 (no budget) or a count of responses")
    _check(t.max_nonfinite_updates >= 1, "train.max_nonfinite_updates", t.max_nonfinite_updates, "use at least 1")
    _check(t.logits_chunk_size >= 1, "train.logits_chunk_size", t.logits_chunk_size, "use at least 1")
    _check(cfg.reward.timeout_s > 0, "reward.timeout_s", cfg.reward.timeout_s, "use a positive number of seconds")
    _check(cfg.reward.num_workers >= 0, "reward.num_workers", cfg.reward.num_workers, "use 0 (in-process) or more workers")
    _check(cfg.checkpoint.save_every >= 0, "checkpoint.save_every", cfg.checkpoint.save_every, "use 0 (final only) or a positive step count")
    _check(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", cfg.checkpoint.keep_last, "keep at least 1 checkpoint")
    _check(cfg.logging.eval_every >= 0, "logging.eval_every", cfg.logging.eval_every, "use 0 or a positive step count")
    _check(bool(cfg.output_dir), "output_dir", cfg.output_dir, "give a directory for the run")
    for i, fn in enumerate(cfg.reward.functions):
        _check(bool(fn.name), f"reward.functions[{i}].name", fn.name, "a scorer name or module:function")
