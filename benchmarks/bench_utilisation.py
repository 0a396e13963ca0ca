"""Utilisation (MFU) of a rollout step: model FLOPs per second over this machine's fp32 peak.

Saves a randomly initialised Llama of about 100M parameters (the ``100m`` model of
``bench_engines.py``: the ``builtin:tiny`` architecture at hidden 768, 12 layers, 12 heads,
MLP 2048, vocabulary 32000, tied embeddings, the builtin character tokenizer) and runs the
real trainer on it in this process (``dapo.training.trainer.Trainer``, ``dapo`` preset, data
``builtin:addition``, dynamic sampling off so every step does the same work, overlong
filtering off so that the loss has tokens, no evaluation, no checkpoints). Each rollout
step generates ``--generations`` responses of up to ``--max-tokens`` tokens for
``--prompts`` prompts and makes one optimizer update on them. Random weights rarely emit
EOS, so the responses run to ``--max-tokens``.

Model FLOPs (the PaLM / Chinchilla convention: matrix multiplications only, 2 FLOPs per
multiply-add, a backward pass costs twice its forward; model FLOPs, not hardware FLOPs:
no activation recomputation, no padding). For hidden ``d``, ``L`` layers, ``H`` query
heads of size ``h``, ``K`` key/value heads, MLP width ``I``, vocabulary ``V``::

    N = L * (d*H*h + 2*d*K*h + H*h*d + 3*d*I)     non-embedding matmul weights
    forward of one token attending to c keys = 2*N + 4*L*H*h*c  (+ 2*d*V where its logits are used)

Attention is counted causally (a token at position ``i`` attends to ``i + 1`` keys, as
with a KV cache; PaLM's ``12*L*H*h*T`` per training token counts the whole length ``T``,
twice this). The output projection ``2*d*V`` is counted whether or not it is tied to the
embedding (tying shares the weights, not the matmul), for the positions whose logits are
used. Embedding lookups, norms, activations, softmax, sampling and the optimizer are not
counted. For a prompt of ``P`` tokens and its responses of ``R`` tokens:

- generation (``HFEngine``: one prefill per prompt shared by its responses, then one
  forward per fed-back token; the last sampled token is never fed back):
  prefill ``P*2N + 4LHh * P(P+1)/2 + 2dV``, and per response
  ``(R-1) * (2N + 2dV) + 4LHh * ((R-1)*P + R(R-1)/2)``;
- training with the shared prompt forward (``train.shared_prompt_forward``, the default:
  each prompt once per group, its responses on its cache, tokens 0..R-2 as inputs): the
  generation count above, 3 times (forward + backward);
- training without it (forward and backward of every sample, 3 x forward):
  ``3 * [(P+R)*2N + 4LHh * (P+R)(P+R+1)/2 + R*2dV]`` (logits of the ``R`` positions that
  predict a response token), plus one more forward if the trainer recomputes the old
  policy's log-probs (several updates per rollout step; not with one update, as here).

Peak: the fastest of ``--peak-repeats`` ``--peak-size`` square fp32 matmuls with the same
thread count, measured before and after the run; the faster of the two is the peak.
MFU = FLOPs / seconds / peak, for generation (over the ``generate`` time), training (over
the update time) and the whole step (over the step time, which also holds scoring); the
summary is the median over the steps after the first (which warms up).

    python benchmarks/bench_utilisation.py                 # ~110M model, 4 x 8 x 64, 4 steps
    python benchmarks/bench_utilisation.py --hidden 64 --layers 2 --heads 4 --intermediate 128 \\
        --vocab 128 --prompts 2 --generations 2 --max-tokens 8 --steps 2 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _models import save_random_llama  # benchmarks/_models.py (run as a script)
from _report import provenance, write_report  # benchmarks/_report.py (run as a script)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "utilisation.json"


@dataclass(frozen=True)
class Shape:
    """The dimensions the FLOP count needs."""

    hidden: int
    layers: int
    heads: int
    head_dim: int
    kv_heads: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Shape:
        heads = config.num_attention_heads
        return cls(
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            kv_heads=config.num_key_value_heads or heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
        )

    @property
    def body_params(self) -> int:
        """N: the non-embedding matmul weights (q, k, v, o, gate, up, down) of all layers."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (d * q + 2 * d * kv + q * d + 3 * d * self.intermediate)

    def forward(self, tokens: int, keys: int, logits: int) -> int:
        """Forward FLOPs of ``tokens`` tokens attending to ``keys`` keys in all, with the
        output projection at ``logits`` positions."""
        attention = 4 * self.layers * self.heads * self.head_dim * keys
        return 2 * self.body_params * tokens + attention + 2 * self.hidden * self.vocab * logits


