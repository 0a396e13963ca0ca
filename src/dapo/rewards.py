"""Answer scorers, overlong reward shaping, user reward loading and a timed scoring pool.

Built-in scorers take ``(response, ground_truth)`` and return +1.0 (correct) or -1.0:

- ``dapo_math``: the DAPO answer format. The answer is the last ``Answer: ...`` line in
  the final 300 characters of the response; it and the ground truth are normalised
  (:func:`normalize_final_answer`) and compared as strings.
- ``math_verify``: symbolic comparison with the ``math_verify`` library, so ``0.5``
  matches ``\\frac{1}{2}``.

:class:`RewardScorer` runs the scorers (or user functions given as ``module:function``)
in persistent worker processes with a per-call timeout, so a hung or crashing reward
function costs one sample (scored -1.0) and never the training run. The workers are
fresh interpreters that import only this module (not torch, not the training script).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import math
import mmap
import numbers
import os
import re
import struct
import subprocess
import sys
import threading
import time
import warnings
import weakref
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "SCORERS",
    "RewardFunctionWarning",
    "RewardScorer",
    "ScoreRequest",
    "ScoreResult",
    "dapo_math_score",
    "extract_answer",
    "load_reward_function",
    "math_verify_score",
    "normalize_final_answer",
    "overlong_filter_mask",
    "scorer_for_source",
    "soft_overlong_punishment",
]

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# Answer extraction and normalisation (DAPO / Minerva style)
# ---------------------------------------------------------------------------

_ANSWER_TAIL_CHARS = 300
_ANSWER_RE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)


def extract_answer(response: str) -> str | None:
    """Return the text of the last ``Answer: ...`` line in the last 300 characters, or None."""
    last = None
    for last in _ANSWER_RE.finditer(response[-_ANSWER_TAIL_CHARS:]):  # noqa: B007
        pass
    return None if last is None else last.group(1).strip()


# \name{...} wrappers whose content is kept.
_WRAPPERS = (
    "boxed", "fbox", "text", "textbf", "textit", "textrm", "textup", "textnormal",
    "mbox", "mathrm", "mathbf", "mathit", "operatorname",
)  # fmt: skip
_BOXED_SPACE_RE = re.compile(r"\\boxed\s+")
_WRAPPER_RE = re.compile(r"\\(?:" + "|".join(_WRAPPERS) + r")\s*\{")
# Decorations removed outright (spacing, sizing, degree and percent signs, ellipses).
_DECORATION_RE = re.compile(
    r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\displaystyle|\\q?quad"
    r"|\\[!,;: ]|~"
    r"|\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°"
    r"|\\%|%|\\\$|\$"
    r"|\\l?dots"
)
# Unit and filler words, only as whole words (not inside \commands or other words),
# with an optional square/cube exponent ("cm^2").
_UNIT_WORDS = (
    "degrees", "degree", "deg", "radians", "cm", "mm", "km", "meters", "meter", "metres",
    "metre", "inches", "inch", "feet", "foot", "ft", "yards", "yd", "miles", "mile", "mph",
    "units", "unit", "sq", "square", "cubic", "dollars", "dollar", "cents", "cent",
    "hours", "hour", "hrs", "minutes", "minute", "mins", "seconds", "days", "weeks",
    "years", "grams", "gm", "kg", "pounds", "lbs", "ounces", "oz", "liters", "litres",
    "ways", "points", "students", "digits", "integers", "percent",
)  # fmt: skip
_UNIT_RE = re.compile(
    r"(?<![A-Za-z\\])(?:" + "|".join(_UNIT_WORDS) + r")(?:\^\{?[23]\}?)?(?![A-Za-z])",
    re.IGNORECASE,
)
_FRAC_VARIANT_RE = re.compile(r"\\[dtc]frac(?![A-Za-z])")
_LETTER_RE = re.compile(r"[A-Za-z]")
_FRAC_SQRT_RE = re.compile(r"\\frac|\\sqrt")
_CONTROL_SEQ_RE = re.compile(r"\\(?:[A-Za-z]+|.)", re.DOTALL)
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _frac(_: re.Match[str]) -> str:
    return "\\frac"


def _matching_brace(s: str, open_at: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_at``, or None when unbalanced."""
    depth = 0
    for i in range(open_at, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _unwrap(s: str) -> str:
    """Replace every ``\\boxed{x}``, ``\\text{x}``, ... by ``x`` (nesting-aware)."""
    while (m := _WRAPPER_RE.search(s)) is not None:
        close = _matching_brace(s, m.end() - 1)
        if close is None:  # unbalanced: drop the command and its brace
            s = s[: m.start()] + s[m.end() :]
        else:
            s = s[: m.start()] + s[m.end() : close] + s[close + 1 :]
    return _BOXED_SPACE_RE.sub("", s) if "\\boxed" in s else s


def _read_arg(s: str, i: int) -> tuple[str | None, int]:
    """Read one TeX macro argument at ``i``: a brace group, a control word or one character."""
    if i >= len(s):
        return None, i
    if s[i] == "{":
        close = _matching_brace(s, i)
        if close is None:
            return None, i
        return s[i + 1 : close], close + 1
    if s[i] == "\\":
        m = _CONTROL_SEQ_RE.match(s, i)
        assert m is not None
        return m.group(0), m.end()
    return s[i], i + 1


def _brace_shorthand(s: str) -> str:
    """Brace the arguments of ``\\frac`` and ``\\sqrt``: ``\\frac12`` -> ``\\frac{1}{2}``."""
    out: list[str] = []
    i = 0
    while (m := _FRAC_SQRT_RE.search(s, i)) is not None:
        out.append(s[i : m.end()])
        i = m.end()
        if m.group(0) == "\\sqrt" and s.startswith("[", i) and (end := s.find("]", i)) > 0:
            out.append(s[i : end + 1])  # \sqrt[3]{x}
            i = end + 1
        for _ in range(2 if m.group(0) == "\\frac" else 1):
            arg, i = _read_arg(s, i)
            if arg is None:
                break
            out.append("{" + _brace_shorthand(arg) + "}")
    out.append(s[i:])
    return "".join(out)


def normalize_final_answer(answer: str) -> str:
    """Normalise a final answer for exact string comparison (DAPO/Minerva style).

    Unwraps ``\\boxed{}``/``\\text{}``-like wrappers, keeps the text after the last
    ``=``, strips ``$``, spacing commands, ``\\left``/``\\right``, degree and percent
    signs, unit words and a trailing period, braces ``\\frac12``/``\\sqrt2`` shorthand,
    maps ``\\dfrac``/``\\tfrac`` to ``\\frac`` and drops thousands separators.
    """
    return _normalize(str(answer))


@functools.lru_cache(maxsize=8192)
def _normalize(s: str) -> str:
    s = _FRAC_VARIANT_RE.sub(_frac, s.replace("\u2212", "-"))
    s = _unwrap(s)
    s = s.rsplit("=", 1)[-1]
    s = _DECORATION_RE.sub(" ", s)
    if _LETTER_RE.search(s):
        s = _UNIT_RE.sub(" ", s)
    s = "".join(s.split())
    s = _brace_shorthand(s)
    s = s.replace("{,}", ",")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return s.rstrip(".")


def dapo_math_score(response: str, ground_truth: str) -> float:
    """+1.0 when the normalised ``Answer:`` equals the normalised ground truth, else -1.0."""
    predicted = extract_answer(response)
    if predicted is None:
        return -1.0
    predicted = normalize_final_answer(predicted)
    return 1.0 if predicted and predicted == normalize_final_answer(str(ground_truth)) else -1.0


# ---------------------------------------------------------------------------
# math_verify
# ---------------------------------------------------------------------------


class _DropTimeoutDisabledNotice(logging.Filter):
    """Hide math_verify's 'Timeout is disabled' notice: our worker pool enforces timeouts."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_math_verify_ready = False


def _math_verify() -> Any:
    """Import math_verify lazily (about 1 s) and silence its timeout notice."""
    global _math_verify_ready
    import math_verify

    if not _math_verify_ready:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledNotice())
        _math_verify_ready = True
    return math_verify


def _mv_parse(text: str, *, wrap: bool) -> list[Any]:
    """Parse with math_verify; a bare answer is tried as ``$...$`` LaTeX first."""
    mv = _math_verify()
    if wrap and not any(d in text for d in ("$", "\\boxed", "\\[", "\\(")):
        parsed = mv.parse(f"${text}$", parsing_timeout=None)
        if parsed:
            return parsed
    return mv.parse(text, parsing_timeout=None)


def math_verify_score(response: str, ground_truth: str) -> float:
    """+1.0 when math_verify finds the answer equivalent to the ground truth, else -1.0.

    The candidate is the ``Answer:`` line when there is one, else whatever math_verify
    extracts from the last 300 characters (e.g. a ``\\boxed{}``). math_verify's own
    signal-based timeouts are disabled (they fail outside the main thread); run it
    through :class:`RewardScorer` for a time limit.
    """
    candidate = extract_answer(response)
    if candidate is None:
        target = _mv_parse(response[-_ANSWER_TAIL_CHARS:], wrap=False)
    else:
        target = _mv_parse(candidate, wrap=True)
    gold = _mv_parse(str(ground_truth), wrap=True)
    if not target or not gold:
        return -1.0
    return 1.0 if _math_verify().verify(gold, target, timeout_seconds=None) else -1.0


SCORERS: dict[str, Callable[[str, str], float]] = {
    "dapo_math": dapo_math_score,
    "math_verify": math_verify_score,
}


def scorer_for_source(
    data_source: str, mapping: dict[str, str] | None = None, default: str = "dapo_math"
) -> str:
    """Name of the built-in scorer for ``data_source`` (``mapping`` entry, else ``default``)."""
    name = mapping.get(data_source, default) if mapping else default
    if name not in SCORERS:
        where = (
            f"reward.source_scorers[{data_source!r}]"
            if mapping and data_source in mapping
            else "reward.default_scorer"
        )
        raise ValueError(
            f"unknown reward scorer {name!r} ({where}, data_source {data_source!r}); "
            f"valid names: {', '.join(sorted(SCORERS))}"
        )
    return name


# ---------------------------------------------------------------------------
# Overlong reward shaping
# ---------------------------------------------------------------------------


def soft_overlong_punishment(length: int, max_length: int, cache_length: int) -> float:
    """DAPO soft overlong punishment: 0 up to ``max_length - cache_length``, then a linear
    ramp down to -1 at ``max_length``, and -1 beyond it.

    ``cache_length == 0`` disables the ramp (0 up to ``max_length``, -1 beyond).
    """
    if max_length <= 0:
        raise ValueError(
            f"max_length must be positive, got {max_length}; pass the generation cap in tokens"
        )
    if not 0 <= cache_length <= max_length:
        raise ValueError(
            f"cache_length must be between 0 and max_length={max_length}, got {cache_length}; "
            "use a buffer shorter than the generation cap (e.g. max_length // 5)"
        )
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}; pass the response length in tokens")
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / cache_length
    return -1.0


def overlong_filter_mask(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Copy of the ``[B, T]`` loss mask with the rows of truncated responses zeroed."""
    import torch

    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if truncated.shape != (mask.shape[0],):
        raise ValueError(
            f"truncated must be [B] = [{mask.shape[0]}] to match mask {tuple(mask.shape)}, "
            f"got shape {tuple(truncated.shape)}"
        )
    rows = truncated.to(device=mask.device, dtype=torch.bool)
    return mask.masked_fill(rows[:, None], 0)


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


# ---------------------------------------------------------------------------
# Worker process
# ---------------------------------------------------------------------------

_PROGRESS = struct.Struct("<Q")  # shared slot: ((position in chunk + 1) << 16) | fn id, 0 = idle
_FLUSH_INTERVAL_S = 0.2  # a worker reports finished samples at least this often
_STARTUP_TIMEOUT_S = 120.0
_MAX_UNBLAMED_RETRIES = 2
_CHUNKS_PER_WORKER = 2

_BOOT = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "try:\n"
    "    sys.path[:] = conn.recv()\n"
    "except EOFError:\n"  # the scorer was closed before this worker started
    "    sys.exit(0)\n"
    "from {module} import _worker_main\n"
    "_worker_main(conn, int(sys.argv[2]))\n"
)


