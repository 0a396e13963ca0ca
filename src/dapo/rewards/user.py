"""User reward functions: ``module:function`` / ``file.py:function`` specs and Python
callables, loaded into a table of :class:`RewardFn`, and running them on samples.

A function is called in one of three forms, recognised by its parameter names
(:func:`reward_form`):

- ``sample`` (dapo's): ``fn(response, ground_truth)``, plus ``data_source=...`` when it takes
  it, once per response;
- ``trl`` (TRL's ``GRPOTrainer``): ``fn(prompts=[...], completions=[...],
  completion_ids=[...], <column>=[...], trainer_state=...)`` once per group of responses,
  returning a list with a number or ``None`` ("not applicable") per response; conversational
  completions are message lists when the prompt was;
- ``verl`` (verl's ``compute_score``): ``fn(data_source=..., solution_str=...,
  ground_truth=..., extra_info=...)`` once per response.

Each returns a number or a dict with ``score`` (its other numeric fields are logged, an
``acc`` field says whether the response is correct).
"""

from __future__ import annotations

import functools
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
from types import SimpleNamespace
from typing import Any, NamedTuple

from dapo import workers
from dapo.errors import ConfigError
from dapo.rewards.code import score_group
from dapo.rewards.math import SCORERS

SPEC_FORMS = "'package.module:function' or 'path/to/file.py:function'"

# How running the functions of one sample ended: (OK, values, info) or (kind, fn id,
# detail). A value is a float, or None for a TRL-form "not applicable"; info holds the
# numeric fields a function returned beside its score (and what it logged).
OK, TIMEOUT, ERROR, BAD_VALUE = "ok", "timeout", "error", "bad_value"
Outcome = tuple[Any, ...]

# The forms a reward function is called in (see the module's docstring); GROUP is the code
# scorer's own: fn(samples) -> one value per sample, once per group.
SAMPLE, TRL, VERL, GROUP = "sample", "trl", "verl", "group"
BATCHED = frozenset({TRL, GROUP})  # the forms called once per group of responses


class Sample(NamedTuple):
    """One response to score, with what the three forms may ask of its prompt's row."""

    response: str
    ground_truth: Any  # a string, or the row's whole answer when it is a dict
    data_source: str
    prompt: Any = None  # the prompt as text or chat messages
    columns: dict[str, Any] | None = None  # the row's other fields
    completion_ids: tuple[int, ...] = ()
    step: int = 0  # the rollout step (TRL's trainer_state.global_step)


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


def reward_form(fn: Callable[..., Any]) -> str:
    """How ``fn`` is called, from its parameter names: :data:`TRL` when it takes
    ``completions``, ``prompts`` or ``completion_ids``; :data:`VERL` when it takes
    ``solution_str``; else :data:`SAMPLE`."""
    names = set(_parameters(fn))
    if names & _BATCH_NAMES:
        return TRL
    if "solution_str" in names:
        return VERL
    return SAMPLE


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return {}


def check_signature(fn: Callable[..., Any], where: str) -> None:
    """Refuse, naming ``where``, a reward that cannot be called in the form its parameter
    names say (:func:`reward_form`). Every path a reward comes by (``reward.functions`` specs
    on the command line or in YAML, callables from Python) is checked here when the run is
    set up, before any model is loaded."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return
    form = reward_form(fn)
    shown = f"{where} ({callable_name(fn)}{sig})"
    if form == TRL:
        positional = [p.name for p in sig.parameters.values() if p.kind == p.POSITIONAL_ONLY]
        if positional:
            raise ConfigError(
                f"{shown} takes {', '.join(positional)} by position only; TRL's form passes "
                "every argument by keyword (prompts=, completions=, completion_ids=, the "
                "dataset's columns): drop the '/' from its parameters"
            )
        return
    if form == VERL:
        try:
            sig.bind(data_source="s", solution_str="r", ground_truth="g")
        except TypeError as e:
            raise ConfigError(
                f"{shown} looks like verl's compute_score(data_source, solution_str, "
                f"ground_truth, extra_info=None) but cannot be called so: {e}"
            ) from None
        return
    try:
        sig.bind("response", "ground truth")
    except TypeError:
        raise ConfigError(
            f"{shown} cannot be called in any form dapo knows: fn(response, ground_truth) "
            "one response at a time; TRL's fn(completions, **kwargs) -> list (a parameter "
            "named completions, prompts or completion_ids); or verl's "
            "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
        ) from None
    first = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ][:2]
    if len(first) == 2 and (first[0] in _TRUTH_NAMES or first[1] in _RESPONSE_NAMES):
        raise ConfigError(
            f"{shown} names its parameters in another order than dapo passes them: "
            "fn(response, ground_truth); reorder them (or wrap the function)"
        )


def missing_columns(fn: Callable[..., Any], columns: set[str]) -> list[str]:
    """The required parameters of a TRL-form ``fn`` that neither TRL's own arguments nor
    the dataset's ``columns`` give."""
    given = _BATCH_NAMES | _TRL_EXTRAS | columns
    return [
        p.name
        for p in _parameters(fn).values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.default is p.empty
        and p.name not in given
    ]