def generation_flops(shape: Shape, prompt_lens: list[int], response_lens: list[list[int]]) -> int:
    """Model FLOPs of generating ``response_lens[i]`` for prompt ``i`` (prefill shared)."""
    total = 0
    for p, group in zip(prompt_lens, response_lens, strict=True):
        total += shape.forward(p, p * (p + 1) // 2, 1)
        for r in group:
            fed = max(r - 1, 0)
            total += shape.forward(fed, fed * p + r * fed // 2, fed)
    return total


def training_flops(
    shape: Shape,
    prompt_lens: list[int],
    response_lens: list[list[int]],
    old_logprobs: bool,
    shared_prompt: bool = False,
) -> int:
    """Model FLOPs of the update: forward + backward (+ an old-log-prob forward) per sample.

    With ``shared_prompt`` (``train.shared_prompt_forward``) each prompt is forwarded once
    for its group and the responses run on its cache, token 0..R-2 as inputs: the same
    computation as generation, so each pass costs :func:`generation_flops`.
    """
    passes = 3 + (1 if old_logprobs else 0)
    if shared_prompt:
        return passes * generation_flops(shape, prompt_lens, response_lens)
    total = 0
    for p, group in zip(prompt_lens, response_lens, strict=True):
        for r in group:
            n = p + r
            total += passes * shape.forward(n, n * (n + 1) // 2, r)
    return total


def matmul_peak(size: int, repeats: int) -> dict[str, Any]:
    """Best GFLOP/s of a ``size`` x ``size`` fp32 matmul (after one warm-up call): the peak
    is what the cores reach, so the fastest repeat, not a typical one."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    c = torch.empty(size, size)
    torch.mm(a, b, out=c)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        seconds.append(time.perf_counter() - t0)
    flops = 2 * size**3
    runs = [flops / s / 1e9 for s in seconds]
    return {"gflops": max(runs), "median_gflops": statistics.median(runs), "runs": runs}


def recomputes_old_logprobs(cfg: Any) -> bool:
    """Whether ``Trainer.update`` runs an extra forward for the old policy's log-probs."""
    t = cfg.train
    several_updates = t.prompts_per_step // t.mini_batch_size > 1 or t.epochs > 1
    engine_logprobs = cfg.rollout.engine != "hf" or cfg.algorithm.is_cap is not None
    return several_updates or engine_logprobs or cfg.algorithm.entropy_control != "none"


def run_steps(args: argparse.Namespace, work: Path, shape_kw: dict[str, int]) -> dict[str, Any]:
    """Save the model, run ``args.steps`` rollout steps; per-step timings and token counts."""
    from dapo.config import load_config
    from dapo.training.forward import prompt_cache
    from dapo.training.trainer import Trainer

    model = save_random_llama(work / "model", seed=args.seed, **shape_kw)
    n_params = sum(p.numel() for p in model.parameters())
    shape = Shape.of(model.config)
    del model
    cfg = load_config(
        overrides={
            "output_dir": str(work / "run"),
            "seed": args.seed,
            "model.name_or_path": str(work / "model"),
            "data.train": "builtin:addition",
            "evaluate": False,
            "algorithm.dynamic_sampling": False,
            "algorithm.overlong_filter": False,  # truncated responses keep their loss tokens
            "algorithm.overlong_buffer": min(16, args.max_tokens - 1),
            "rollout.num_generations": args.generations,
            "rollout.max_completion_length": args.max_tokens,
            "train.prompts_per_step": args.prompts,
            "train.mini_batch_size": args.prompts,  # one optimizer update per rollout step
            "train.steps": args.steps,
            "checkpoint.save_every": 0,
            "checkpoint.save_final_model": False,
            "logging.console": False,
            "logging.tensorboard": False,
        }
    )
    old_logprobs = recomputes_old_logprobs(cfg)
    trainer = Trainer(cfg, log=lambda _: None)
    # The update forwards each prompt once per group when it can (dapo.training.forward.response_logits).
    shared = (
        cfg.train.shared_prompt_forward
        and args.generations > 1
        and prompt_cache(trainer.model) is not None
    )
    steps = []
    try:
        for _ in range(args.steps):
            metrics, batch = trainer.train_step()  # what Trainer.run does each step
            prompt_lens = [len(g.prompt_ids) for g in batch]
            response_lens = [[len(r) for r in g.response_ids] for g in batch]
            gen_flops = generation_flops(shape, prompt_lens, response_lens)
            train_flops = training_flops(shape, prompt_lens, response_lens, old_logprobs, shared)
            steps.append(
                {
                    "step": trainer.step,
                    "gen_s": metrics["perf/gen_s"],
                    "train_s": metrics["perf/train_s"],
                    "step_s": metrics["perf/step_s"],
                    "gen_flops": gen_flops,
                    "train_flops": train_flops,
                    "total_flops": gen_flops + train_flops,
                    "prompt_lens": prompt_lens,
                    "response_lens": response_lens,
                    "response_length_mean": metrics.get("response_length/mean", float("nan")),
                    "updates": metrics["actor/updates"],
                    "skipped_updates": metrics["actor/skipped_updates"],
                }
            )
            s = steps[-1]
            print(
                f"step {s['step']}: generate {s['gen_s']:.1f} s, train {s['train_s']:.1f} s, "
                f"step {s['step_s']:.1f} s",
                flush=True,
            )
    finally:
        trainer.close()
    return {
        "shape": shape,
        "params": n_params,
        "old_logprobs": old_logprobs,
        "shared_prompt": shared,
        "steps": steps,
    }


def add_mfu(steps: list[dict[str, Any]], peak_gflops: float) -> dict[str, float]:
    """Per-step MFU (in place) and the medians over the steps after the first."""
    peak = peak_gflops * 1e9
    for s in steps:
        s["mfu_gen"] = s["gen_flops"] / s["gen_s"] / peak
        s["mfu_train"] = s["train_flops"] / s["train_s"] / peak
        s["mfu_total"] = s["total_flops"] / s["step_s"] / peak
    measured = steps[1:] or steps
    keys = (
        "gen_s",
        "train_s",
        "step_s",
        "gen_flops",
        "train_flops",
        "total_flops",
        "mfu_gen",
        "mfu_train",
        "mfu_total",
    )
    summary = {k: statistics.median(s[k] for s in measured) for k in keys}
    summary["steps_measured"] = len(measured)
    return summary


def format_table(steps: list[dict[str, Any]], summary: dict[str, float]) -> str:
    """One row per step and one for the median over the steps after the first."""
    head = [
        "step",
        "gen s",
        "gen GFLOP",
        "gen MFU",
        "train s",
        "train GFLOP",
        "train MFU",
        "step s",
        "GFLOP",
        "MFU",
    ]

    def row(name: str, s: dict[str, Any]) -> list[str]:
        return [
            name,
            f"{s['gen_s']:.2f}",
            _g(s["gen_flops"]),
            f"{s['mfu_gen']:.1%}",
            f"{s['train_s']:.2f}",
            _g(s["train_flops"]),
            f"{s['mfu_train']:.1%}",
            f"{s['step_s']:.2f}",
            _g(s["total_flops"]),
            f"{s['mfu_total']:.1%}",
        ]

    lines = [head] + [row(str(s["step"]), s) for s in steps] + [row("median", summary)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines
    )


def _g(flops: float) -> str:
    """GFLOP with 4 significant digits."""
    return f"{flops / 1e9:.4g}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per rollout step")
    ap.add_argument("--generations", type=int, default=8, help="responses per prompt")
    ap.add_argument("--max-tokens", type=int, default=64, help="response length limit")
    ap.add_argument("--steps", type=int, default=4, help="rollout steps (the first warms up)")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--peak-size", type=int, default=2048, help="square matmul for the peak")
    ap.add_argument("--peak-repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the results")
    args = ap.parse_args(argv)
    if args.max_tokens < 1 or args.steps < 1 or args.prompts < 1 or args.generations < 2:
        ap.error("need --max-tokens >= 1, --steps >= 1, --prompts >= 1, --generations >= 2")

    torch.set_num_threads(args.threads)
    shape_kw = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "intermediate_size": args.intermediate,
        "vocab_size": args.vocab,
    }
    peak_before = matmul_peak(args.peak_size, args.peak_repeats)
    print(f"fp32 matmul peak (before): {peak_before['gflops']:.1f} GFLOP/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-util-") as tmp:
        run = run_steps(args, Path(tmp), shape_kw)
    torch.set_num_threads(args.threads)
    peak_after = matmul_peak(args.peak_size, args.peak_repeats)
    print(f"fp32 matmul peak (after): {peak_after['gflops']:.1f} GFLOP/s", flush=True)
    peak = max(peak_before["gflops"], peak_after["gflops"])
    steps = run["steps"]
    summary = add_mfu(steps, peak)

    shape: Shape = run["shape"]
    print()
    print(
        f"model: {run['params'] / 1e6:.1f}M parameters ({shape.body_params / 1e6:.1f}M "
        f"non-embedding matmul weights), {args.prompts} prompts x {args.generations} "
        f"responses x up to {args.max_tokens} tokens per step, {args.threads} threads"
    )
    print(f"fp32 matmul peak: {peak:.1f} GFLOP/s ({args.peak_size}^3)")
    print(format_table(steps, summary))
    which = f"steps 2-{len(steps)}" if len(steps) > 2 else f"step {len(steps)}"
    print(
        f"MFU (median of {which}): generation {summary['mfu_gen']:.1%}, "
        f"training {summary['mfu_train']:.1%}, whole step {summary['mfu_total']:.1%}; "
        f"{summary['step_s']:.1f} s per step"
    )

    report = {
        **provenance(),
        "settings": {
            k: getattr(args, k)
            for k in (
                "prompts",
                "generations",
                "max_tokens",
                "steps",
                "peak_size",
                "peak_repeats",
                "threads",
                "seed",
            )
        },
        "model": {"params": run["params"], "body_params": shape.body_params, **asdict(shape)},
        "old_logprob_forward": run["old_logprobs"],
        "shared_prompt_forward": run["shared_prompt"],
        "peak": {
            "gflops": peak,
            "size": args.peak_size,
            "before": peak_before,
            "after": peak_after,
        },
        "summary": summary,
        "steps": steps,
    }
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
