"""Where a decoding step's time goes: the transformers engine now (``hf``) and as of an
earlier commit (``hf-prev``, ``bench_engines.previous_engine_class``), and now with the model's
own forward for each step (``hf-forward``, without :class:`~dapo.rollout.llama_step.LlamaStep`), under
``torch.profiler`` on the same model and prompts.

Each engine generates once to warm up, then once under the profiler. The script prints,
per engine, the wall time of the profiled call, its decode steps (forward passes of one
token per row), the milliseconds per step, and the operators that took the most time
(self CPU time, summed over the call) grouped into what they do, and writes the table as
JSON.

    python benchmarks/profile_decode.py                      # builtin:tiny, 16 x 8 x 64
    python benchmarks/profile_decode.py --model smollm2 --max-tokens 32
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from _report import provenance, write_report  # benchmarks/_report.py (run as a script)
from bench_engines import BASELINE_REF, MODELS, previous_engine_class

from dapo.rollout import HFEngine, SamplingParams, decode

# What each operator does in a decoding loop (the rest is "other": norms, activations,
# rotary embeddings, element-wise maths and the dispatcher's view/reshape bookkeeping).
GROUPS = {
    "linear layers": ("aten::mm", "aten::addmm"),
    "attention": (
        "aten::bmm",
        "aten::baddbmm",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_attention_math",
        "aten::_softmax",
        "aten::masked_fill_",
    ),
    "growing cache and mask (cat, row selection)": ("aten::cat", "aten::index"),
    "static cache writes (scatter)": (
        "aten::scatter_",
        "aten::index_put_",
        "aten::_index_put_impl_",
    ),
    "sampling": (
        "aten::cumsum_",
        "aten::cumsum",
        "aten::searchsorted",
        "aten::_log_softmax",
        "aten::exp",
        "aten::uniform_",
    ),
}


@contextlib.contextmanager
def counting_steps(engine: Any) -> Iterator[dict]:
    """Counts the decode steps of the calls inside: today's engine's ``decode_step`` calls
    (a hook on the model would turn its LlamaStep off), the earlier engine's one-token
    forwards."""
    steps = {"n": 0}
    if isinstance(engine, HFEngine):
        real = decode.decode_step

        def counted(*a: Any, **k: Any) -> None:
            steps["n"] += 1
            real(*a, **k)

        decode.decode_step = counted
        try:
            yield steps
        finally:
            decode.decode_step = real
        return

    def count(_m: Any, _a: Any, kwargs: dict) -> None:
        steps["n"] += int(kwargs["input_ids"].shape[1] == 1)

    handle = engine.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield steps
    finally:
        handle.remove()


def profile(engine: Any, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine.generate(prompts, params)  # warm-up
    with counting_steps(engine) as steps, torch.profiler.profile() as prof:
        t0 = time.perf_counter()
        groups = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
    tokens = sum(len(r) for g in groups for r in g.response_ids)
    by_op = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}  # ms
    total = sum(by_op.values())
    grouped = {name: sum(by_op.get(op, 0.0) for op in ops) for name, ops in GROUPS.items()}
    grouped["other"] = total - sum(grouped.values())
    return {
        "seconds": round(seconds, 3),
        "tokens": tokens,
        "decode_steps": steps["n"],
        "ms_per_step": round(1e3 * seconds / max(steps["n"], 1), 2),
        "profiled_ms": round(total, 1),
        "groups_ms": {k: round(v, 1) for k, v in grouped.items()},
        "top_ops_ms": {
            k: round(v, 1) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
        },
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--baseline-ref", default=BASELINE_REF)
    ap.add_argument("--json", default="benchmarks/results/profile_decode.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = MODELS[args.model](args.prompts)
    bench.model.eval()
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    engines = {
        "hf": HFEngine(bench.model, bench.eos, bench.pad),
        "hf-forward": HFEngine(bench.model, bench.eos, bench.pad, direct=False),
        "hf-prev": previous_engine_class(args.baseline_ref)(bench.model, bench.eos, bench.pad),
    }
    results = {name: profile(e, bench.prompts, params) for name, e in engines.items()}
    for name, r in results.items():
        print(
            f"\n{name}: {r['seconds']:.3f} s, {r['tokens']} tokens, {r['decode_steps']} decode "
            f"steps, {r['ms_per_step']:.2f} ms per step (profiled: {r['profiled_ms']:.0f} ms)"
        )
        for group, ms in r["groups_ms"].items():
            print(f"  {group:45s} {ms:8.1f} ms  {100 * ms / r['profiled_ms']:5.1f}%")
    report = {
        "settings": {**vars(args)},
        **provenance(),
        "results": results,
    }
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
