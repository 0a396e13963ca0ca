"""The code scorer's cost: programs per second, and the sandbox's overhead per program.

Runs a trivial stdin/stdout program (``print(sum(map(int, input().split())))``, one test)
``--programs`` times three ways, each ``--parallel`` at a time as a reward worker runs a
group: in the sandbox (bubblewrap), as a plain subprocess with the same harness and limits
(``reward.code.sandbox=none``), and through the whole scorer (a :class:`RewardScorer` with
one worker, the trainer's path). Then a group of ``--slow`` programs that sleep past a
1-second time limit, to show that they cost about one limit together.

    python benchmarks/bench_code_sandbox.py --json benchmarks/results/code_sandbox.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _report import provenance, write_report

from dapo.rewards import RewardScorer, ScoreRequest
from dapo.rewards.sandbox import Limits, collect, isolation_problem, start_program

PROGRAM = "print(sum(map(int, input().split())))"
TESTS = [{"stdin": "1 2\n"}]
TRUTH = {"inputs": ["1 2\n"], "outputs": ["3\n"]}


def _rate(n: int, parallel: int, isolated: bool) -> dict[str, float]:
    """Programs per second run ``parallel`` at a time, and the mean latency of one alone."""
    limits = Limits()
    start = time.perf_counter()
    for first in range(0, n, parallel):
        wave = [
            start_program(PROGRAM, TESTS, limits, isolated=isolated)
            for _ in range(min(parallel, n - first))
        ]
        runs = collect(wave)
        assert all(r.tests[0].status == "ok" and r.tests[0].out == "3\n" for r in runs), runs
    total = time.perf_counter() - start
    alone = []
    for _ in range(max(3, n // 10)):
        t = time.perf_counter()
        collect([start_program(PROGRAM, TESTS, limits, isolated=isolated)])
        alone.append(time.perf_counter() - t)
    return {"programs_per_s": n / total, "latency_ms": 1000 * statistics.median(alone)}


def _scorer_rate(n: int, parallel: int) -> float:
    """Programs per second through a RewardScorer (one worker, groups of ``parallel``)."""
    response = f"```python\n{PROGRAM}\n```"
    with RewardScorer(num_workers=1, code={"parallel": parallel}) as scorer:
        scorer.score_grouped([ScoreRequest(response, TRUTH, "codecontests")], [1])  # warm
        requests = [ScoreRequest(response, TRUTH, "codecontests") for _ in range(n)]
        sizes = [parallel] * (n // parallel) + ([n % parallel] if n % parallel else [])
        start = time.perf_counter()
        rewards, _, _ = scorer.score_grouped(requests, sizes)
        took = time.perf_counter() - start
    assert all(r == 1.0 for group in rewards for r in group)
    return n / took


def _slow_group(k: int) -> float:
    """Seconds to score a group of ``k`` programs that all run past a 1 s time limit."""
    response = "```python\nimport time\ntime.sleep(60)\n```"
    code = {"test_timeout_s": 1.0, "parallel": max(k, 1)}
    with RewardScorer(num_workers=1, timeout_s=10, code=code) as scorer:
        scorer.score_grouped([ScoreRequest(response, TRUTH, "codecontests")], [1])
        start = time.perf_counter()
        scorer.score_grouped([ScoreRequest(response, TRUTH, "codecontests")] * k, [k])
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", type=int, default=200, help="programs per measurement")
    p.add_argument("--parallel", type=int, default=8, help="programs run side by side")
    p.add_argument("--slow", type=int, default=8, help="programs in the time-limit group")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    problem = isolation_problem()
    if problem is not None:
        raise SystemExit(f"no sandbox here: {problem}")
    sandboxed = _rate(args.programs, args.parallel, isolated=True)
    plain = _rate(args.programs, args.parallel, isolated=False)
    result = {
        "programs": args.programs,
        "parallel": args.parallel,
        "sandbox": sandboxed,
        "unisolated": plain,
        "overhead_ms_per_program": sandboxed["latency_ms"] - plain["latency_ms"],
        "scorer_programs_per_s": _scorer_rate(args.programs, args.parallel),
        "slow_group": {
            "programs": args.slow,
            "time_limit_s": 1.0,
            "seconds": _slow_group(args.slow),
        },
    }
    for name in ("sandbox", "unisolated"):
        r = result[name]
        print(f"{name:11s} {r['programs_per_s']:7.1f} programs/s, {r['latency_ms']:6.1f} ms alone")
    print(f"overhead    {result['overhead_ms_per_program']:+7.1f} ms per program")
    print(f"scorer      {result['scorer_programs_per_s']:7.1f} programs/s (one reward worker)")
    slow = result["slow_group"]
    print(f"{slow['programs']} programs past a 1 s limit: {slow['seconds']:.2f} s")
    report = {**provenance(), "result": result}
    if args.json:
        write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