def _worker_main(conn: Connection, progress_fd: int) -> None:
    """Entry point of a scoring worker: load the functions, then score chunks until EOF."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    progress = mmap.mmap(progress_fd, _PROGRESS.size)
    os.close(progress_fd)
    # The parent closing the pipe (close(), exit) is the normal way to stop a worker.
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):
        _worker_loop(conn, progress)


def _worker_loop(conn: Connection, progress: mmap.mmap) -> None:
    _, entries, warm = conn.recv()
    try:
        table = [_load_entry(name, spec) for name, spec in entries]
    except BaseException as e:
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    for name in warm:  # pay first-call costs (imports, sympy caches) before the first batch
        with contextlib.suppress(Exception):
            SCORERS[name]("Answer: 1/2", "0.5")
    conn.send(("ready", os.getpid()))
    while True:
        chunk = conn.recv()
        if chunk is None:
            return
        out: list[tuple[Any, ...]] = []
        last_flush = time.monotonic()
        for pos, (item_id, response, ground_truth, data_source, fn_ids) in enumerate(chunk):
            if out and time.monotonic() - last_flush >= _FLUSH_INTERVAL_S:
                conn.send(("results", out, False))
                out, last_flush = [], time.monotonic()
            base = (pos + 1) << 16

            def on_call(fid: int, base: int = base) -> None:
                _PROGRESS.pack_into(progress, 0, base | fid)

            out.append(
                (item_id, _run_item(table, fn_ids, response, ground_truth, data_source, on_call))
            )
        _PROGRESS.pack_into(progress, 0, 0)
        conn.send(("results", out, True))


@dataclass(eq=False)
class _Worker:
    """Parent-side handle of one worker process."""

    proc: subprocess.Popen[bytes]
    conn: Connection
    progress: mmap.mmap
    spawned_at: float
    ready: bool = False
    startup_s: float | None = None
    chunk: list[int] | None = None  # request indices of the chunk in flight
    last_progress: int = 0
    call_seen_at: float = 0.0

    def read_progress(self) -> int:
        return _PROGRESS.unpack_from(self.progress, 0)[0]


def _shutdown_workers(workers: list[_Worker]) -> None:
    """Ask every worker to exit (EOF), then reap it, killing stragglers."""
    for w in workers:
        with contextlib.suppress(OSError):
            w.conn.close()
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        w.progress.close()
    workers.clear()


# ---------------------------------------------------------------------------
# RewardScorer
# ---------------------------------------------------------------------------


class RewardFunctionWarning(UserWarning):
    """A reward function timed out, raised, or returned a non-number (the sample scored -1)."""


@dataclass
class ScoreRequest:
    """One response to score."""

    response: str
    ground_truth: str
    data_source: str = "math_dapo"


@dataclass
class ScoreResult:
    """Rewards of a batch and how many samples failed (failed samples score -1.0)."""

    rewards: list[float]
    correct: list[bool]
    failures: int = 0
    timeouts: int = 0
    errors: int = 0
    bad_values: int = 0


@dataclass
class _Plan:
    """What to run: function table entries (display name, load spec) and weights."""

    entries: list[tuple[str, str]]
    weights: list[float]
    fixed_ids: tuple[int, ...] | None  # None: one built-in scorer chosen per data source
    warm: list[str] = field(default_factory=list)


class RewardScorer:
    """Scores responses with reward functions in persistent worker processes.

    ``functions`` is a list of ``(name, weight)``, ``name`` a :data:`SCORERS` key or a
    ``module:function`` / ``file.py:function`` spec; the reward is the weighted sum. User
    functions are called as ``fn(response, ground_truth, data_source=...)`` when they
    accept ``data_source`` (or ``**kwargs``), else ``fn(response, ground_truth)``.
    Without functions, each request gets the built-in scorer
    ``scorer_for_source(data_source, source_scorers, default_scorer)`` with weight 1
    (``source_scorers`` and ``default_scorer`` only apply then).

    Each reward-function call on one sample may take at most ``timeout_s``; a worker
    stuck longer is killed and replaced, and the other samples it held are retried. A
    sample whose function times out, raises, or returns a non-number/NaN/inf scores
    -1.0 whatever the weights; each kind of failure is warned about once per function
    (:class:`RewardFunctionWarning`). ``num_workers=0`` scores in the calling thread
    without any timeout: for debugging only. Concurrent :meth:`score` calls from
    several threads are serialised by a lock.
    """

    def __init__(
        self,
        functions: list[tuple[str, float]] | None = None,
        *,
        source_scorers: dict[str, str] | None = None,
        default_scorer: str = "dapo_math",
        timeout_s: float = 5.0,
        num_workers: int = 1,
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(
                f"timeout_s (reward.timeout_s) must be a positive number of seconds, got {timeout_s!r}"
            )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"num_workers (reward.num_workers) must be an int >= 0, got {num_workers!r}; "
                "use 0 for in-process debugging or 1+ worker processes"
            )
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self._source_scorers = dict(source_scorers or {})
        self._default_scorer = default_scorer
        self._plan, local = self._make_plan(functions)
        self._local_table = local
        self._source_ids: dict[str, int] = {}
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._poll_s = min(0.05, self.timeout_s / 10)
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown_workers, self._workers)
        self._fill_pool()

    # -- construction -------------------------------------------------------

    def _make_plan(self, functions: list[tuple[str, float]] | None) -> tuple[_Plan, list[_Fn]]:
        if not functions:
            for source in self._source_scorers:
                scorer_for_source(source, self._source_scorers, self._default_scorer)
            scorer_for_source("", None, self._default_scorer)
            names = list(SCORERS)
            used = {self._default_scorer, *self._source_scorers.values()}
            plan = _Plan(
                [(n, n) for n in names], [1.0] * len(names), None, sorted(used - {"dapo_math"})
            )
            return plan, [_load_entry(n, n) for n in names]
        entries, weights, local = [], [], []
        for i, item in enumerate(functions):
            try:
                name, weight = item
            except (TypeError, ValueError):
                raise ValueError(
                    f"reward.functions[{i}] must be a (name, weight) pair, got {item!r}"
                ) from None
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(
                    f"reward.functions[{i}] weight must be a finite number, got {weight!r}"
                )
            name = str(name)
            if name in SCORERS:
                load_spec = name
            elif ":" in name:
                module_part, attr = _split_spec(name)
                if module_part == "__main__" and self.num_workers > 0:
                    raise ValueError(
                        f"reward.functions[{i}] {name!r}: worker processes cannot see functions "
                        "of the main script; move it to a module, or name the script's file "
                        "('path/to/script.py:function', guarded by if __name__ == '__main__')"
                    )
                if _is_file_spec(module_part):  # workers must find it whatever their cwd
                    module_part = str(Path(module_part).expanduser().resolve())
                load_spec = f"{module_part}:{attr}"
            else:
                raise ValueError(
                    f"reward.functions[{i}] name {name!r} is neither a built-in scorer "
                    f"({', '.join(sorted(SCORERS))}) nor a spec {_SPEC_FORMS}"
                )
            local.append(_load_entry(name, load_spec))  # fail here, not in a worker
            entries.append((name, load_spec))
            weights.append(float(weight))
        warm = sorted({spec for _, spec in entries if spec in SCORERS} - {"dapo_math"})
        return _Plan(entries, weights, tuple(range(len(entries))), warm), local

    # -- public API ---------------------------------------------------------

    def score(self, requests: list[ScoreRequest]) -> ScoreResult:
        """Score a batch; never raises for a misbehaving reward function."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardScorer is closed; create a new one")
            plans = [self._fn_ids(r.data_source) for r in requests]
            if not requests:
                outcomes: list[tuple[Any, ...]] = []
            elif self.num_workers == 0:
                outcomes = [
                    _run_item(self._local_table, ids, r.response, r.ground_truth, r.data_source)
                    for r, ids in zip(requests, plans, strict=True)
                ]
            else:
                outcomes = self._score_in_pool(requests, plans)
            return self._assemble(outcomes, plans)

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.proc.pid for w in self._workers]

    @property
    def worker_startup_s(self) -> list[float]:
        """Start-up time (spawn to ready) of each ready worker, in seconds."""
        return [w.startup_s for w in self._workers if w.startup_s is not None]

    # -- helpers ------------------------------------------------------------

    def _fn_ids(self, data_source: str) -> tuple[int, ...]:
        if self._plan.fixed_ids is not None:
            return self._plan.fixed_ids
        fid = self._source_ids.get(data_source)
        if fid is None:
            name = scorer_for_source(data_source, self._source_scorers, self._default_scorer)
            fid = self._source_ids[data_source] = list(SCORERS).index(name)
        return (fid,)

    def _assemble(
        self, outcomes: list[tuple[Any, ...]], plans: list[tuple[int, ...]]
    ) -> ScoreResult:
        result = ScoreResult(rewards=[], correct=[])
        for outcome, ids in zip(outcomes, plans, strict=True):
            if outcome[0] == _OK:
                reward = sum(
                    self._plan.weights[f] * v for f, v in zip(ids, outcome[1], strict=True)
                )
                result.rewards.append(reward)
                result.correct.append(reward > 0)
                continue
            kind, fid, detail = outcome
            result.rewards.append(-1.0)
            result.correct.append(False)
            result.failures += 1
            if kind == _TIMEOUT:
                result.timeouts += 1
            elif kind == _ERROR:
                result.errors += 1
            else:
                result.bad_values += 1
            name = self._plan.entries[fid][0] if fid is not None else "<reward worker>"
            self._warn_once(kind, name, detail)
        return result

    def _warn_once(self, kind: str, name: str, detail: str) -> None:
        if (name, kind) in self._warned:
            return
        self._warned.add((name, kind))
        if kind == _TIMEOUT:
            text = (
                f"reward function {name!r} took longer than {self.timeout_s:g} s on a sample; "
                "the sample scored -1.0 and its worker was restarted. Make the function "
                "faster or raise reward.timeout_s."
            )
        elif kind == _ERROR:
            text = (
                f"reward function {name!r} raised {detail}; the sample scored -1.0. Fix the "
                "function, or catch the error and return a number."
            )
        else:
            text = (
                f"reward function {name!r} returned {detail}, not a finite number; the sample "
                "scored -1.0. Return an int or float (bools count as 0/1)."
            )
        warnings.warn(
            text + " (Warned once per function and kind of failure.)",
            RewardFunctionWarning,
            stacklevel=4,
        )

    # -- worker pool --------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = Pipe(duplex=True)
        progress_fd = (
            os.memfd_create("dapo-reward-progress") if hasattr(os, "memfd_create") else _temp_fd()
        )
        try:
            os.ftruncate(progress_fd, _PROGRESS.size)
            progress = mmap.mmap(progress_fd, _PROGRESS.size)
            boot = _BOOT.format(module=__name__)
            proc = subprocess.Popen(
                [sys.executable, "-c", boot, str(child_conn.fileno()), str(progress_fd)],
                pass_fds=(child_conn.fileno(), progress_fd),
                stdin=subprocess.DEVNULL,
            )
        finally:
            child_conn.close()
            os.close(progress_fd)
        parent_conn.send(list(sys.path))
        parent_conn.send(("init", self._plan.entries, self._plan.warm))
        return _Worker(proc, parent_conn, progress, time.monotonic())

    def _fill_pool(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

    def _retire(self, w: _Worker) -> None:
        """Kill a worker, reap it and drop it from the pool (a fresh one replaces it)."""
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait()
        w.conn.close()
        w.progress.close()
        self._workers.remove(w)

    def _score_in_pool(
        self, requests: list[ScoreRequest], plans: list[tuple[int, ...]]
    ) -> list[tuple[Any, ...]]:
        n = len(requests)
        run = _Run(
            items=[
                (i, r.response, r.ground_truth, r.data_source, ids)
                for i, (r, ids) in enumerate(zip(requests, plans, strict=True))
            ],
            outcomes=[None] * n,
            retries=[0] * n,
        )
        size = max(1, min(256, -(-n // (_CHUNKS_PER_WORKER * self.num_workers))))
        run.pending.extend(list(range(s, min(s + size, n))) for s in range(0, n, size))
        try:
            while any(o is None for o in run.outcomes):
                self._fill_pool()
                for w in self._workers:
                    if w.ready and w.chunk is None and run.pending:
                        self._send_chunk(w, run.pending.popleft(), run)
                active = [w for w in self._workers if not w.ready or w.chunk is not None]
                for conn in wait([w.conn for w in active], self._wait_s(active)):
                    self._receive(next(w for w in active if w.conn is conn), run)
                self._enforce_timeouts(run)
        except (
            BaseException
        ):  # e.g. Ctrl-C: results still in flight must not leak into the next call
            for w in [w for w in self._workers if w.chunk is not None]:
                self._retire(w)
            raise
        self._fill_pool()  # replacements start now, not at the next call
        return run.outcomes  # type: ignore[return-value]

    def _send_chunk(self, w: _Worker, ids: list[int], run: _Run) -> None:
        w.chunk = ids
        w.last_progress = w.read_progress()
        w.call_seen_at = time.monotonic()
        try:
            w.conn.send([run.items[i] for i in ids])
        except OSError:  # it died while idle: requeue and replace
            self._fail_chunk(w, _ERROR, run)

    def _wait_s(self, active: list[_Worker]) -> float:
        """How long to block: until the nearest call deadline, at most one poll period."""
        now = time.monotonic()
        wait_s = self._poll_s
        for w in active:
            if w.ready and w.last_progress:
                wait_s = min(wait_s, max(0.0, w.call_seen_at + self.timeout_s - now))
        return wait_s

    def _receive(self, w: _Worker, run: _Run) -> None:
        """Handle one message from ``w`` (or its death)."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            if w.ready:
                self._fail_chunk(w, _ERROR, run)
                return
            code = w.proc.wait()
            self._retire(w)
            raise RuntimeError(
                f"a reward worker {_exit_text(code)} during start-up; its error output is above"
            ) from None
        if msg[0] == "ready":
            w.ready = True
            w.startup_s = time.monotonic() - w.spawned_at
            logger.debug("reward worker %d ready in %.3f s", msg[1], w.startup_s)
        elif msg[0] == "init_error":
            self._retire(w)
            raise RuntimeError(f"a reward worker could not load the reward functions: {msg[1]}")
        else:
            _, results, finished = msg
            for item_id, outcome in results:
                if run.outcomes[item_id] is None:
                    run.outcomes[item_id] = outcome
            if finished:
                w.chunk = None

    def _fail_chunk(self, w: _Worker, kind: str, run: _Run) -> None:
        """Blame the call in progress on ``w``, retire ``w`` and requeue the rest of its chunk."""
        value = w.read_progress()
        chunk = w.chunk or []
        self._retire(w)
        if kind == _TIMEOUT:
            detail = f"timed out after {self.timeout_s:g} s"
        else:
            detail = f"WorkerDied: the worker process {_exit_text(w.proc.returncode)}"
        if value:
            pos, fid = (value >> 16) - 1, value & 0xFFFF
            if 0 <= pos < len(chunk) and run.outcomes[chunk[pos]] is None:
                run.outcomes[chunk[pos]] = (kind, fid, detail)
        rest = [i for i in chunk if run.outcomes[i] is None]
        if not value:  # died between calls, nothing to blame: retry a bounded number of times
            for i in rest:
                run.retries[i] += 1
                if run.retries[i] > _MAX_UNBLAMED_RETRIES:
                    run.outcomes[i] = (_ERROR, None, detail)
            rest = [i for i in rest if run.outcomes[i] is None]
        if rest:
            run.pending.appendleft(rest)

    def _enforce_timeouts(self, run: _Run) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready:
                if now - w.spawned_at > _STARTUP_TIMEOUT_S:
                    self._retire(w)
                    raise RuntimeError(
                        f"a reward worker did not start within {_STARTUP_TIMEOUT_S:g} s"
                    )
                continue
            if w.chunk is None:
                continue
            value = w.read_progress()
            if value != w.last_progress:
                w.last_progress, w.call_seen_at = value, now
            elif value and now - w.call_seen_at >= self.timeout_s:
                logger.info("reward worker %d timed out; replacing it", w.proc.pid)
                self._fail_chunk(w, _TIMEOUT, run)


@dataclass
class _Run:
    """State of one :meth:`RewardScorer.score` call on the pool."""

    items: list[tuple[Any, ...]]
    outcomes: list[tuple[Any, ...] | None]
    retries: list[int]  # requeues of a sample after a worker death with no call to blame
    pending: deque[list[int]] = field(default_factory=deque)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _temp_fd() -> int:
    """An unlinked temporary file for the progress slot (where memfd_create is missing)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="dapo-reward-")
    os.unlink(path)
    return fd