_BATCH_NAMES = frozenset({"completions", "prompts", "completion_ids"})
_TRL_EXTRAS = frozenset({"trainer_state", "log_metric", "log_extra"})
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
    form: str = SAMPLE
    accepts: frozenset[str] | None = None  # keyword names it takes; None: any (**kwargs)

    @classmethod
    def of(cls, name: str, fn: Callable[..., Any]) -> RewardFn:
        params = _parameters(fn).values()
        any_kw = not params or any(p.kind == p.VAR_KEYWORD for p in params)
        names = None if any_kw else frozenset(p.name for p in params)
        return cls(name, fn, accepts_data_source(fn), reward_form(fn), names)

    def takes(self, name: str) -> bool:
        return self.accepts is None or name in self.accepts


Source = str | bytes | None  # a SCORERS name or a spec, a pickled callable, or not here


def load_entry(
    name: str, source: Source, options: dict[str, dict[str, Any]] | None = None
) -> RewardFn | None:
    """The table entry of one function: a built-in scorer (with its ``options``, e.g. the
    ``reward.code`` settings under ``"code"``), a spec, or a pickled callable
    (:func:`pickle_function`); None for a function this process does not run."""
    if source is None:
        return None
    if isinstance(source, bytes):
        try:
            return RewardFn.of(name, pickle.loads(source))
        except Exception as e:
            raise ValueError(f"reward function {name!r} could not be unpickled: {e!r}") from e
    if source == "code":  # one call per group: its programs run side by side
        own = (options or {}).get("code", {})
        return RewardFn(name, functools.partial(score_group, **own), False, GROUP)
    if source in SCORERS:
        return RewardFn(name, SCORERS[source], False)
    return RewardFn.of(name, load_reward_function(source))


def callable_name(fn: Callable[..., Any]) -> str:
    """A reward callable's display name: its qualified name (``<lambda>``,
    ``make_reward.<locals>.reward``) or, for a callable object, its class's."""
    own = getattr(fn, "__qualname__", None)
    if own:
        return own
    named = getattr(fn, "__name__", None)  # a callable object whose class names it
    return named if isinstance(named, str) and named else type(fn).__qualname__


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


def _as_score(value: Any, info: dict[str, float]) -> float | None:
    """A function's return as its score: a number, or a dict's ``score`` (its other numeric
    fields go to ``info``); None for anything else."""
    if isinstance(value, dict):
        score = _as_number(value.get("score"))
        if score is not None:
            for key, field_value in value.items():
                x = _as_number(field_value)
                if key != "score" and x is not None:
                    info[str(key)] = x
        return score
    return _as_number(value)


def _bad(fid: int, value: Any) -> Outcome:
    text = repr(value)
    return (BAD_VALUE, fid, text if len(text) <= 200 else text[:200] + "...")


def describe_exception(e: BaseException) -> str:
    """What a failure warning says about a user function's exception (at most 500 characters;
    :func:`dapo.workers.describe_exception`)."""
    return workers.describe_exception(e, 500)


def run_item(
    table: list[RewardFn | None],
    fn_ids: tuple[int, ...],
    samples: tuple[Sample, ...],
    on_call: Callable[[int], None] | None = None,
) -> list[Outcome]:
    """Run the functions ``fn_ids`` of ``table`` on ``samples``: one outcome per sample,
    ``(OK, values, info)`` or ``(kind, fn id, detail)`` for the first function that raised
    or returned a non-number on it. TRL-form functions get all ``samples`` in one call (an
    exception costs them all); the other forms one sample per call."""
    values: list[list[float | None]] = [[] for _ in samples]
    infos: list[dict[str, float]] = [{} for _ in samples]
    failed: list[Outcome | None] = [None] * len(samples)
    for fid in fn_ids:
        entry = table[fid]
        assert entry is not None, f"reward function {fid} is not loaded in this process"
        if entry.form in BATCHED:
            live = [i for i, f in enumerate(failed) if f is None]
            if not live:
                break
            if on_call is not None:
                on_call(fid)
            call = _call_trl if entry.form == TRL else _call_group
            got = call(entry, fid, [samples[i] for i in live])
            if isinstance(got, tuple):  # the call failed: every sample in it
                for i in live:
                    failed[i] = got
                continue
            for i, (value, info) in zip(live, got, strict=True):
                if value is None or isinstance(value, float):
                    values[i].append(value)
                    infos[i].update(info)
                else:
                    failed[i] = _bad(fid, value[0])
            continue
        for i, sample in enumerate(samples):
            if failed[i] is not None:
                continue
            if on_call is not None:
                on_call(fid)
            try:
                raw = _call_one(entry, sample)
            except Exception as e:
                failed[i] = (ERROR, fid, describe_exception(e))
                continue
            x = _as_score(raw, infos[i])
            if x is None:
                failed[i] = _bad(fid, raw)
            else:
                values[i].append(x)
    return [f or (OK, v, info) for f, v, info in zip(failed, values, infos, strict=True)]


