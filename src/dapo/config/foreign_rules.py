"""The rule kinds that translate a TRL or verl option to dapo's keys (:mod:`dapo.config.foreign`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Convert = Callable[[Any, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Rule:
    """What one foreign name becomes: ``key`` (same meaning and value), or ``convert``
    (value and all given names -> dapo keys), or refused (``why``) / ignored (``ignore``)."""

    key: str | None = None
    convert: Convert | None = None
    why: str = ""  # refused: the reason and what to set instead
    ignore: str = ""  # accepted and dropped: why it changes nothing here
    note: str = ""  # what the table says of a conversion


def same(key: str) -> Rule:
    return Rule(key=key)


def refuse(why: str) -> Rule:
    return Rule(why=why)


def ignore(why: str) -> Rule:
    return Rule(ignore=why)


def mapped(key: str, values: Mapping[Any, Any], note: str = "") -> Rule:
    """A setting whose values have other names here; an unmapped value is refused."""

    def convert(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if value not in values:
            known = ", ".join(repr(v) for v in values)
            raise ValueError(f"its value {value!r} has no equivalent here (dapo takes {known})")
        return {key: values[value]}

    return Rule(convert=convert, note=note)


def report_to(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    out = {"logging.wandb": "wandb" in names, "logging.tensorboard": "tensorboard" in names}
    if "all" in names:
        out = {"logging.wandb": True, "logging.tensorboard": True}
    return out


def positive_steps(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if int(value) <= 0:
        return {}  # TRL's "not set": num_train_epochs decides, refused below
    return {"train.steps": int(value)}


def bool_to(key: str, true: Any, false: Any) -> Rule:
    """A true/false setting that is one value of a dapo key."""

    def convert(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(value, bool):
            raise ValueError(f"it is true or false here; did you mean `{key}`?")
        return {key: true if value else false}

    return Rule(convert=convert, note=f"true: {true}, false: {false}")


def never_is_zero(key: str) -> Rule:
    """verl's every-N-steps settings, where -1 is never; dapo's never is 0."""
    return Rule(convert=lambda v, _: {key: max(int(v), 0)}, note="-1 (never) -> 0")


def false_only(why: str) -> Rule:
    """A switch dapo has no equivalent for when on (off is what dapo does)."""

    def convert(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if value:
            raise ValueError(why)
        return {}

    return Rule(convert=convert, note="false only: what dapo does")


def true_only(why: str) -> Rule:
    """A switch dapo has no equivalent for when off (on is what dapo does)."""

    def convert(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if not value:
            raise ValueError(why)
        return {}

    return Rule(convert=convert, note="true only: what dapo does")


# TRL's vllm_importance_sampling_mode: (algorithm.is_level, algorithm.is_mode).
