"""Loading and validation: YAML files, ``key.path=value`` overrides, type coercion, aliases.

A run's :class:`~dapo.config.schema.Config` is built in this order: defaults, then the named
preset (``preset: dapo`` by default), then the YAML file, then the command-line overrides.
Unknown keys and bad values raise :class:`ConfigError` naming the key, the value and the fix.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml

from dapo.config import foreign
from dapo.config.algorithm import overlong_buffer_for
from dapo.config.fields import check_choice, choices_of, hints
from dapo.config.presets import PRESETS
from dapo.config.rules import validate
from dapo.config.schema import Config, TrainConfig
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


def aliases() -> dict[str, list[str]]:
    """Each config key and the TRL / verl names that suggest it (for the docs' reference)."""
    out: dict[str, list[str]] = {}
    for name, key in _ALIASES.items():
        out.setdefault(key, []).append(name)
    return out


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every key path of ``cls``, sections included: ``train``, ``train.lr``, ..."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = hints(cls)[f.name]
        path = f"{prefix}{f.name}"
        keys.append(path)
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, path + "."))
    return keys


def _unknown_key(path: str) -> ConfigError:
    leaf = path.rsplit(".", 1)[-1]
    suggestion = _ALIASES.get(leaf) or _ALIASES.get(path)
    if suggestion is None and path in foreign.trl_field_names():
        return ConfigError(
            f"unknown config key `{path}`: TRL's GRPOConfig name, which has no equivalent in "
            "dapo (the names that have one are translated: docs/guides/migrating.md)"
        )
    if suggestion is None:
        keys = all_keys()
        section = path.rsplit(".", 1)[0] + "." if "." in path else ""
        prefixed = [
            k for k in keys if k.startswith(section + leaf) and k.count(".") == path.count(".")
        ]
        if len(prefixed) == 1:  # an abbreviation: rollout.temp -> rollout.temperature
            return ConfigError(f"unknown config key `{path}`: did you mean `{prefixed[0]}`?")
        close = difflib.get_close_matches(path, keys, n=1, cutoff=0.6)
        if not close:
            by_leaf = {k.rsplit(".", 1)[-1]: k for k in keys}
            leaf_close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
            close = [by_leaf[leaf_close[0]]] if leaf_close else []
        suggestion = close[0] if close else None
    if suggestion == path:  # a known key given where it cannot be: never suggest itself
        suggestion = None
    hint = f"did you mean `{suggestion}`?" if suggestion else "see `dapo train --help-config`"
    return ConfigError(f"unknown config key `{path}`: {hint}")


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the type ``tp``, converting only where it is lossless; a
    ``Literal``'s value must be one of its choices as it is."""
    choices = choices_of(tp)
    if choices is not None and not (value is None and type(None) in get_args(tp)):
        check_choice(path, value, choices)
        return value
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
        shorthand = getattr(tp, "SHORTHAND", None)  # e.g. a reward function's bare name
        if shorthand and isinstance(value, str):
            value = {shorthand: value}
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


# Keys that were renamed: old path -> new path (the old one still reads, as the new one).
RENAMED = {"rollout.async_steps": "rollout.max_staleness"}


def _renamed(data: dict[str, Any], prefix: str) -> dict[str, Any]:
    out = dict(data)
    for old, new in RENAMED.items():
        section, _, leaf = old.rpartition(".")
        if prefix != section + "." or leaf not in out:
            continue
        new_leaf = new.rpartition(".")[2]
        value = out.pop(leaf)
        if new_leaf in out and out[new_leaf] != value:
            raise ConfigError(
                f"`{old}` = {value!r} and `{new}` = {out[new_leaf]!r} are one setting "
                f"(`{old}` is its former name): give only `{new}`"
            )
        out[new_leaf] = value
    return out


# While load_config builds a Config: the unknown key paths met, reported together.
_UNKNOWN: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "dapo_unknown_keys", default=None
)


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    types_ = hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    data = _renamed(data, prefix)
    kwargs = {}
    unknown = _UNKNOWN.get()
    for key, value in data.items():
        if key not in fields:
            if unknown is None:
                raise _unknown_key(f"{prefix}{key}")
            unknown.append(f"{prefix}{key}")
            continue
        kwargs[key] = _coerce(f"{prefix}{key}", value, types_[key])
    return cls(**kwargs)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


Path_ = tuple[str, ...]


