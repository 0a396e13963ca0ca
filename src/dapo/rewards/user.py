"""User reward functions: load ``module:function`` / ``file.py:function`` and run one sample."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapo.rewards.math import SCORERS

if TYPE_CHECKING:
    pass


# ---------------------------------------------------------------------------
# User reward functions
# ---------------------------------------------------------------------------

_SPEC_FORMS = "'package.module:function' or 'path/to/file.py:function'"


def _is_file_spec(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def _split_spec(spec: str) -> tuple[str, str]:
    module_part, sep, attr = str(spec).rpartition(":")
    module_part, attr = module_part.strip(), attr.strip()
    if not sep or not module_part or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", attr):
        raise ValueError(f"reward function spec {spec!r} is malformed: expected {_SPEC_FORMS}")
    return module_part, attr


def _import_file(spec: str, path_text: str) -> Any:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward function spec {spec!r}: file {str(path)!r} not found")
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_dapo_reward_{stem}_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward function spec {spec!r}: cannot load {str(path)!r} as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        raise ValueError(
            f"reward function spec {spec!r}: running {str(path)!r} raised {type(e).__name__}: {e}"
        ) from e
    return module


def _import_module(spec: str, name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise ValueError(
                f"reward function spec {spec!r}: module {name!r} not found "
                f"(no module named {e.name!r}); check the spelling, install the package or "
                "add its directory to PYTHONPATH, or give a file path 'path/to/file.py:function'"
            ) from e
        raise ValueError(
            f"reward function spec {spec!r}: importing module {name!r} failed: {e}"
        ) from e
    except Exception as e:
        raise ValueError(
            f"reward function spec {spec!r}: importing module {name!r} raised "
            f"{type(e).__name__}: {e}"
        ) from e


def _callables_of(module: Any, limit: int = 10) -> str:
    own = sorted(
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and callable(v)
        and getattr(v, "__module__", None) == module.__name__
    )
    names = own or sorted(
        n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
    )
    if not names:
        return "it defines no public callables"
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return "callables it defines: " + ", ".join(names[:limit]) + more


def load_reward_function(spec: str) -> Callable[..., Any]:
    """Load ``package.module:function`` or ``path/to/file.py:function`` (dotted attributes allowed)."""
    module_part, attr = _split_spec(spec)
    if _is_file_spec(module_part):
        module = _import_file(spec, module_part)
        where = f"file {module_part!r}"
    else:
        module = _import_module(spec, module_part)
        where = f"module {module_part!r}"
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward function spec {spec!r}: {where} has no attribute {attr!r}; "
                f"{_callables_of(module)}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(
            f"reward function spec {spec!r}: {attr!r} is a {type(obj).__name__}, not a function"
        )
    return obj


def _accepts_data_source(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind == p.VAR_KEYWORD
        or (p.name == "data_source" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for p in params
    )


@dataclass
class _Fn:
    """A loaded reward function: its display name and how to call it."""

    name: str
    fn: Callable[..., Any]
    takes_data_source: bool


def _load_entry(name: str, load_spec: str) -> _Fn:
    if load_spec in SCORERS:
        return _Fn(name, SCORERS[load_spec], False)
    fn = load_reward_function(load_spec)
    return _Fn(name, fn, _accepts_data_source(fn))


# ---------------------------------------------------------------------------
# Running one sample
# ---------------------------------------------------------------------------

_OK, _TIMEOUT, _ERROR, _BAD = "ok", "timeout", "error", "bad_value"


def _as_number(value: Any) -> float | None:
    """``value`` as a finite float (bools count as 0/1), or None."""
    if isinstance(value, numbers.Real):
        x = float(value)
    elif value is None or isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        return None
    else:
        try:
            x = float(value)
        except Exception:
            return None
    return x if math.isfinite(x) else None


def _describe_exception(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        code = tb.tb_frame.f_code
        text += f" (at {code.co_filename}:{tb.tb_lineno} in {code.co_name})"
    return text[:500]


def _run_item(
    table: list[_Fn],
    fn_ids: tuple[int, ...],
    response: str,
    ground_truth: str,
    data_source: str,
    on_call: Callable[[int], None] | None = None,
) -> tuple[Any, ...]:
    """Run the functions of one sample: ``(ok, values)`` or ``(kind, fn_id, detail)``."""
    values = []
    for fid in fn_ids:
        if on_call is not None:
            on_call(fid)
        entry = table[fid]
        try:
            if entry.takes_data_source:
                value = entry.fn(response, ground_truth, data_source=data_source)
            else:
                value = entry.fn(response, ground_truth)
        except Exception as e:
            return (_ERROR, fid, _describe_exception(e))
        x = _as_number(value)
        if x is None:
            text = repr(value)
            return (_BAD, fid, text if len(text) <= 200 else text[:200] + "...")
        values.append(x)
    return (_OK, values)
