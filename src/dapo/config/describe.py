"""``dapo train --help-config``: every key with its default, type or choices, bounds and help."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, get_args, get_origin

from dapo.config.algorithm import overlong_buffer
from dapo.config.fields import choices_of, hints, is_optional
from dapo.config.schema import Config


def _show(value: Any) -> str:
    """A default as it would be written in YAML or in a ``key=value`` override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict) and not value:
        return "[]" if isinstance(value, list) else "{}"
    return str(value)


def _kind(f: dataclasses.Field, tp: Any) -> str:
    """``float, 0 <= x <= 1``, ``ppo | gspo | cispo``, ``str | null, non-empty``."""
    choices = choices_of(tp)
    if choices is not None:
        kind = " | ".join(map(str, choices)) + (" | null" if is_optional(tp) else "")
    else:
        kind = str(f.type).replace(" | None", " | null")
    bounds = f.metadata.get("bounds")
    return f"{kind}, {bounds.summary()}" if bounds is not None else kind


def _entry(path: str, f: dataclasses.Field, tp: Any, width: int) -> list[str]:
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:  # pragma: no cover - every field has a default
        default = "(required)"
    lines = [f"  {path} = {_show(default)}    [{_kind(f, tp)}]"]
    lines += textwrap.wrap(
        f.metadata.get("help", ""),
        width,
        initial_indent="      ",
        subsequent_indent="      ",
        break_on_hyphens=False,
    )
    return lines


def _list_item(tp: Any) -> type | None:
    """The section type of a list of sections (``reward.functions``), else None."""
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        return item if dataclasses.is_dataclass(item) else None
    return None


def _section(cls: type, prefix: str, width: int) -> list[str]:
    """A section's keys, then each of its subsections (e.g. ``model.lora``) after it."""
    out: list[str] = []
    subsections = []
    for f in dataclasses.fields(cls):
        tp = hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            subsections.append(f)
            continue
        out += _entry(f"{prefix}{f.name}", f, tp, width)
        item = _list_item(tp)
        if item is not None:  # the fields of each item of the list
            for g in dataclasses.fields(item):
                path = f"{prefix}{f.name}[i].{g.name}"
                entry = _entry(path, g, hints(item)[g.name], width - 4)
                out += ["    " + line for line in entry]
    for sub in subsections:
        out += ["", f"{prefix}{sub.name}: {sub.metadata['help']}"]
        out += _section(hints(cls)[sub.name], f"{prefix}{sub.name}.", width)
    return out


def describe_config(width: int = 92) -> str:
    """Every key as ``section.key = default  [type or choices, bounds]`` with its help."""
    intro = (
        "Config keys, set in a YAML file (sections as mappings) or as key.path=value "
        "overrides; the file beats the preset, the overrides beat the file. The defaults shown "
        "are the built-in ones, i.e. preset=dapo; the other presets change algorithm.* keys "
        "(`dapo presets`). After each default, in brackets: its type or choices, and its bounds "
        "(x is the value)."
    )
    out = [*textwrap.wrap(intro, width), "", "top level"]
    return "\n".join(out + _section(Config, "", width))


def run_plan(cfg: Config) -> str:
    """The start-up line of what one rollout step does: its batch, its optimizer updates
    (prompts per step / mini-batch x epochs) and the soft overlong punishment's window."""
    t, r, a = cfg.train, cfg.rollout, cfg.algorithm
    updates = -(-t.prompts_per_step // t.mini_batch_size) * t.epochs
    plan = (
        f"per rollout step: {t.prompts_per_step} prompts x {r.num_generations} responses, "
        f"{updates} optimizer update{'' if updates == 1 else 's'} (train.prompts_per_step "
        f"{t.prompts_per_step} / train.mini_batch_size {t.mini_batch_size} x train.epochs "
        f"{t.epochs})"
    )
    max_len = r.max_completion_length
    if not a.overlong_penalty:
        return f"{plan}; soft overlong punishment off (L_max {max_len})"
    buffer = overlong_buffer(a.overlong_buffer, max_len)
    return (
        f"{plan}; overlong window: responses over {max_len - buffer} tokens penalised, down to "
        f"-{a.overlong_penalty_factor:g} at {max_len} (algorithm.overlong_buffer {buffer}, "
        f"rollout.max_completion_length {max_len})"
    )
