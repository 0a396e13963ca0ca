"""Declaring a config field, and the one pass that checks every field's own constraints.

A field is declared with :func:`opt`: its default, its help text, and its bounds
(``ge``/``gt``/``le``/``lt``, ``nonempty``), kept in the field's metadata as a
:class:`Bounds`. An enumerated field is typed with a ``Literal`` of :mod:`dapo.choices`; the
allowed names are read from the type. :func:`check_fields` checks both for every field of a
config and its sections, so a bound is written once, next to its field. Rules between
fields are in :mod:`dapo.config.rules`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from dapo.errors import ConfigError


@dataclass(frozen=True)
class Bounds:
    """A field's bounds: numbers within ``ge``/``gt``/``le``/``lt``, or ``nonempty`` strings and
    lists; ``hint`` is added to the error (an example value, what the bound is for)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    nonempty: bool = False
    hint: str = ""

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is within the bounds (None and non-numbers: the type's business)."""
        if self.nonempty and isinstance(value, str | list | tuple | dict):
            return len(value) > 0
        if not isinstance(value, int | float) or isinstance(value, bool):
            return True
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def _ends(self) -> tuple[tuple[str, bool] | None, tuple[str, bool] | None]:
        """(lower, inclusive) and (upper, inclusive), as written in a config."""
        low = (_num(self.ge), True) if self.ge is not None else None
        low = low or ((_num(self.gt), False) if self.gt is not None else None)
        high = (_num(self.le), True) if self.le is not None else None
        high = high or ((_num(self.lt), False) if self.lt is not None else None)
        return low, high

    def rule(self) -> str:
        """The bound as an interval or inequality: ``in [0, 1)``, ``>= 2``, ``non-empty``."""
        if self.nonempty:
            return "non-empty"
        low, high = self._ends()
        if low and high:
            return f"in {'[' if low[1] else '('}{low[0]}, {high[0]}{']' if high[1] else ')'}"
        if low:
            return f"{'>=' if low[1] else '>'} {low[0]}"
        assert high is not None
        return f"{'<=' if high[1] else '<'} {high[0]}"

    def summary(self) -> str:
        """The bound for ``--help-config``: ``0 < x <= 1``, ``x >= 2``, ``non-empty``."""
        if self.nonempty:
            return "non-empty"
        low, high = self._ends()
        if low and high:
            return f"{low[0]} {'<=' if low[1] else '<'} x {'<=' if high[1] else '<'} {high[0]}"
        return f"x {self.rule()}"

    def fix(self, optional: bool) -> str:
        """What to write instead, for the error message."""
        text = f"use a {self.rule()} value" if self.nonempty else f"use a value {self.rule()}"
        text += " or null" if optional else ""
        return text + (f" ({self.hint})" if self.hint else "")


def _num(x: float) -> str:
    """A bound as written in a config: 1 not 1.0, 0.001 as 0.001."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def opt(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    nonempty: bool = False,
    hint: str = "",
    secret: bool = False,
    paper: str | None = None,
) -> Any:
    """A dataclass field with ``metadata={"help": ..., "bounds": Bounds(...)}``.

    ``factory`` replaces ``default`` for mutable defaults (lists, dicts, sections). ``ge``,
    ``gt``, ``le``, ``lt`` bound a number (a None of an optional field passes); ``nonempty``
    refuses an empty string or list; ``hint`` is added to the bound's error message.
    ``secret``: the value (an API key) is written as null wherever the config is written
    out (:func:`without_secrets`). ``paper``: the DAPO paper's value, as written in a config
    (shown by the docs' configuration reference).
    """
    metadata: dict[str, Any] = {"help": " ".join(help.split())}
    if paper is not None:
        metadata["paper"] = paper
    if secret:
        metadata["secret"] = True
    bounds = Bounds(ge=ge, gt=gt, le=le, lt=lt, nonempty=nonempty, hint=hint)
    if bounds != Bounds(hint=hint):
        metadata["bounds"] = bounds
    elif hint:
        raise TypeError("opt(hint=...) explains a bound: give ge, gt, le, lt or nonempty too")
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved type of each field of a config section."""
    return typing.get_type_hints(cls)


def is_optional(tp: Any) -> bool:
    return get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp)


def choices_of(tp: Any) -> tuple[Any, ...] | None:
    """The allowed values of a ``Literal`` type (or an optional one); None for other types."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return choices_of(inner[0]) if len(inner) == 1 else None
    return get_args(tp) if get_origin(tp) is Literal else None


def check_choice(path: str, value: Any, choices: tuple[Any, ...]) -> None:
    """``value`` must be one of ``choices`` (a ``Literal`` field's): no conversion (1 is not
    true); the hint spells a boolean choice as YAML does."""
    if not any(type(value) is type(c) and value == c for c in choices):
        spelled = [str(c).lower() if isinstance(c, bool) else str(c) for c in choices]
        close = difflib.get_close_matches(str(value), spelled, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"`{path}` = {value!r} is not one of {list(choices)}{hint}")


def require(ok: bool, key: str, value: Any, fix: str) -> None:
    """Raise the error of a broken rule: the key, its value, and what to do."""
    if not ok:
        raise ConfigError(f"`{key}` = {value!r} is invalid: {fix}", key=key)


def without_secrets(obj: Any, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (``dataclasses.asdict(obj)``) with every ``secret`` field of ``obj`` and of its
    sections set to None, in place: what config.yaml, checkpoints and logs receive."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("secret"):
            data[f.name] = None
        elif dataclasses.is_dataclass(value):
            without_secrets(value, data[f.name])
        elif isinstance(value, list):
            for item, plain in zip(value, data[f.name], strict=True):
                if dataclasses.is_dataclass(item):
                    without_secrets(item, plain)
    return data


def check_fields(obj: Any, prefix: str = "") -> None:
    """Every field of ``obj`` and of its sections (list items included) holds one of its
    ``Literal``'s choices and is within its bounds."""
    types_ = hints(type(obj))
    for f in dataclasses.fields(obj):
        path, value, tp = f"{prefix}{f.name}", getattr(obj, f.name), types_[f.name]
        choices = choices_of(tp)
        if choices is not None and not (value is None and is_optional(tp)):
            check_choice(path, value, choices)
        bounds = f.metadata.get("bounds")
        if bounds is not None and not bounds.holds(value):
            require(False, path, value, bounds.fix(is_optional(tp)))
        if dataclasses.is_dataclass(value):
            check_fields(value, path + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_fields(item, f"{path}[{i}].")
