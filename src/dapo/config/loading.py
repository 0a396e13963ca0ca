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

from dapo.config.fields import check_choice, choices_of, hints
from dapo.config.presets import PRESETS
from dapo.config.rules import validate
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


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    types_ = hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(f"{prefix}{key}")
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


def _nest(dotted: dict[str, Any]) -> dict[str, Any]:
    """``{"train.lr": 1e-5, "train": {"steps": 9}}`` -> ``{"train": {"lr": 1e-5, "steps": 9}}``:
    dotted keys and sections given as mappings (``dapo.train(train={...})``) are merged."""
    out: dict[str, Any] = {}
    for path, value in dotted.items():
        parts = str(path).split(".")
        node = out
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"`{path}`: `{part}` is a value, not a section")
            node = nxt
        leaf = parts[-1]
        if isinstance(value, dict):  # a copy, merged with what dotted keys set before it
            value = _merge(node[leaf] if isinstance(node.get(leaf), dict) else {}, _copy(value))
        node[leaf] = value
    return out


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
) -> Config:
    """Defaults < preset < YAML file < overrides; validated.

    ``path`` may also be the mapping a YAML file would hold (``dapo.train(config={...})``).
    ``overrides`` are ``key.path=value`` strings (the command line) or a dict of dotted keys
    and sections (``{"train.lr": 1e-5, "rollout": {"temperature": 0.7}}``)."""
    if isinstance(path, dict):
        file_data = _copy(path)
    else:
        file_data = {} if path is None else read_config_file(path)
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
    _eval_follows_train(data, file_data, cli_data)
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


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


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a config from a nested dict (e.g. a saved ``config.yaml``)."""
    cfg = _build(Config, data)
    if cfg.preset not in PRESETS:
        raise ConfigError(f"`preset` = {cfg.preset!r} is not a known preset; run `dapo presets`")
    validate(cfg)
    return cfg