def _leaves(
    data: dict[str, Any], cls: Any, prefix: Path_, origin: str | None, out: dict[Path_, Any]
) -> None:
    """The leaves of ``data`` (a layer: a YAML file's mapping or the overrides) into ``out``:
    key path -> (value, the key as given). Keys may be dotted at any section level and a
    mapping may mix dotted keys and sections; a key path given twice with two values is an
    error naming both.
    A dict-valued field's own keys (``reward.source_scorers``) are not split at dots."""
    for key, value in data.items():
        parts = str(key).split(".") if dataclasses.is_dataclass(cls) else [str(key)]
        tp, path = cls, prefix
        for i, part in enumerate(parts):
            fields = hints(tp) if dataclasses.is_dataclass(tp) else None
            if fields is None or part not in fields:  # a dict field's key, or unknown
                rest = parts[i:] if fields is not None else [".".join(parts[i:])]
                path, tp = path + tuple(rest), None
                break
            path, tp = path + (part,), _section_type(fields[part])
        given = origin or str(key)
        section = dataclasses.is_dataclass(tp) or (get_origin(tp) is dict and bool(value))
        if isinstance(value, dict) and section:  # an empty section sets nothing
            _leaves(value, tp, path, given, out)
            continue
        if dataclasses.is_dataclass(tp) and not isinstance(value, tp):  # as _coerce says it
            raise ConfigError(f"`{'.'.join(path)}` must be a mapping of keys, got {value!r}")
        for other in out:  # a section given as a value, or a value under a value
            shorter, longer = sorted((other, path), key=len)
            if other != path and longer[: len(shorter)] == shorter:
                name = ".".join(longer)
                raise ConfigError(
                    f"`{name}`: `{'.'.join(shorter)}` is a value, not a section (given as "
                    f"`{out[other][1]}` and `{given}`)"
                )
        if path in out and out[path][0] != value:  # the same value twice is harmless
            first, before = out[path][1], out[path][0]
            raise ConfigError(
                f"`{'.'.join(path)}` is given twice, as `{first}` ({before!r}) and as "
                f"`{given}` ({value!r}); give it once"
            )
        out[path] = (value, given)


def _section_type(tp: Any) -> Any:
    """A field's type as far as key paths go: the section's dataclass, ``dict``, or None."""
    if dataclasses.is_dataclass(tp) or get_origin(tp) is dict:
        return tp
    if get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _section_type(inner[0]) if len(inner) == 1 else None
    return None


def _nest(data: dict[str, Any]) -> dict[str, Any]:
    """``{"train.lr": 1e-5, "train": {"steps": 9}}`` -> ``{"train": {"lr": 1e-5, "steps": 9}}``:
    dotted keys and sections are merged (see :func:`_leaves`); the caller's mappings are
    never changed."""
    leaves: dict[Path_, Any] = {}
    _leaves(data, Config, (), None, leaves)
    out: dict[str, Any] = {}
    for path, (value, _) in leaves.items():
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _copy(value)
    return out


def _given_paths(data: dict[str, Any]) -> set[str]:
    """The dotted key paths a nested layer sets (``train.lr``)."""
    leaves: dict[Path_, Any] = {}
    _leaves(data, Config, (), None, leaves)
    return {".".join(path) for path in leaves}


def _copy(value: Any) -> Any:
    """``value`` with every mapping in it copied (the caller's mappings are never changed)."""
    return {k: _copy(v) for k, v in value.items()} if isinstance(value, dict) else value


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


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML config file holds; :class:`ConfigError` saying what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p} (give a YAML file path)")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {p} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "give a YAML file"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {_yaml_problem(exc)}") from exc
    except RecursionError as exc:
        raise ConfigError(f"config file {p} is nested too deeply to be a config") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of keys, got {data!r}")
    return data


