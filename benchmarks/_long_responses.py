"""``bench_memory.py --long-responses``: the memory and time of one update on long responses,
dapo against TRL.

Each record is one optimizer update in a fresh process on ``--long-count`` responses of
``tokens`` tokens after a 64-token prompt (random token ids; the update's cost does not
depend on them), with AdamW, the DAPO loss and the same precision on both sides (bf16-mixed
where the CPU has native bf16, else fp32):

- ``dapo``: :meth:`Learner.optimizer_step` with ``train.packing=true``, the chunked output
  layer (``train.logits_chunk_size``) and activation checkpointing
  (``model.gradient_checkpointing=true``), micro-batches of ``train.micro_batch_tokens``;
- ``trl``: TRL's own loss (``GRPOTrainer.compute_loss``, its per-token log-probs and
  entropies from whole logits) under its autocast, with transformers' gradient checkpointing
  as TRL enables it for long sequences, all responses in one pass, then its optimizer's step.

Peak memory is the process's resident peak over the update (weights and optimizer state
included, :class:`bench_memory.StepMemory`), with glibc's mmap threshold fixed at
:data:`MMAP_THRESHOLD` on both sides: by default it rises after each large free, and blocks
freed by one micro-batch then stay resident as heap (measured: +0.4 to +1 GB of peak at
2,048-4,096 tokens, noise that grows with the number of passes rather than the work). A length whose peak, extrapolated linearly from
the side's two previous lengths, would pass ``--long-limit-mb`` is not run (it would take
the machine's memory) and is recorded as skipped with the prediction. The longest response
that fits ``--long-budget-mb`` is extrapolated from each side's last two measured lengths.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = 64
MMAP_THRESHOLD = 131072  # bytes: glibc's default starting value, kept from rising


def _batch(args: argparse.Namespace, tokens: int, vocab: int) -> tuple[list[int], list[list[int]]]:
    import torch

    gen = torch.Generator().manual_seed(tokens)
    prompt = torch.randint(2, vocab, (PROMPT,), generator=gen).tolist()
    responses = [
        torch.randint(2, vocab, (tokens,), generator=gen).tolist() for _ in range(args.long_count)
    ]
    return prompt, responses


def _precision() -> str:
    import torch

    from dapo.models.precision import cpu_has_native_bf16

    return "bf16-mixed" if torch.cuda.is_available() or cpu_has_native_bf16() else "fp32"


def _measured(probe: Any, step: Callable[[], Any], precision: str) -> tuple[dict[str, Any], Any]:
    """Run one update ``step`` between the memory probe's start and stop: the record of its
    memory before, its peak and its seconds, and what the step returned."""
    before = probe.start()
    start = time.perf_counter()
    out = step()
    seconds = time.perf_counter() - start
    peak = probe.stop()
    return {"before_mb": before, "peak_mb": peak, "seconds": seconds, "precision": precision}, out


def worker_dapo(args: argparse.Namespace, model_dir: Path, probe: Any) -> dict[str, Any]:
    from dapo.config import load_config
    from dapo.training.batch import Sample
    from dapo.training.learner import Learner

    precision = _precision()
    cfg = load_config(
        overrides=[
            f"model.name_or_path={model_dir}",
            "preset=dapo",
            f"train.precision={precision}",
            "train.packing=true",
            "model.gradient_checkpointing=true",
            f"train.micro_batch_tokens={args.long_micro_batch_tokens}",
            f"train.logits_chunk_size={args.long_logits_chunk}",
            f"rollout.max_completion_length={args.tokens}",
            f"data.max_prompt_length={PROMPT}",
        ]
    )
    lines: list[str] = []
    learner = Learner.from_config(cfg, str(model_dir), 0, lines.append)
    prompt, responses = _batch(args, args.tokens, args.vocab)
    samples = [
        Sample(prompt, r, 1.0 if i % 2 else -1.0, [1.0] * len(r)) for i, r in enumerate(responses)
    ]
    record, result = _measured(probe, lambda: learner.optimizer_step(samples), precision)
    return {**record, "grad_norm": result.grad_norm}


def worker_trl(args: argparse.Namespace, model_dir: Path, probe: Any, tmp: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from dapo.models import load_tokenizer

    precision = _precision()
    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = GRPOConfig(
        output_dir=str(tmp / "trl"),
        use_cpu=not torch.cuda.is_available(),
        bf16=precision == "bf16-mixed",
        gradient_checkpointing=True,
        per_device_train_batch_size=args.long_count,
        num_generations=args.long_count,
        max_completion_length=args.tokens,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        learning_rate=1e-6,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * args.long_count}),
        processing_class=tokenizer,
    )
    # What Trainer.train sets up before its first step: checkpointing, train mode, optimizer.
    model.gradient_checkpointing_enable(config.gradient_checkpointing_kwargs or None)
    model.config.use_cache = False
    model.train()
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    prompt, responses = _batch(args, args.tokens, args.vocab)
    completion = torch.tensor(responses)
    inputs = {
        "prompt_ids": torch.tensor([prompt] * args.long_count),
        "prompt_mask": torch.ones(args.long_count, PROMPT, dtype=torch.long),
        "completion_ids": completion,
        "completion_mask": torch.ones_like(completion),
        "advantages": torch.tensor([(-1.0) ** (i + 1) for i in range(args.long_count)]),
        "num_items_in_batch": torch.tensor(float(completion.numel())),
    }

    def step() -> None:
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    return _measured(probe, step, precision)[0]


def last_line(points: list[tuple[int, float]]) -> tuple[int, float, float] | None:
    """The line through the last two ``(tokens, peak_mb)`` points: ``(tokens, peak_mb,
    slope)`` of the last one and the MB per token (None with fewer than two points)."""
    if len(points) < 2:
        return None
    (t1, m1), (t2, m2) = points[-2:]
    return t2, m2, (m2 - m1) / (t2 - t1)


def predicted_peak(points: list[tuple[int, float]], tokens: int) -> float | None:
    """The peak at ``tokens`` on :func:`last_line` (None with fewer than two points)."""
    line = last_line(points)
    return None if line is None else line[1] + line[2] * (tokens - line[0])


def longest_fit(points: list[tuple[int, float]], budget_mb: float) -> float | None:
    """The response length whose peak reaches ``budget_mb`` on :func:`last_line` (None with
    fewer than two points, or a line that does not grow)."""
    line = last_line(points)
    if line is None or line[2] <= 0:
        return None
    return line[0] + (budget_mb - line[1]) / line[2]


def measured(records: list[dict[str, Any]], side: str) -> list[tuple[int, float]]:
    """``(tokens, peak_mb)`` of ``side``'s measured (not skipped) records, in order."""
    return [
        (r["tokens"], r["peak_mb"])
        for r in records
        if r["side"] == side and r["peak_mb"] is not None
    ]


def summarise(records: list[dict[str, Any]], budget_mb: float) -> dict[str, Any]:
    """Per side: the measured points, MB per 1,000 tokens between successive lengths, the
    extrapolated longest fit; and the ratios the targets are stated in."""
    out: dict[str, Any] = {}
    for side in ("dapo", "trl"):
        points = measured(records, side)
        marginal = [
            1000 * (m2 - m1) / (t2 - t1)
            for (t1, m1), (t2, m2) in zip(points, points[1:], strict=False)
        ]
        out[side] = {"mb_per_1k_tokens": marginal, "longest_fit": longest_fit(points, budget_mb)}
    peak = {(r["side"], r["tokens"]): r["peak_mb"] for r in records if r.get("peak_mb") is not None}
    if ("dapo", 4096) in peak and ("trl", 4096) in peak:
        out["peak_4096_over_trl"] = peak[("dapo", 4096)] / peak[("trl", 4096)]
    if out["dapo"]["longest_fit"] and out["trl"]["longest_fit"]:
        out["longest_fit_over_trl"] = out["dapo"]["longest_fit"] / out["trl"]["longest_fit"]
    return out
