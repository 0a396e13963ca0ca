"""The update of a rollout step with long-tailed response lengths, packed against unpacked.

DAPO's responses are mostly short with a few at the length limit. Unpacked (``train.packing=
false``), micro-batches are cut by padded tokens, each prompt is forwarded once and its
responses on top of it in groups of similar width (``dapo.training.forward.length_buckets``),
each group padded to its longest. Packed (``train.packing=true``), each micro-batch is one row
without padding (``dapo.training.packed``). A third side, ``padded``, forwards every sample
as prompt + response padded to its micro-batch's longest, as FSDP ranks and models without a
prompt cache do (``train.shared_prompt_forward=false``). All are exact: the benchmark checks that their
log-probs agree before timing.

The model is a random Llama (default hidden 512, 8 layers, vocabulary 32,000); ``--prompts``
prompts x ``--n`` responses, a ``--long-fraction`` of them ``--max-len`` tokens long and the
rest uniform in [``--min-len``, ``--short-len``]. One optimizer update (the whole rollout step,
gradients accumulated over micro-batches of ``--micro-batch-tokens``) is timed ``--repeats``
times per side, alternating, in this one process; the JSON's ``speedup`` is the median
padded time over the median packed time, ``speedup_vs_bucketed`` the bucketed one's.

    python benchmarks/bench_packing.py [--repeats 3] [--json benchmarks/results/packing.json]

On CUDA (bf16) the packed side attends through ``varlen_attn``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch
from _models import random_llama  # benchmarks/_models.py
from _report import provenance, write_report  # benchmarks/_report.py

from dapo.config import load_config
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs, length_buckets
from dapo.training.learner import Learner
from dapo.training.microbatch import collate, micro_batches
from dapo.training.packed import pack


def lengths(args: argparse.Namespace) -> list[int]:
    """The responses' lengths: ``long_fraction`` at ``max_len``, the rest short (seeded)."""
    gen = torch.Generator().manual_seed(args.seed)
    n = args.prompts * args.n
    long = set(torch.randperm(n, generator=gen)[: round(n * args.long_fraction)].tolist())
    short = torch.randint(args.min_len, args.short_len + 1, (n,), generator=gen).tolist()
    return [args.max_len if i in long else short[i] for i in range(n)]


def make_samples(args: argparse.Namespace, vocab: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    out = []
    for i, length in enumerate(lengths(args)):
        if i % args.n == 0:
            prompt = torch.randint(2, vocab, (args.prompt_len,), generator=gen).tolist()
        response = torch.randint(2, vocab, (length,), generator=gen).tolist()
        advantage = float(torch.randn(1, generator=gen))
        out.append(Sample(prompt, response, advantage, [1.0] * length))
    return out


def padded_tokens(samples: list[Sample], options: ForwardOptions) -> int:
    """Positions a side forwards (padding included) for the update's inputs."""
    total = 0
    for idx in micro_batches(samples, options.token_budget, packed=options.packed):
        group = [samples[i] for i in idx]
        if options.packed:
            total += pack(collate(group, options.pad_id), shared_prompt=True).input_ids.shape[1]
        elif not options.shared_prompt:  # prompt + response, all at the longest
            total += len(group) * max(s.length for s in group)
        else:  # each distinct prompt once, responses in buckets of similar width
            widths = [len(s.response_ids) for s in group]
            total += sum(len(p) for p in {tuple(s.prompt_ids) for s in group})
            total += sum(len(b) * max(widths[i] for i in b) for b in length_buckets(widths))
    return total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--short-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--long-fraction", type=float, default=0.125)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="benchmarks/results/packing.json")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    model = random_llama(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt_len + args.max_len + 8,
    )
    cfg = load_config(
        None,
        overrides=[
            "model.name_or_path=benchmark",
            f"train.precision={args.precision}",
            f"train.micro_batch_tokens={args.micro_batch_tokens}",
            "train.packing=true",
            f"train.prompts_per_step={args.prompts}",
            f"train.mini_batch_size={args.prompts}",
            f"rollout.num_generations={args.n}",
            f"rollout.max_completion_length={args.max_len}",
            f"data.max_prompt_length={args.prompt_len}",
        ],
    )
    lines: list[str] = []
    learner = Learner.from_config(cfg, "benchmark", 0, lines.append, model=model)
    samples = make_samples(args, args.vocab)
    base = learner.forward
    sides = {
        "padded": dataclasses.replace(base, packed=False, shared_prompt=False),
        "bucketed": dataclasses.replace(base, packed=False),
        "packed": dataclasses.replace(base, packed=True),
    }

    # Both sides exact: the same log-probs before any update.
    logprobs = {}
    for side, options in sides.items():
        learner.forward = options
        logprobs[side] = torch.cat(compute_logprobs(learner.model, samples, options))
    gap = max(float((logprobs["packed"] - logprobs[s]).abs().max()) for s in sides)

    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side, options in sides.items():
            learner.forward = options
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            learner.optimizer_step(samples)
            if cuda:
                torch.cuda.synchronize()
            times[side].append(time.perf_counter() - start)
    med = {side: statistics.median(t) for side, t in times.items()}
    tokens = sum(s.length for s in samples)
    report = {
        **provenance(),
        "settings": {**vars(args), "precision_line": lines[0] if lines else None},
        "response_lengths": [len(s.response_ids) for s in samples],
        "tokens": tokens,
        "logprob_gap": gap,
        "times_s": times,
        "median_s": med,
        "speedup": med["padded"] / med["packed"],
        "speedup_vs_bucketed": med["bucketed"] / med["packed"],
        "padded_tokens": {side: padded_tokens(samples, sides[side]) for side in sides},
    }
    print(
        f"\n{len(samples)} responses ({args.prompts} prompts x {args.n}), {tokens} tokens; "
        f"{sum(1 for s in samples if len(s.response_ids) == args.max_len)} at the limit of "
        f"{args.max_len}; packed-vs-unpacked log-prob gap {gap:.1e}"
    )
    print("| side | positions forwarded | update, s (median) | runs |")
    print("|---|---|---|---|")
    for side, t in times.items():
        runs = ", ".join(f"{x:.2f}" for x in t)
        print(f"| {side} | {report['padded_tokens'][side]} | {med[side]:.2f} | {runs} |")
    print(
        f"speed-up of packed: {report['speedup']:.2f}x over padded, "
        f"{report['speedup_vs_bucketed']:.2f}x over bucketed"
    )
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