def _call_one(entry: RewardFn, s: Sample) -> Any:
    """One call of a sample- or verl-form function."""
    if entry.form == VERL:
        kwargs: dict[str, Any] = {
            "data_source": s.data_source,
            "solution_str": s.response,
            "ground_truth": s.ground_truth,
        }
        if entry.takes("extra_info"):
            kwargs["extra_info"] = (s.columns or {}).get("extra_info")
        return entry.fn(**kwargs)
    if entry.takes_data_source:
        return entry.fn(s.response, s.ground_truth, data_source=s.data_source)
    return entry.fn(s.response, s.ground_truth)


def _call_group(
    entry: RewardFn, fid: int, samples: list[Sample]
) -> Outcome | list[tuple[Any, dict[str, float]]]:
    """One call of a :data:`GROUP`-form function on ``samples``: each sample's value (a
    float or ``(bad value,)``) and info, or the failure of the call."""
    try:
        out = list(entry.fn(samples))
    except Exception as e:
        return (ERROR, fid, describe_exception(e))
    result: list[tuple[Any, dict[str, float]]] = []
    for value in out:
        info: dict[str, float] = {}
        x = _as_score(value, info)
        result.append((x, info) if x is not None else ((value,), info))
    return result


def _call_trl(
    entry: RewardFn, fid: int, samples: list[Sample]
) -> Outcome | list[tuple[Any, dict[str, float]]]:
    """One call of a TRL-form function on ``samples``, as TRL's trainer makes it: each
    sample's value (a float, None, or ``(bad value,)``) and info, or the failure of the
    call."""
    logged: dict[str, float] = {}

    def log_metric(name: str, value: float) -> None:
        x = _as_number(value)
        if x is not None:
            logged[str(name)] = x

    columns: dict[str, list[Any]] = {}

    def log_extra(column: str, values: list[Any]) -> None:
        # TRL's completions table: one value per completion; the numbers are kept, per
        # response, as reward/extra_<column> (text has no place in the metrics).
        values = list(values)
        if len(values) == len(samples):
            columns[str(column)] = values

    chat = [isinstance(s.prompt, list) for s in samples]
    kwargs: dict[str, Any] = {
        "prompts": [s.prompt for s in samples],
        "completions": [
            [{"role": "assistant", "content": s.response}] if c else s.response
            for s, c in zip(samples, chat, strict=True)
        ],
        "completion_ids": [list(s.completion_ids) for s in samples],
        "trainer_state": SimpleNamespace(global_step=samples[0].step),
        "log_metric": log_metric,
        "log_extra": log_extra,
    }
    names = set().union(*((s.columns or {}).keys() for s in samples))
    for name in names - set(kwargs) - {"completion"}:
        kwargs[name] = [(s.columns or {}).get(name) for s in samples]
    if entry.accepts is not None and "data_source" in entry.accepts:  # a column split off
        kwargs.setdefault("data_source", [s.data_source for s in samples])
    kwargs = {k: v for k, v in kwargs.items() if entry.takes(k)}
    try:
        raw = entry.fn(**kwargs)
        out = list(raw)
    except Exception as e:
        return (ERROR, fid, describe_exception(e))
    if len(out) != len(samples):
        return (
            BAD_VALUE,
            fid,
            f"a list of {len(out)} values for {len(samples)} completions",
        )
    result: list[tuple[Any, dict[str, float]]] = []
    for i, value in enumerate(out):
        info = dict(logged)
        for column, values in columns.items():
            x = _as_number(values[i])
            if x is not None:
                info[column] = x
        if value is None:
            result.append((None, info))
            continue
        x = _as_score(value, info)
        result.append((x, info) if x is not None else ((value,), info))
    return result
