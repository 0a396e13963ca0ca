"""User reward functions: ``module:function`` / ``file.py:function`` specs and Python
callables, loaded into a table of :class:`RewardFn`, and running them on one sample.

A reward function is called ``fn(response, ground_truth, data_source=...)`` when it accepts
``data_source`` (or ``**kwargs``), else ``fn(response, ground_truth)``, and returns a number.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo import workers
from dapo.errors import ConfigError
from dapo.rewards.math import SCORERS

SPEC_FORMS = "'package.module:function' or 'path/to/file.py:function'"

# How running the functions of one sample ended: (OK, values) or (kind, fn id, detail).
OK, TIMEOUT, ERROR, BAD_VALUE = "ok", "timeout", "error", "bad_value"
Outcome = tuple[Any, ...]


# ---------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------


def is_file_spec(module_part: str) -> bool:
    """Whether the part before ``:`` of a spec is a file path rather than a module name."""
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def split_spec(spec: str) -> tuple[str, str]:
    """``(module or file, attribute)`` of a spec; ValueError naming the forms if malformed."""
    module_part, sep, attr = str(spec).rpartition(":")
    module_part, attr = module_part.strip(), attr.strip()
    if not sep or not module_part or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", attr):
        raise ValueError(f"reward function spec {spec!r} is malformed: expected {SPEC_FORMS}")
    return module_part, attr


def worker_spec(spec: str, where: str, in_workers: bool) -> str:
    """``spec`` as a worker process loads it (a file spec made absolute: a worker's working
    directory may differ); ValueError naming ``where`` for a spec that no worker can load."""
    module_part, attr = split_spec(spec)
    if module_part == "__main__" and in_workers:
        raise ValueError(
            f"{where} {spec!r}: worker processes cannot see functions of the main script; "
            "pass the function itself instead of its name, move it to a module, or name "
            "the script's file ('path/to/script.py:function', guarded by "
            "if __name__ == '__main__')"
        )
    if is_file_spec(module_part):
        module_part = str(Path(module_part).expanduser().resolve())
    return f"{module_part}:{attr}"


def _import_file(spec: str, path_text: str) -> Any:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward function spec {spec!r}: file {str(path)!r} not found")
    try:
        return workers.import_file(path, "_dapo_reward_")
    except workers.NotPythonError as e:
        raise ValueError(f"reward function spec {spec!r}: {e}") from e
    except BaseException as e:
        raise ValueError(
            f"reward function spec {spec!r}: running {str(path)!r} raised {type(e).__name__}: {e}"
        ) from e


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
    """Load ``package.module:function`` or ``path/to/file.py:function`` (dotted attributes
    allowed)."""
    module_part, attr = split_spec(spec)
    if is_file_spec(module_part):
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


# ---------------------------------------------------------------------------
# The function table
# ---------------------------------------------------------------------------


def check_signature(fn: Callable[..., Any], where: str) -> None:
    """Refuse, naming ``where``, a reward that cannot be called as dapo calls it:
    ``fn(response, ground_truth)``, plus ``data_source=`` when it takes it. Every path a
    reward comes by (``reward.functions`` specs on the command line or in YAML, callables
    from Python) is checked here when the run is set up, before any model is loaded."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return
    try:
        sig.bind("response", "ground truth")
    except TypeError:
        raise ConfigError(
            f"{where} ({callable_name(fn)}{sig}) cannot be called as fn(response, ground_truth): "
            "a reward takes one response (str) and its ground truth (str), and optionally "
            "data_source=..., and returns a number (TRL's batched fn(completions, **kwargs) "
            "form is not supported)"
        ) from None
    batched = sorted(_BATCH_NAMES & set(sig.parameters))
    if batched:
        raise ConfigError(
            f"{where} ({callable_name(fn)}{sig}) takes {', '.join(batched)}: TRL's batched "
            "form fn(completions, **kwargs) -> list, which dapo does not call; a reward takes "
            "one response (str) and its ground truth (str) and returns a number"
        )
    first = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ][:2]
    if len(first) == 2 and (first[0] in _TRUTH_NAMES or first[1] in _RESPONSE_NAMES):
        raise ConfigError(
            f"{where} ({callable_name(fn)}{sig}) names its parameters in another order than "
            "dapo passes them: fn(response, ground_truth); reorder them (or wrap the function)"
        )


