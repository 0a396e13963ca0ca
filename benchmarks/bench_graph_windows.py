"""What a CUDA-graph decode step pays for attending over the whole cache: the hf engine on the
graphs' schedule with its steps attending over cache windows that grow with the responses
(``windows``: from ``decode.GRAPH_MIN_WINDOW`` slots) against the whole cache from the first
token (``whole``: one window, as steps were captured before), in one process, taking turns.

On CUDA the steps are replayed from captured graphs. Elsewhere (the capture needs CUDA) they
run eagerly on the same schedule (batch-size buckets, the prompt width rounded to 32, the
same windows), which shows what reading the unused slots costs on that device. Responses end
with EOS at ``--eos-rate`` per token (most short, a few long, as in DAPO's runs) under a limit
of ``--max-tokens``; the table gives tokens per second (median of ``--repeats``) and the
mean number of cache slots a step attended over, and writes JSON.

    python benchmarks/bench_graph_windows.py                     # builtin:tiny, 16 x 8, 1,024
    python benchmarks/bench_graph_windows.py --model 100m --max-tokens 512 --prompts 8
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _report import provenance, write_report  # benchmarks/_report.py (run as a script)
from bench_engines import MODELS, eos_rate_hook, run_once

from dapo.rollout import HFEngine, SamplingParams, decode

SIDES = {"windows": decode.GRAPH_MIN_WINDOW, "whole": 1 << 40}  # GRAPH_MIN_WINDOW per side


def counting_windows(slots: list[int]) -> None:
    """Appends each decode step's window (the cache slots it attends over) to ``slots``."""
    step = decode.decode_step

    def counted(model: torch.nn.Module, s: decode.DecodeState, *args: object) -> None:
        slots.append(s.valid.shape[1])
        step(model, s, *args)

    decode.decode_step = counted


class GraphSchedule(HFEngine):
    """The hf engine on the CUDA-graph path: replayed graphs on CUDA; elsewhere the same
    schedule with eager steps (as after a failed capture)."""

    def uses_graphs(self) -> bool:
        if self.model.device.type == "cuda":
            return super().uses_graphs()
        self.workspaces.capture_failed = True  # no capture on a CPU: eager steps
        return True


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--eos-rate", type=float, default=0.03)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="benchmarks/results/graph_windows.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = MODELS[args.model](args.prompts)
    bench.model.to(args.device).eval()
    eos_rate_hook(bench.model, bench.eos, args.eos_rate)
    engines = {side: GraphSchedule(bench.model, bench.eos, bench.pad) for side in SIDES}
    runs: dict[str, list[tuple]] = {side: [] for side in SIDES}
    slots: list[int] = []
    windows: dict[str, list[int]] = {side: [] for side in SIDES}
    if args.device != "cuda":  # on CUDA only a capture runs the step's Python, not a replay
        counting_windows(slots)
    for r in range(args.repeats + 1):  # the first round warms up (and captures) only
        params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=r)
        for side, engine in engines.items():
            decode.GRAPH_MIN_WINDOW = SIDES[side]
            slots.clear()
            result = run_once(engine, bench.prompts, params)
            if r:
                runs[side].append(result)
                windows[side].extend(slots)
    results = {
        side: {
            "tokens_per_s": round(statistics.median(x[0] for x in rs), 1),
            "tokens_per_s_runs": [round(x[0], 1) for x in rs],
            "tokens": [x[1] for x in rs],
            "truncated": [x[3] for x in rs],
            "mean_window": round(statistics.mean(windows[side]), 1) if windows[side] else None,
        }
        for side, rs in runs.items()
    }
    ratio = results["windows"]["tokens_per_s"] / results["whole"]["tokens_per_s"]
    print(f"{args.model} on {args.device}, {args.prompts} x {args.n} up to {args.max_tokens}:")
    for side, r in results.items():
        print(
            f"  {side:8s} {r['tokens_per_s']:10.1f} tokens/s  runs {r['tokens_per_s_runs']}  "
            f"mean window {r['mean_window']} slots"
        )
    print(f"  windows / whole: {ratio:.2f}x")
    report = {"settings": vars(args), **provenance(), "results": results, "ratio": ratio}
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
