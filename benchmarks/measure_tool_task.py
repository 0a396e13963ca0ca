"""Held-out episode success on the built-in multi-turn task, with and without the tool.

Plays ``--generations`` episodes (temperature ``--temperature``, 1 by default) on each of
``--problems`` held-out ``builtin:calculator`` problems with the ``hf`` engine, the
episode runner (:func:`dapo.rollout.episodes.run_episodes`) and the task's environment
(no trainer), and reports for two conditions:

- ``tool``: the environment as in training;
- ``withheld``: the same, but every tool reply is replaced by an empty message, so the
  model must find the sum without the tool (the answers must not be reachable: ~0%).

For each: success (avg@G, scored by ``dapo_math`` on the final assistant turn), the share of
groups with both right and wrong episodes (what RL learns from), turns and tool calls per
episode, tokens per episode, and the episodes' end reasons.

    python benchmarks/measure_tool_task.py                          # builtin:tiny-tool
    python benchmarks/measure_tool_task.py --model runs/x/final_model --problems 200
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

import torch
from _report import provenance, write_report  # benchmarks/_report.py (run as a script)

from dapo.data.tasks import calculator, load_task
from dapo.environments import EnvironmentPool, load_environment
from dapo.models import load_policy, load_tokenizer, resolve_model_path
from dapo.rewards import dapo_math_score
from dapo.rollout.base import SamplingParams
from dapo.rollout.episodes import run_episodes
from dapo.rollout.hf_engine import HFEngine


class WithheldReplies:
    """A pool whose tool replies are emptied: the control without the tool's answers."""

    def __init__(self, pool: EnvironmentPool) -> None:
        self.pool = pool
        self.tool_schemas = pool.tool_schemas

    def reset(self, records: list[Any]) -> list[Any]:
        return self.pool.reset(records)

    def step(self, turns: list[tuple[int, str]]) -> list[Any]:
        outcomes = self.pool.step(turns)
        for o in outcomes:
            o.messages = [m | {"content": ""} if m["role"] == "tool" else m for m in o.messages]
        return outcomes

    def end(self, episodes: list[int]) -> None:
        self.pool.end(episodes)


def play(args: argparse.Namespace, model: Any, tok: Any, withheld: bool) -> dict[str, Any]:
    records = load_task(calculator.NAME, "test", args.problems)
    spec = load_environment("calculator")
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, batch_size=args.batch)
    params = SamplingParams(
        n=args.generations, temperature=args.temperature, max_tokens=args.max_length, seed=args.seed
    )
    start = time.perf_counter()
    groups = []
    with EnvironmentPool(spec, num_workers=args.workers) as pool:
        env = WithheldReplies(pool) if withheld else pool
        for i in range(0, len(records), args.chunk):
            chunk = records[i : i + args.chunk]
            groups += run_episodes(engine, tok, chunk, params, env, max_turns=args.max_turns)
    seconds = time.perf_counter() - start
    right = [
        [dapo_math_score(t, r.ground_truth) > 0 for t in g.final_texts]
        for g, r in zip(groups, records, strict=True)
    ]
    stats = [s for g in groups for s in g.episode_stats]
    flat = [x for row in right for x in row]
    return {
        "success": sum(flat) / len(flat),
        "mixed_groups": sum(0 < sum(row) < len(row) for row in right) / len(right),
        "all_wrong_groups": sum(not any(row) for row in right) / len(right),
        "all_right_groups": sum(all(row) for row in right) / len(right),
        "turns_mean": statistics.mean(s["turns"] for s in stats),
        "tool_calls_mean": statistics.mean(s["tool_calls"] for s in stats),
        "tool_errors": sum(s["tool_errors"] for s in stats),
        "tokens_mean": statistics.mean(len(r) for g in groups for r in g.response_ids),
        "env_tokens_share": sum(s["env_tokens"] for s in stats)
        / max(1, sum(len(r) for g in groups for r in g.response_ids)),
        "end_reasons": dict(Counter(s["end"] for s in stats)),
        "seconds": seconds,
        "examples": [g.final_texts[0] for g in groups[:3]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:tiny-tool")
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-turns", type=int, default=calculator.SUGGESTED_MAX_TURNS)
    parser.add_argument("--max-length", type=int, default=calculator.SUGGESTED_MAX_LENGTH)
    parser.add_argument("--batch", type=int, default=256, help="engine batch (sequences)")
    parser.add_argument("--chunk", type=int, default=32, help="problems per run_episodes call")
    parser.add_argument("--workers", type=int, default=1, help="environment worker processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None, help="write the report as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tok, model = load_tokenizer(path), load_policy(path).eval()
    result: dict[str, Any] = {"model": args.model, "args": vars(args)}
    for name, withheld in (("tool", False), ("withheld", True)):
        result[name] = play(args, model, tok, withheld)
        r = result[name]
        print(
            f"{name:9s} success {r['success']:.1%}  mixed groups {r['mixed_groups']:.0%} "
            f"(all wrong {r['all_wrong_groups']:.0%}, all right {r['all_right_groups']:.0%})  "
            f"turns {r['turns_mean']:.2f}  tool calls {r['tool_calls_mean']:.2f}  "
            f"tokens {r['tokens_mean']:.0f}  ends {r['end_reasons']}  ({r['seconds']:.0f} s)"
        )
    result |= provenance()
    if args.output:
        write_report(args.output, result)


if __name__ == "__main__":
    main()