_BATCH_NAMES = frozenset({"completions", "prompts", "completion_ids"})
_TRUTH_NAMES = frozenset({"ground_truth", "answer", "solution", "target", "reference", "gt"})
_RESPONSE_NAMES = frozenset({"response", "completion", "solution_str", "output", "prediction"})


def accepts_data_source(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes ``data_source`` by keyword (that parameter, or ``**kwargs``)."""
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
class RewardFn:
    """A loaded reward function: its display name and how to call it."""

    name: str
    fn: Callable[..., Any]
    takes_data_source: bool

    @classmethod
    def of(cls, name: str, fn: Callable[..., Any]) -> RewardFn:
        return cls(name, fn, accepts_data_source(fn))


Source = str | bytes | None  # a SCORERS name or a spec, a pickled callable, or not here


def load_entry(name: str, source: Source) -> RewardFn | None:
    """The table entry of one function: a built-in scorer, a spec, or a pickled callable
    (:func:`pickle_function`); None for a function this process does not run."""
    if source is None:
        return None
    if isinstance(source, bytes):
        try:
            return RewardFn.of(name, pickle.loads(source))
        except Exception as e:
            raise ValueError(f"reward function {name!r} could not be unpickled: {e!r}") from e
    if source in SCORERS:
        return RewardFn(name, SCORERS[source], False)
    return RewardFn.of(name, load_reward_function(source))


def callable_name(fn: Callable[..., Any]) -> str:
    """A reward callable's display name: its qualified name (``<lambda>``,
    ``make_reward.<locals>.reward``) or, for a callable object, its class's."""
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def pickle_function(fn: Callable[..., Any]) -> bytes:
    """``fn`` serialised with cloudpickle, so that a worker process can run it: functions of
    ``__main__`` or a notebook, lambdas and closures go by value, with what they capture;
    functions of importable modules by reference. Checked by unpickling it here once.
    ValueError saying why when it cannot be (it captures a lock, a file, a socket...)."""
    import cloudpickle

    try:
        data = cloudpickle.dumps(fn)
        pickle.loads(data)
    except Exception as e:
        raise ValueError(f"{type(e).__name__}: {e}") from e
    return data


# ---------------------------------------------------------------------------
# Running one sample
# ---------------------------------------------------------------------------


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


def describe_exception(e: BaseException) -> str:
    """What a failure warning says about a user function's exception (at most 500 characters;
    :func:`dapo.workers.describe_exception`)."""
    return workers.describe_exception(e, 500)


def run_sample(
    table: list[RewardFn | None],
    fn_ids: tuple[int, ...],
    response: str,
    ground_truth: str,
    data_source: str,
    on_call: Callable[[int], None] | None = None,
) -> Outcome:
    """Run the functions ``fn_ids`` of ``table`` on one sample: ``(OK, values)``, or
    ``(kind, fn id, detail)`` for the first that raised or returned a non-number."""
    values = []
    for fid in fn_ids:
        if on_call is not None:
            on_call(fid)
        entry = table[fid]
        assert entry is not None, f"reward function {fid} is not loaded in this process"
        try:
            if entry.takes_data_source:
                value = entry.fn(response, ground_truth, data_source=data_source)
            else:
                value = entry.fn(response, ground_truth)
        except Exception as e:
            return (ERROR, fid, describe_exception(e))
        x = _as_number(value)
        if x is None:
            text = repr(value)
            return (BAD_VALUE, fid, text if len(text) <= 200 else text[:200] + "...")
        values.append(x)
    return (OK, values)