def load_config(
    path: str | Path | dict[str, Any] | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    objects: Collection[str] = (),
    log: Callable[[str], None] | None = None,
) -> Config:
    """Defaults < preset < YAML file < overrides; validated.

    ``path`` may also be the mapping a YAML file would hold (``dapo.train(config={...})``).
    ``overrides`` are ``key.path=value`` strings (the command line) or a dict of dotted keys
    and sections (``{"train.lr": 1e-5, "rollout": {"temperature": 0.7}}``); a YAML file or
    mapping may use dotted keys too. ``objects``: keys given as Python objects instead
    (``rollout.environment``, ``rollout.tools`` from :func:`dapo.train`), which the rules
    count as set. ``train.mini_batch_size`` set nowhere follows ``train.prompts_per_step``;
    a rule refusing a value the user never set says where it came from. ``log`` gets the
    table of TRL or verl names translated (default: printed)."""
    raw = path if isinstance(path, dict) else {} if path is None else read_config_file(path)
    if isinstance(overrides, dict):
        dotted = dict(overrides)
    else:
        dotted = dict(parse_override(o) for o in overrides or [])
    # TRL's and verl's names: translated where they mean the same, else refused below.
    ours = frozenset(all_keys())
    raw, from_file = foreign.split_foreign(raw, ours)
    dotted, from_cli = foreign.split_foreign(dotted, ours)
    moved = [foreign.translate(from_file), foreign.translate(from_cli)]
    raw = {**raw, **moved[0].keys}
    dotted = {**dotted, **moved[1].keys}
    refused = moved[0].refused + moved[1].refused
    for translation in moved:
        if table := translation.table():
            (log or _print)(table)
    file_data = _nest(raw)
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
    preset_data = _nest(PRESETS[preset][1])
    data = _merge(_merge(preset_data, file_data), cli_data)
    data["preset"] = preset
    _eval_follows_train(data, file_data, cli_data)
    _correction_follows_staleness(data, file_data, cli_data)
    user = _given_paths(file_data) | _given_paths(cli_data)
    from_preset = _given_paths(preset_data)
    _mini_batch_follows(data, user | from_preset)
    unknown: list[str] = []
    token = _UNKNOWN.set(unknown)
    try:
        cfg = _build(Config, data)
    finally:
        _UNKNOWN.reset(token)
    if cfg.algorithm.overlong_buffer is None:  # the paper ties it to L_max: shown resolved
        cfg.algorithm.overlong_buffer = overlong_buffer_for(cfg.rollout.max_completion_length)
    _refuse_names(refused, unknown)
    try:
        validate(cfg, objects)
    except ConfigError as exc:
        key = exc.key
        if key is None or key in user or key == "preset":
            raise
        source = f"preset {preset}'s value" if key in from_preset else "the default"
        raise ConfigError(
            f"{exc} (you did not set `{key}`: its value is {source}; set {key} to one that "
            "fits the keys you set)",
            key=key,
        ) from None
    return cfg


def _refuse_names(refused: list[str], unknown: list[str]) -> None:
    """One error for every name that cannot be used: TRL and verl names refused with their
    reason, unknown keys with a suggestion where one means the same."""
    if not refused and len(unknown) == 1:
        raise _unknown_key(unknown[0])
    problems = refused + [str(_unknown_key(path)) for path in unknown]
    if len(problems) == 1:
        raise ConfigError(f"config name {problems[0]}")
    if problems:
        raise ConfigError(
            f"{len(problems)} config names cannot be used:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def _mini_batch_follows(data: dict[str, Any], given: set[str]) -> None:
    """``train.mini_batch_size`` set nowhere keeps its default while that divides
    ``train.prompts_per_step``, and is ``prompts_per_step`` (one update per step) otherwise."""
    train = data.get("train")
    if "train.mini_batch_size" in given or not isinstance(train, dict):
        return
    pps = train.get("prompts_per_step")
    default = TrainConfig().mini_batch_size
    if isinstance(pps, int) and not isinstance(pps, bool) and pps >= 1 and pps % default:
        train["mini_batch_size"] = pps


def _eval_follows_train(data: dict[str, Any], *layers: dict[str, Any]) -> None:
    """``data.eval``'s default is the held-out split of the default task. When a layer names
    other training data and none names ``data.eval``, that default would measure a task that
    is not trained: evaluate on the same built-in task's held-out split instead, and on
    nothing for a file or data set (it has no held-out split: set ``data.eval``)."""
    sections = [layer.get("data") for layer in layers]
    sections = [d for d in sections if isinstance(d, dict)]
    if not any("train" in d for d in sections) or any("eval" in d for d in sections):
        return
    train = data["data"]["train"]
    builtin = isinstance(train, str) and train.startswith("builtin:")
    data["data"]["eval"] = train if builtin else None


STALE_IS_CAP = 5.0  # AReaL's cap on the behaviour weight of decoupled PPO


def _correction_follows_staleness(data: dict[str, Any], *layers: dict[str, Any]) -> None:
    """Streaming rollouts (``rollout.max_staleness`` > 0) correct stale tokens by default:
    unless a layer sets ``algorithm.is_cap`` (null included), it is 5 with ``is_mode=mask``
    (unless a layer sets that): AReaL's decoupled objective with its cap."""
    rollout = _renamed(data.get("rollout") or {}, "rollout.")
    if not rollout.get("max_staleness"):
        return
    given = [layer.get("algorithm") for layer in layers]
    given = [a for a in given if isinstance(a, dict)]
    if any("is_cap" in a for a in given):
        return
    algorithm = data.setdefault("algorithm", {})
    algorithm["is_cap"] = STALE_IS_CAP
    if not any("is_mode" in a for a in given):
        algorithm["is_mode"] = "mask"


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a config from a nested dict (e.g. a saved ``config.yaml``)."""
    cfg = _build(Config, data)
    if cfg.preset not in PRESETS:
        raise ConfigError(f"`preset` = {cfg.preset!r} is not a known preset; run `dapo presets`")
    validate(cfg)
    return cfg


def _print(text: str) -> None:
    print(text, flush=True)
