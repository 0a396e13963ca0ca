"""The built-in ``code`` scorer: run the response's program against the row's tests.

The program is the last fenced Python block of the response (```` ```python ````,
```` ```py ```` or a bare fence), or the whole response when it has none
(``reward.code.require_block=true``: no program, scored as a compile error). It runs in a
fresh sandbox (:mod:`dapo.rewards.sandbox`) on the row's tests (:mod:`dapo.rewards.code_tests`:
verl/PRIME, DeepCoder and open-r1 layouts), and scores by DAPO's rule: +1 when it passes
every test, -1 otherwise; with ``reward.code.partial_credit`` the fraction passed, mapped
to [-1, 1]. Beside the score it returns ``acc`` (all passed), ``pass_rate``,
``compile_error``, ``timeout`` and ``runtime_error``, which the trainer logs as
``reward/extra_<field>``.

In training the scorer is called once per group of responses (:func:`score_group`), whose
programs run side by side, ``reward.code.parallel`` at a time, so that a group of programs
at their time limit costs about one time limit.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dapo.errors import ConfigError, DataError
from dapo.rewards.code_tests import Case, TestSpecError, outputs_match, parse_tests, values_match
from dapo.rewards.sandbox import (
    Limits,
    ProgramRun,
    SandboxUnavailable,
    TestRun,
    collect,
    isolation_problem,
    start_program,
)

_FENCE_RE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_OTHER_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]+)[ \t]*\n")


@dataclass(frozen=True)
class CodeSettings:
    """The ``reward.code`` settings, as the scorer takes them (see
    :class:`dapo.config.schema.CodeRewardConfig` for each one's meaning)."""

    sandbox: str = "bubblewrap"
    partial_credit: bool = False
    require_block: bool = False
    float_tolerance: float = 1e-6
    parallel: int = 8
    # The sandbox's limits, defaulted as Limits is (CodeSettings.limits hands them on).
    test_timeout_s: float = Limits.test_timeout_s
    program_timeout_s: float = Limits.program_timeout_s
    memory_mb: int = Limits.memory_mb
    max_processes: int = Limits.max_processes
    max_file_mb: int = Limits.max_file_mb
    max_open_files: int = Limits.max_open_files
    max_output_bytes: int = Limits.max_output_bytes
    budget_s: float | None = None  # a whole group's wall time (below the reward call's)

    @classmethod
    def of(cls, options: dict[str, Any]) -> CodeSettings:
        """Settings from keyword arguments; a ValueError naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known - {"data_source", "extra_info"})
        if unknown:
            raise ValueError(
                f"code_reward got unknown setting(s) {', '.join(unknown)}; "
                f"the settings are {', '.join(sorted(known))}"
            )
        return cls(**{k: v for k, v in options.items() if k in known})

    @property
    def limits(self) -> Limits:
        return Limits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Limits)})

    @property
    def isolated(self) -> bool:
        return self.sandbox != "none"


def extract_program(response: str, require_block: bool = False) -> str | None:
    """The last fenced Python block of ``response`` (a bare fence counts), else the whole
    response, or None with ``require_block`` (or when its only blocks are another language's)."""
    blocks = _FENCE_RE.findall(response)
    if blocks:
        return blocks[-1][1]
    if require_block or _OTHER_FENCE_RE.search(response):
        return None
    return response


def code_reward(response: str, ground_truth: Any, **settings: Any) -> dict[str, float]:
    """Score one response's program against ``ground_truth``'s tests (any layout of
    :func:`~dapo.rewards.code_tests.parse_tests`); ``settings`` are :class:`CodeSettings`
    fields (``partial_credit=True``, ``test_timeout_s=5``, ``sandbox="none"``...).
    Returns the score with ``acc``, ``pass_rate``, ``compile_error``, ``timeout`` and
    ``runtime_error``. Raises only for a malformed test spec or a missing sandbox."""
    return score_programs([(response, ground_truth)], CodeSettings.of(settings))[0]


def score_group(samples: Sequence[Any], **settings: Any) -> list[dict[str, float]]:
    """The built-in scorer's call on a group of samples (each with ``response`` and
    ``ground_truth``), their programs run side by side."""
    return score_programs(
        [(s.response, s.ground_truth) for s in samples], CodeSettings.of(settings)
    )


def score_programs(
    items: Sequence[tuple[str, Any]], settings: CodeSettings
) -> list[dict[str, float]]:
    """Score ``(response, ground_truth)`` pairs, ``settings.parallel`` sandboxes at a time,
    within ``settings.budget_s`` for them all (a program not started in time scores -1 with
    ``timeout``)."""
    if settings.isolated:
        problem = isolation_problem()
        if problem is not None:
            raise SandboxUnavailable(refusal(problem))
    cases = [parse_tests(truth) for _, truth in items]
    programs = [extract_program(response, settings.require_block) for response, _ in items]
    limits = settings.limits
    end = None if settings.budget_s is None else time.monotonic() + settings.budget_s
    runs: list[ProgramRun | None] = [None] * len(items)
    todo = [i for i, p in enumerate(programs) if p is not None]
    for start in range(0, len(todo), max(1, settings.parallel)):
        wave = todo[start : start + settings.parallel]
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0.05:
            break
        wave_limits = limits
        if left is not None and left < limits.program_timeout_s:
            wave_limits = dataclasses.replace(limits, program_timeout_s=left)
        started = [
            start_program(
                programs[i],  # type: ignore[arg-type]
                [c.request() for c in cases[i]],
                wave_limits,
                isolated=settings.isolated,
                stop_on_failure=not settings.partial_credit,
            )
            for i in wave
        ]
        for i, run in zip(wave, collect(started), strict=True):
            runs[i] = run
    out = []
    for i, run in enumerate(runs):
        if programs[i] is None:
            run = ProgramRun(compile_error="no program in the response")
        elif run is None:
            run = ProgramRun(tests=[TestRun("not_run") for _ in cases[i]])
        out.append(_score(run, cases[i], settings))
    return out


def _score(run: ProgramRun, cases: list[Case], settings: CodeSettings) -> dict[str, float]:
    """The score and logged fields of one program's run."""
    n = len(cases)
    if run.compile_error is not None:
        passed, timeout, error = 0, 0.0, 0.0
    else:
        passed = sum(
            _passed(t, c, settings.float_tolerance) for t, c in zip(run.tests, cases, strict=False)
        )
        ran = [t for t in run.tests if t.status != "not_run"]
        cut = len(ran) < len(run.tests) and all(t.status == "ok" for t in ran)  # out of time
        timeout = float(cut or any(t.status == "timeout" for t in ran))
        error = float(any(t.status in ("error", "output_limit") for t in run.tests))
    rate = passed / n
    correct = passed == n
    score = 2.0 * rate - 1.0 if settings.partial_credit else (1.0 if correct else -1.0)
    return {
        "score": score,
        "acc": float(correct),
        "pass_rate": rate,
        "compile_error": float(run.compile_error is not None),
        "timeout": timeout,
        "runtime_error": error,
    }


def _passed(test: TestRun, case: Case, tolerance: float) -> bool:
    if test.status != "ok":
        return False
    if case.fn is None:
        return outputs_match(test.out, str(case.expected), tolerance)
    if test.value is None:
        return False
    try:
        value = json.loads(test.value)
    except ValueError:
        return False
    return values_match(value, case.expected, tolerance)


def refusal(problem: str) -> str:
    """Why the code scorer will not run programs here, and the two ways out."""
    return (
        f"the code scorer runs the model's programs only in a sandbox, and none can be had "
        f"here: {problem}. Install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; "
        "`make setup` does it when run as root) on a Linux with user namespaces, or set "
        "reward.code.sandbox=none to run them as plain subprocesses with limits only (they "
        "can then reach the network, your files and your processes)"
    )


UNISOLATED_WARNING = (
    "reward.code.sandbox=none: the model's programs run as plain subprocesses with limits "
    "on time, memory, processes, files and output only: NOT isolated from the network, "
    "the file system (the run's files, your home), this user's processes, or each other"
)


def check_rows(
    truths: Sequence[Any], rows: Sequence[tuple[str, int]], key: str, settings: CodeSettings
) -> None:
    """Before training: a :class:`~dapo.errors.ConfigError` when programs are to be run and
    cannot be isolated (:func:`refusal`), a :class:`~dapo.errors.DataError` naming the first
    row (``rows[i]``: file and index) whose tests (field ``key``) are malformed."""
    if not truths:
        return
    if settings.isolated:
        problem = isolation_problem()
        if problem is not None:
            raise ConfigError(refusal(problem))
    for truth, (where, index) in zip(truths, rows, strict=True):
        try:
            parse_tests(truth)
        except TestSpecError as e:
            raise DataError(
                f"{where}: row {index}: field '{key}': the code scorer cannot read its tests: "
                f"{e}. Fix: give the row's tests in one of those layouts, point "
                "data.answer_key at them (e.g. verification_info, tests), or drop the row"
            ) from None


__all__ = [
    "UNISOLATED_WARNING",
    "CodeSettings",
    "SandboxUnavailable",
    "TestSpecError",
    "check_rows",
    "code_reward",
    "extract_program",
    "refusal",
    "score_group",
    "score_programs",
]
