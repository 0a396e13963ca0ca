"""Test cases of code tasks: the layouts users' data comes in, and comparing outputs.

:func:`parse_tests` reads a row's ground truth (a dict, a list, or either as a JSON string)
in any of these layouts into :class:`Case` objects:

- verl / PRIME (``reward_model.ground_truth``): ``{"inputs": [...], "outputs": [...]}``,
  stdin/stdout pairs; with ``"fn_name"`` each input is the argument list of a call and each
  output the returned value (APPS and TACO wrap it in a one-element list: both match).
- DeepCoder (``tests``): ``[{"input", "output", "testtype": "stdin" | "functional"}]``; a
  functional test's input is one JSON value per line (LiveCodeBench's form) and the
  function's name is ``fn_name`` (or ``func_name``) of a wrapping dict ``{"tests": [...],
  "fn_name": ...}`` or of the test.
- open-r1 (``verification_info``): ``{"language": "python", "test_cases": [{"input",
  "output", "type": "stdin_stdout" | "function_call"}]}``.

Outputs are compared as LiveCodeBench and APPS compare them (:func:`outputs_match`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

LAYOUTS = (
    "verl/PRIME {'inputs': [...], 'outputs': [...], 'fn_name'?}, DeepCoder [{'input', "
    "'output', 'testtype'}] (or {'tests': [...], 'fn_name'}), or open-r1 {'language': "
    "'python', 'test_cases': [{'input', 'output', 'type'}]}, as a dict, a list or JSON text"
)


class TestSpecError(ValueError):
    """A ground truth that holds no runnable tests; the message says what and how to fix."""

    __test__ = False  # not a pytest class, whatever its name


@dataclass(frozen=True)
class Case:
    """One test: stdin text and expected stdout, or a call's arguments and expected value."""

    stdin: str | None = None
    expected: Any = None
    fn: str | None = None
    args: tuple[Any, ...] = ()

    def request(self) -> dict[str, Any]:
        """What the harness is given: never the expected output."""
        return (
            {"stdin": self.stdin or ""} if self.fn is None else {"fn": self.fn, "args": self.args}
        )


def parse_tests(ground_truth: Any) -> list[Case]:
    """The test cases of ``ground_truth`` (:data:`LAYOUTS`); :class:`TestSpecError` when it
    holds none or is malformed."""
    spec = _loads(ground_truth)
    if isinstance(spec, list):
        return _deepcoder(spec, None)
    if not isinstance(spec, dict):
        raise TestSpecError(f"the tests are a {type(spec).__name__}, not one of {LAYOUTS}")
    fn = spec.get("fn_name") or spec.get("func_name")
    if fn is not None and not (isinstance(fn, str) and fn.isidentifier()):
        raise TestSpecError(f"fn_name is {fn!r}, not a Python function name")
    if "inputs" in spec or "outputs" in spec:
        return _verl(spec, fn)
    if "test_cases" in spec:
        language = str(spec.get("language", "python")).lower()
        if language not in ("python", "python3", "py"):
            raise TestSpecError(
                f"language is {spec.get('language')!r}: only Python programs can be run; "
                "drop the rows of other languages"
            )
        return _deepcoder(_loads(spec["test_cases"]), fn, key="type")
    if "tests" in spec:
        return _deepcoder(_loads(spec["tests"]), fn)
    raise TestSpecError(f"the dict has keys {sorted(spec)}, none of {LAYOUTS}")


def _loads(value: Any) -> Any:
    if isinstance(value, str | bytes):
        try:
            return json.loads(value)
        except ValueError as e:
            raise TestSpecError(
                f"the tests are text but not JSON ({e}); expected {LAYOUTS}"
            ) from None
    return value


def _text(value: Any, what: str) -> str:
    """A stdin input or expected stdout: text, or a list of lines (APPS)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise TestSpecError(f"{what} is a {type(value).__name__} ({value!r:.60}), not text")


def _verl(spec: dict[str, Any], fn: str | None) -> list[Case]:
    inputs, outputs = _loads(spec.get("inputs")), _loads(spec.get("outputs"))
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise TestSpecError("'inputs' and 'outputs' must both be lists")
    if len(inputs) != len(outputs):
        raise TestSpecError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise TestSpecError("'inputs' is empty: a program with no test cannot be judged")
    cases = []
    for i, (x, y) in enumerate(zip(inputs, outputs, strict=True)):
        if fn is None:
            cases.append(Case(_text(x, f"inputs[{i}]"), _text(y, f"outputs[{i}]")))
        else:
            args = tuple(x) if isinstance(x, list) else (x,)
            cases.append(Case(None, y, fn, args))
    return cases


def _deepcoder(tests: Any, fn: str | None, key: str = "testtype") -> list[Case]:
    if not isinstance(tests, list) or not tests:
        raise TestSpecError("the test list is empty or not a list")
    cases = []
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or "input" not in t or "output" not in t:
            raise TestSpecError(f"test {i} is {t!r:.80}, not a dict with 'input' and 'output'")
        kind = str(t.get(key) or t.get("testtype") or t.get("type") or "stdin")
        name = t.get("fn_name") or t.get("func_name") or fn
        if kind in ("stdin", "stdin_stdout", "stdio"):
            cases.append(Case(_text(t["input"], f"test {i} input"), _text(t["output"], "output")))
        elif kind in ("functional", "function_call", "call"):
            if not (isinstance(name, str) and name.isidentifier()):
                raise TestSpecError(
                    f"test {i} is functional but names no function: give 'fn_name' beside "
                    "the tests ({'tests': [...], 'fn_name': 'solve'}) or in the test"
                )
            cases.append(Case(None, _json_or_text(t["output"]), name, _call_args(t["input"])))
        else:
            raise TestSpecError(f"test {i} has {key} {kind!r}: expected stdin or functional")
    return cases


def _call_args(value: Any) -> tuple[Any, ...]:
    """A functional test's arguments: a list, or one JSON value per line (LiveCodeBench)."""
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, str):
        return tuple(_json_or_text(line) for line in value.split("\n") if line.strip())
    return (value,)


def _json_or_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


# --------------------------------------------------------------------------- comparing


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _number(token: str) -> float | None:
    try:
        x = float(token)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def outputs_match(got: str, expected: str, tolerance: float = 1e-6) -> bool:
    """Whether a program's stdout is the expected one: line endings, trailing whitespace and
    trailing blank lines ignored; failing that, the same whitespace-separated tokens, numbers
    equal within ``tolerance`` (relative or absolute) where both sides parse as numbers."""
    a, b = _lines(got), _lines(expected)
    if a == b:
        return True
    ta, tb = " ".join(a).split(), " ".join(b).split()
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb, strict=True):
        if x == y:
            continue
        fx, fy = _number(x), _number(y)
        if fx is None or fy is None:
            return False
        if not math.isclose(fx, fy, rel_tol=tolerance, abs_tol=tolerance):
            return False
    return True


def values_match(got: Any, expected: Any, tolerance: float = 1e-6) -> bool:
    """Whether a function's return value (as JSON gave it back) is the expected one: numbers
    within ``tolerance``, tuples as lists, and an expected one-element list also matching
    its element (APPS and TACO wrap call results so)."""
    if _equal(got, expected, tolerance):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _equal(got, expected[0], tolerance)


def _equal(a: Any, b: Any, tol: float) -> bool:
    if isinstance(b, tuple):
        b = list(b)
    if isinstance(a, bool) or isinstance(b, bool):  # True is no 1
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y, tol) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], tol) for k in a)
    return a == b
