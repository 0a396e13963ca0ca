""":class:`RewardScorer`: the weighted reward of each response, never failing the run.

The functions run in persistent worker processes (:class:`~dapo.rewards.pool.WorkerPool`)
so that a hung or crashing reward function costs one sample (scored -1.0) and never the
training run; Python callables that cannot be sent there run in this process on a helper
thread (:class:`~dapo.rewards.inprocess.ThreadRunner`).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dapo.errors import ConfigError, RewardFunctionWarning
from dapo.rewards.code import UNISOLATED_WARNING, CodeSettings, check_rows
from dapo.rewards.inprocess import ThreadRunner
from dapo.rewards.math import (
    ANSWER_READERS,
    SCORER_FORMS,
    SCORERS,
    extract_answer,
    scorer_for_source,
)
from dapo.rewards.pool import WorkerPool
from dapo.rewards.results import ScoreRequest, ScoreResult
from dapo.rewards.user import (
    BATCHED,
    ERROR,
    OK,
    SAMPLE,
    SPEC_FORMS,
    TIMEOUT,
    TRL,
    Outcome,
    RewardFn,
    Sample,
    Source,
    callable_name,
    check_signature,
    load_entry,
    missing_columns,
    pickle_function,
    run_item,
    worker_spec,
)
from dapo.worker_output import UserOutput

RewardSpec = str | Callable[..., Any]  # a SCORERS name, a spec, or a Python callable
UNSCORABLE = "unscorable"  # a warning kind beside the failures: every function said None


@dataclass
class _Plan:
    """What to run: per function its name, what a worker loads (None: runs in this process),
    the function loaded here, and its weight."""

    names: list[str]
    sources: list[Source]
    table: list[RewardFn | None]
    weights: list[float]
    fixed_ids: tuple[int, ...] | None  # None: one built-in scorer chosen per data source
    warm: list[str] = field(default_factory=list)

    @property
    def forms(self) -> list[str]:
        return [e.form if e is not None else SAMPLE for e in self.table]

    @property
    def in_process(self) -> frozenset[int]:
        return frozenset(i for i, s in enumerate(self.sources) if s is None)


class RewardScorer:
    """Scores responses with reward functions in persistent worker processes.

    ``functions`` is a list of ``(function, weight)``; the reward is the weighted sum. A
    function is a :data:`SCORERS` key, a ``module:function`` / ``file.py:function`` spec,
    or a Python callable (a function, a lambda, a closure, a callable object, defined
    anywhere, ``__main__`` and notebook cells included). A user function is called in the
    form its parameter names say (:mod:`dapo.rewards.user`): dapo's
    ``fn(response, ground_truth[, data_source=...])`` and verl's ``compute_score`` once per
    response, TRL's ``fn(completions, **kwargs) -> list`` once per group (the ``groups`` of
    :meth:`score`). Without functions, each request gets the built-in scorer
    ``scorer_for_source(data_source, source_scorers, default_scorer)`` with weight 1
    (``source_scorers`` and ``default_scorer`` only apply then).

    Each reward-function call on one sample may take at most ``timeout_s``; a worker
    stuck longer is killed and replaced, and the other samples it held are retried. A
    sample whose function times out, raises, or returns a non-number/NaN/inf scores
    -1.0 whatever the weights; each kind of failure is warned about once per function
    (:class:`RewardFunctionWarning`). ``num_workers=0`` scores in the calling thread
    without any timeout: for debugging only. Concurrent :meth:`score` calls from
    several threads are serialised by a lock.

    Callables are sent to the workers serialised with cloudpickle, by value when they
    live in ``__main__`` or a notebook (with what they capture) and by reference when
    importable: each worker runs its own copy, so state a callable changes (a counter it
    increments) changes in the workers, not here. A callable cloudpickle cannot serialise
    (it captures a lock, an open file, a socket...) runs in this process instead, on a
    helper thread, with a one-line :class:`RewardFunctionWarning` at construction: an
    exception or a bad value still costs only its sample, and a call over ``timeout_s``
    scores a time-out and is abandoned, but it cannot be stopped: it runs on in the
    background until it returns.

    What the functions print in the workers (stdout and stderr) goes where ``output``
    says (:class:`~dapo.worker_output.UserOutput`: a file of the run, or by default the last MiB
    in memory), at most its limit per worker and step (:meth:`output_step`), the rest
    counted (:attr:`output_dropped`) and dropped; never to the console. Functions that run
    in this process (``num_workers=0``, a callable that cannot be pickled) print where
    this process prints: their output cannot be told apart from the trainer's.
    """

    def __init__(
        self,
        functions: Sequence[tuple[RewardSpec, float]] | None = None,
        *,
        source_scorers: dict[str, str] | None = None,
        default_scorer: str = "dapo_math",
        timeout_s: float = 5.0,
        num_workers: int = 1,
        output: UserOutput | None = None,
        origins: Sequence[str] | None = None,
        code: dict[str, Any] | None = None,
    ) -> None:
        """``origins``: what errors call each function, where it was given (default
        ``reward.functions[i]``; ``dapo eval`` says ``--scorer``). ``code``: the code
        scorer's settings (:class:`~dapo.rewards.code.CodeSettings` fields, ``reward.code``)."""
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(
                "timeout_s (reward.timeout_s) must be a positive number of seconds, "
                f"got {timeout_s!r}"
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
        self._origins = list(origins or ())
        self.code = CodeSettings.of(dict(code or {}))
        if self.code.budget_s is None:  # a group's programs end before its call's time-out
            self.code = replace(self.code, budget_s=max(0.5, 0.9 * self.timeout_s - 0.25))
        self._options = {"code": asdict(self.code)}
        self._plan = self._make_plan(functions)
        self._in_process = self._plan.in_process
        self._source_ids: dict[str, int] = {}
        # Whether each function has said nothing but -1, 0 and 1 (or an acc) so far.
        self._binary = [True] * len(self._plan.names)
        self._warned: set[tuple[int | None, str]] = set()
        # The first failed call's function and reason, for a run stopped by failures.
        self.first_error: str | None = None
        self.scored = self.failed = 0  # samples scored and failed, over this scorer's life
        self._lock = threading.Lock()
        self._closed = False
        # (runner, whether it runs the in-process functions); none for num_workers=0
        self._runners: list[tuple[WorkerPool | ThreadRunner, bool]] = []
        if num_workers > 0 and len(self._in_process) < len(self._plan.sources):
            entries = list(zip(self._plan.names, self._plan.sources, strict=True))
            pool = WorkerPool(
                entries, self._plan.warm, num_workers, self.timeout_s, output, self._options
            )
            self._runners.append((pool, False))
        if num_workers > 0 and self._in_process:
            self._runners.append((ThreadRunner(self._plan.table, self.timeout_s), True))

    # -- construction -------------------------------------------------------

    def _make_plan(self, functions: Sequence[tuple[RewardSpec, float]] | None) -> _Plan:
        if not functions:
            for source in self._source_scorers:
                scorer_for_source(source, self._source_scorers, self._default_scorer)
            scorer_for_source("", None, self._default_scorer)
            names = list(SCORERS)
            used = {self._default_scorer, *self._source_scorers.values()}
            table = [load_entry(n, n, self._options) for n in names]
            return _Plan(
                names, list(names), table, [1.0] * len(names), None, sorted(used - {"dapo_math"})
            )
        plan = _Plan([], [], [], [], tuple(range(len(functions))))
        for i, item in enumerate(functions):
            try:
                function, weight = item
            except (TypeError, ValueError):
                raise ValueError(
                    f"reward.functions[{i}] must be a (name, weight) pair, got {item!r}"
                ) from None
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(
                    f"reward.functions[{i}] weight must be a finite number, got {weight!r}"
                )
            where = self._origins[i] if i < len(self._origins) else f"reward.functions[{i}]"
            if callable(function):  # from Python: dapo.train checked it (reward_funcs[i])
                name, source = callable_name(function), self._callable_source(function)
                entry = RewardFn.of(name, function)
            else:
                name = str(function)
                source = self._spec_source(name, where)
                entry = load_entry(name, source, self._options)  # fail here, not in a worker
                if entry is not None and source not in SCORERS:
                    check_signature(entry.fn, f"{where} ({name})")
            plan.names.append(name)
            plan.sources.append(source)
            plan.table.append(entry)
            plan.weights.append(float(weight))
        scorers = {s for s in plan.sources if isinstance(s, str) and s in SCORERS}
        plan.warm = sorted(scorers - {"dapo_math"})
        return plan

    def _spec_source(self, name: str, where: str) -> str:
        """What a worker loads for the function named ``name``."""
        if name in SCORERS:
            return name
        if ":" in name:
            return worker_spec(name, where, in_workers=self.num_workers > 0)
        raise ValueError(
            f"{where} name {name!r} is neither a built-in scorer "
            f"({', '.join(sorted(SCORERS))}) nor a spec {SPEC_FORMS}"
        )

    def _callable_source(self, fn: Callable[..., Any]) -> bytes | None:
        """``fn`` pickled for the workers, or None (with a warning) to run it here."""
        if self.num_workers == 0:
            return None
        try:
            return pickle_function(fn)
        except ValueError as e:
            warnings.warn(
                f"reward function {callable_name(fn)!r} cannot be pickled for the worker "
                f"processes ({e}); it runs in this process on a helper thread, where a call "
                f"over {self.timeout_s:g} s scores -1.0 but cannot be stopped.",
                RewardFunctionWarning,
                stacklevel=4,
            )
            return None

    # -- public API ---------------------------------------------------------

    @property
    def forms(self) -> list[str]:
        """The call form of each function (:data:`~dapo.rewards.user.SAMPLE`, ``TRL``,
        ``VERL``; a built-in scorer's is ``sample``)."""
        return self._plan.forms

    def describe(self, sources: Sequence[str]) -> list[str]:
        """Start-up lines: which scorer each of ``sources`` (the data's data sources) gets,
        or the functions with their forms and weights, and what "correct" means."""
        if self._plan.fixed_ids is None:
            lines = []
            for source in sorted(set(sources)):
                name = scorer_for_source(source, self._source_scorers, self._default_scorer)
                lines.append(
                    f"scoring data_source {source!r} with the built-in {name} scorer "
                    f"({SCORER_FORMS[name]}): +1 correct, -1 not"
                )
            return lines + self._code_lines(sources)
        plan, parts = self._plan, []
        for n, s, w, form in zip(plan.names, plan.sources, plan.weights, plan.forms, strict=True):
            kind = f"built-in: {SCORER_FORMS[s]};" if s in SCORERS else f"{form} form,"
            parts.append(f"{n} ({kind} weight {w:g})")
        return [
            "reward: " + " + ".join(parts) + "; 'acc' counts a response correct by a "
            "built-in scorer's +1, a dict's acc field, or reward > 0 while every function "
            "returns only -1, 0 and 1; otherwise acc is not shown and dynamic sampling keeps "
            "groups whose scores differ"
        ] + self._code_lines(sources)

    def _code_lines(self, sources: Sequence[str]) -> list[str]:
        """The one-line warning of ``reward.code.sandbox=none``, where programs will run."""
        used = any(set(self._fn_ids(s)) & self._code_ids for s in set(sources))
        return [UNISOLATED_WARNING] if used and not self.code.isolated else []

    @property
    def _code_ids(self) -> set[int]:
        return {i for i, s in enumerate(self._plan.sources) if s == "code"}

    def check_records(
        self, records: Sequence[Any], rows: Sequence[tuple[str, int]], key: str
    ) -> None:
        """Refuse, before training, rows the code scorer will judge whose tests are malformed
        (naming the row, the field ``key`` and the fix), or the sandbox missing for them.
        ``rows[i]`` is where ``records[i]`` came from (default: its position)."""
        code = self._code_ids
        truths, where = [], []
        for i, record in enumerate(records):
            if code & set(self._fn_ids(record.data_source)):
                truths.append(record.ground_truth)
                where.append(rows[i] if i < len(rows) else ("the prompts", i))
        check_rows(truths, where, key, self.code)

    @property
    def claims_correct(self) -> bool:
        """Whether every function has said what correct is so far (:class:`ScoreResult`)."""
        return all(self._binary)

    @property
    def answers(self) -> str:
        """What a row's answer may be for these functions (``answers`` of
        :class:`~dapo.data.records.RecordOptions`): ``text`` where a built-in scorer reads
        it (``any`` where the code scorer is named: its tests may be a dict), ``optional``
        where only TRL-form functions run (they take the columns they
        name), else ``any`` (a dict answer goes whole to the functions)."""
        named = (
            {self._default_scorer, *self._source_scorers.values()}
            if self._plan.fixed_ids is None
            else set(self._plan.sources)
        )
        if self._plan.fixed_ids is None or any(s in SCORERS for s in self._plan.sources):
            return "any" if "code" in named else "text"  # code tests may be a dict
        return "optional" if all(f == TRL for f in self._plan.forms) else "any"

    def check_columns(self, columns: set[str], where: str) -> None:
        """Refuse, naming the function and ``where`` the rows come from, a TRL-form function
        with a required parameter that is no column of the rows."""
        for entry in self._plan.table:
            if entry is None or entry.form != TRL:
                continue
            missing = missing_columns(entry.fn, columns)
            if missing:
                raise ConfigError(
                    f"reward function {entry.name!r} takes {', '.join(missing)}, but the rows "
                    f"of {where} have no such column (their columns: "
                    f"{', '.join(sorted(columns)) or 'none'}); TRL passes each column of the "
                    "dataset by its name: add the column or give the parameter a default"
                )

    def score(
        self, requests: list[ScoreRequest], groups: Sequence[Sequence[int]] | None = None
    ) -> ScoreResult:
        """Score a batch; never raises for a misbehaving reward function. ``groups`` are
        the request indices a TRL-form function sees in one call (default: all of them)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardScorer is closed; create a new one")
            plans = [self._fn_ids(r.data_source) for r in requests]
            if groups is None:
                groups = [range(len(requests))]
            outcomes = self._run(requests, plans, groups) if requests else []
            result = self._assemble(outcomes, plans)
            self.scored += len(requests)
            self.failed += result.failures
            return result

    def score_groups(
        self, texts: Sequence[Sequence[str]], truths: Sequence[tuple[str, str]]
    ) -> tuple[list[list[float]], list[list[bool]], ScoreResult]:
        """Score responses grouped by prompt: ``texts[i]`` are the responses to a prompt
        whose ``(ground_truth, data_source)`` is ``truths[i]``. Returns the rewards and
        correctness per group, and the flat :class:`ScoreResult` (failure counts)."""
        requests = [
            ScoreRequest(response=text, ground_truth=truth, data_source=source)
            for group, (truth, source) in zip(texts, truths, strict=True)
            for text in group
        ]
        return self.score_grouped(requests, [len(g) for g in texts])

    def score_grouped(
        self, requests: list[ScoreRequest], sizes: Sequence[int]
    ) -> tuple[list[list[float]], list[list[bool]], ScoreResult]:
        """Score ``requests`` that come in consecutive groups of ``sizes`` (each a TRL-form
        function's call): the rewards and correctness per group, and the flat result."""
        spans, start = [], 0
        for n in sizes:
            spans.append(range(start, start + n))
            start += n
        result = self.score(requests, [s for s in spans if s])
        rewards = [[result.rewards[i] for i in s] for s in spans]
        correct = [[result.correct[i] for i in s] for s in spans]
        return rewards, correct, result

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        with self._lock:
            self._closed = True
            for runner, _ in self._runners:
                if isinstance(runner, WorkerPool):
                    runner.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers."""
        pool = self._pool()
        return pool.pids if pool is not None else []

    def output_step(self, step: str) -> None:
        """What the workers print from here on belongs to ``step`` (``rollout step 3``),
        with a fresh limit per worker (:class:`~dapo.worker_output.OutputCapture`)."""
        pool = self._pool()
        if pool is not None:
            pool.output.new_step(step)

    @property
    def captures_user_output(self) -> bool:
        """Whether functions other than the built-in scorers run in worker processes (their
        output is captured, :class:`~dapo.worker_output.OutputCapture`)."""
        return self._pool() is not None and any(
            s is not None and not (isinstance(s, str) and s in SCORERS) for s in self._plan.sources
        )

    @property
    def output_dropped(self) -> int:
        """Bytes the workers printed over the limit, dropped, over this scorer's life."""
        pool = self._pool()
        return pool.output.dropped if pool is not None else 0

    @property
    def worker_startup_s(self) -> list[float]:
        """Start-up time (spawn to ready) of each ready worker, in seconds."""
        pool = self._pool()
        return pool.startup_s if pool is not None else []

    # -- helpers ------------------------------------------------------------

    def _pool(self) -> WorkerPool | None:
        return next((r for r, _ in self._runners if isinstance(r, WorkerPool)), None)

    def answer_reader(self, data_source: str) -> Callable[[str], str | None]:
        """How maj@k reads a response's answer for ``data_source``: as its built-in scorer
        reads it (``#### N`` for gsm8k, a ``\\boxed{}`` for math_verify), the ``Answer:``
        line for functions of yours; the code scorer's responses give none."""
        ids = self._fn_ids(data_source)
        names = {self._plan.sources[i] for i in ids}
        if len(names) == 1 and (name := next(iter(names))) in ANSWER_READERS:
            return ANSWER_READERS[name]  # type: ignore[index]
        return extract_answer

    def _fn_ids(self, data_source: str) -> tuple[int, ...]:
        if self._plan.fixed_ids is not None:
            return self._plan.fixed_ids
        fid = self._source_ids.get(data_source)
        if fid is None:
            name = scorer_for_source(data_source, self._source_scorers, self._default_scorer)
            fid = self._source_ids[data_source] = list(SCORERS).index(name)
        return (fid,)

    def _run(
        self,
        requests: list[ScoreRequest],
        plans: list[tuple[int, ...]],
        groups: Sequence[Sequence[int]],
    ) -> list[Outcome]:
        """Each runner scores its share of every request's functions (the workers those they
        loaded, the helper thread the in-process ones), per request, or per group for the
        TRL-form ones; a request's outcome is its first failure, else the values of all its
        functions in order and the info they gave."""
        samples = [r.sample() for r in requests]
        forms = self._plan.forms
        values: list[dict[int, float | None]] = [{} for _ in requests]
        infos: list[dict[str, float]] = [{} for _ in requests]
        failed: list[Outcome | None] = [None] * len(requests)
        runners = self._runners or [(None, None)]  # num_workers=0: in this thread
        for runner, in_process in runners:
            mine = [
                tuple(f for f in ids if in_process is None or (f in self._in_process) == in_process)
                for ids in plans
            ]
            items: list[tuple[list[int], tuple[Sample, ...], tuple[int, ...]]] = []
            for i, ids in enumerate(mine):
                one = tuple(f for f in ids if forms[f] not in BATCHED)
                if one:
                    items.append(([i], (samples[i],), one))
            for members in groups:  # a group's requests share their functions' plan
                members = [i for i in members if mine[i]]
                if not members:
                    continue
                batched = tuple(f for f in mine[members[0]] if forms[f] in BATCHED)
                if batched:
                    items.append((members, tuple(samples[i] for i in members), batched))
            if not items:
                continue
            payload = [(s, ids) for _, s, ids in items]
            if runner is None:
                results = [run_item(self._plan.table, ids, s) for s, ids in payload]
            else:
                results = runner.run(payload)
            for (members, _, ids), result in zip(items, results, strict=True):
                per = result if isinstance(result, list) else [result] * len(members)
                for i, outcome in zip(members, per, strict=True):
                    if outcome[0] == OK:
                        values[i].update(zip(ids, outcome[1], strict=True))
                        infos[i].update(outcome[2])
                    elif failed[i] is None:
                        failed[i] = outcome
        return [
            failed[i] or (OK, [values[i][f] for f in ids], infos[i]) for i, ids in enumerate(plans)
        ]

    def _assemble(self, outcomes: list[Outcome], plans: list[tuple[int, ...]]) -> ScoreResult:
        result = ScoreResult(rewards=[], correct=[])
        for outcome, ids in zip(outcomes, plans, strict=True):
            if outcome[0] == OK:
                _, found, info = outcome
                reward = sum(
                    self._plan.weights[f] * v
                    for f, v in zip(ids, found, strict=True)
                    if v is not None
                )
                if ids and all(v is None for v in found):
                    result.unscorable += 1
                    self._warn_once(UNSCORABLE, None, "")
                for f, v in zip(ids, found, strict=True):
                    if v is not None and v not in (-1.0, 0.0, 1.0) and "acc" not in info:
                        self._binary[f] = False
                if "acc" in info:
                    correct = info["acc"] > 0
                else:
                    correct = reward > 0
                    result.claims_correct &= all(self._binary[f] for f in ids)
                result.rewards.append(reward)
                result.correct.append(correct)
                result.infos.append(info)
                continue
            kind, fid, detail = outcome
            if self.first_error is None:
                name = self._plan.names[fid] if fid is not None else "<reward worker>"
                said = {
                    TIMEOUT: f"took longer than {self.timeout_s:g} s",
                    ERROR: f"raised {detail}",
                }.get(kind, f"returned {detail}, not a finite number")
                self.first_error = f"reward function {name!r} {said}"
            result.rewards.append(-1.0)
            result.correct.append(False)
            result.infos.append({})
            result.failures += 1
            if kind == TIMEOUT:
                result.timeouts += 1
            elif kind == ERROR:
                result.errors += 1
            else:
                result.bad_values += 1
            self._warn_once(kind, fid, detail)
        return result

    def _warn_once(self, kind: str, fid: int | None, detail: str) -> None:
        if (fid, kind) in self._warned:
            return
        self._warned.add((fid, kind))
        name = self._plan.names[fid] if fid is not None else "<reward worker>"
        if kind == UNSCORABLE:
            warnings.warn(
                "every reward function returned None (not applicable) for a response: it "
                "scores 0, as TRL's nansum gives, and counts in its group's baseline "
                "(reward/unscorable counts them per step). Return a number for every response "
                "a reward can judge, or add a function that judges the rest. (Warned once.)",
                RewardFunctionWarning,
                stacklevel=4,
            )
            return
        if kind == TIMEOUT:
            where = (
                "the call was abandoned (it runs on in a background thread)"
                if fid in self._in_process
                else "its worker was restarted"
            )
            text = (
                f"reward function {name!r} took longer than {self.timeout_s:g} s on a sample; "
                f"the sample scored -1.0 and {where}. Make the function faster or raise "
                "reward.timeout_s."
            )
        elif kind == ERROR:
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
