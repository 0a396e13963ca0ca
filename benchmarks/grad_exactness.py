"""The gradient of one optimizer step on one process and on N ranks, parameter by parameter.

dapo divides the loss of every rank and micro-batch by the loss-token count of the whole
mini-batch, all-reduced over the ranks, so the gradient should not depend on the number of
ranks. This checks it from outside: one fixed mini-batch (the built-in model's architecture
at seed 3; responses of 1 to 60 tokens, two of them masked as truncated, groups sharing a
prompt; old log-probs that make the clip bounds act) goes through dapo's own update,
``Learner.optimizer_step``, once in this process and once on N gloo ranks forked from it
with torchrun's environment (``init_distributed``, the model wrapped by
``wrap_data_parallel`` as ``train.data_parallel`` wraps it, each rank training its
token-balanced share in micro-batches of ``--micro-batch-tokens``). It prints each
parameter's largest absolute difference and its relative one (over the parameter's largest
gradient entry), and PASS or FAIL against the tolerance. Exit status: 0 PASS, 1 FAIL, 2 a
rank failed.

``--normalisation per-rank`` makes the ranks commit the usual mistake instead: each divides
by its own loss-token count (a per-rank mean, which DDP's gradient average then averages),
and the check fails unless the ranks happen to hold equal counts.

    python benchmarks/grad_exactness.py [--ranks 2] [--data-parallel ddp|fsdp]
        [--loss-agg token-mean|seq-mean-token-mean|seq-mean-token-sum-norm]
        [--dtype float64|float32] [--tolerance REL] [--micro-batch-tokens 70]
        [--normalisation global|per-rank]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dapo.choices import LOSS_AGG_MODES
from dapo.training.batch import Sample

# Relative tolerance by dtype. The same sums in another order (other micro-batches, a
# gradient all-reduce) round differently: ~1e-16 of the largest term in float64, ~1e-7 in
# float32. The output layer's softmax and its weight's gradient are float32 in every dtype
# (dapo.models.chunked_logprobs), so float64 is held to float32's rounding where the tied
# embedding is concerned: measured 2-4e-8 there, 5e-7 in float32 (q_proj). A mistake in the
# normalisation moves gradients by a share of the batch's tokens, 1e-3 or more.
TOLERANCE = {"float64": 1e-6, "float32": 1e-5}
RANK_TIMEOUT_S = 300.0
FAILED_GRACE_S = 10.0  # how long the other ranks may still take once one failed


def fixed_batch(dtype: torch.dtype) -> list[Sample]:
    """One mini-batch of responses of very different lengths (1 to 60 tokens), two masked as
    truncated (no loss tokens), some in groups that share a prompt, with old log-probs."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(1)
    singles = [(5, 40), (12, 1), (3, 17), (9, 60), (7, 2), (4, 33), (6, 25), (8, 9)]
    groups = [(10, [1, 30, 52, 30]), (4, [22, 5, 14])]  # (prompt length, response lengths)
    samples: list[Sample] = []
    for prompt_len, lengths in [(p, [r]) for p, r in singles] + groups:
        prompt = [7, 8] + [rng.randrange(3, 99) for _ in range(prompt_len)]
        for n in range(len(lengths)):
            response = [rng.randrange(3, 99) for _ in range(lengths[n])]
            mask = [0.0 if len(samples) in (3, 6) else 1.0] * lengths[n]
            s = Sample(prompt, response, rng.choice([-1.3, -0.4, 0.7, 1.1]), mask)
            s.old_logprobs = -4.6 + 0.5 * torch.randn(lengths[n], generator=gen, dtype=dtype)
            samples.append(s)
    return samples


def build_model(dtype: torch.dtype) -> torch.nn.Module:
    """The built-in model's architecture (~1M parameters) at seed 3, untrained."""
    from dapo.models.tiny import build_model as tiny
    from dapo.models.tiny import build_tokenizer

    return tiny(len(build_tokenizer()), seed=3).to(dtype).train()


class GradientRecorder:
    """Stands in for the optimizer: keeps the gradient the step would apply, by parameter
    name (gathered whole when FSDP shards it), and changes no weight."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.named = list(model.named_parameters())  # after wrapping: FSDP's DTensors
        self.param_groups: list[dict] = []
        self.grads: dict[str, torch.Tensor] = {}

    def step(self) -> None:
        for name, p in self.named:
            if p.grad is not None:
                full = getattr(p.grad, "full_tensor", None)  # every rank calls step()
                self.grads[name] = (full() if full is not None else p.grad).detach().clone()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.named:
            p.grad = None


@contextlib.contextmanager
def per_rank_denominator(world_size: int) -> Iterator[None]:
    """Each rank's loss divided by its own loss-token count (times the world size, which
    the learner's scaling by it cancels): a mean per rank, averaged over the ranks by DDP.
    The denominator the learner all-reduces is replaced where the loss receives it."""
    from dapo import algorithms
    from dapo.training import learner

    count, loss = learner.loss_denominator, algorithms.compute_loss
    local: list[float] = [0.0]

    def counting(samples: Any, settings: Any) -> float:
        local[0] = count(samples, settings)
        return local[0]

    def per_rank(*args: Any, denominator: Any = None, **kwargs: Any) -> Any:
        return loss(*args, denominator=local[0] * world_size, **kwargs)

    learner.loss_denominator, algorithms.compute_loss = counting, per_rank
    try:
        yield
    finally:
        learner.loss_denominator, algorithms.compute_loss = count, loss


@dataclass(frozen=True)
class Setup:
    """What both sides run: the settings given on the command line."""

    ranks: int
    data_parallel: str
    loss_agg: str
    dtype: str
    micro_batch_tokens: int
    normalisation: str


def loss_settings(setup: Setup) -> Any:
    """The loss of the step: DAPO's defaults with ``--loss-agg`` (L_max 64 for the sum norm)."""
    from dapo.algorithms import LossSettings

    return LossSettings(loss_agg=setup.loss_agg, max_len=64)  # type: ignore[arg-type]


def one_step(
    setup: Setup, ddp: Any = None, model: torch.nn.Module | None = None
) -> tuple[dict[str, torch.Tensor], float]:
    """One ``Learner.optimizer_step`` on the fixed batch: the gradient by parameter name and
    the gradient norm (no clipping)."""
    from dapo.config import TrainConfig
    from dapo.training.forward import ForwardOptions
    from dapo.training.learner import Learner

    dtype = getattr(torch, setup.dtype)
    model = model if model is not None else build_model(dtype)
    recorder = GradientRecorder(model)
    learner = Learner(
        model,
        recorder,  # type: ignore[arg-type]
        loss_settings(setup),
        ForwardOptions(pad_id=0, token_budget=setup.micro_batch_tokens),
        train=TrainConfig(max_grad_norm=0.0),
        ddp=ddp,
    )
    result = learner.optimizer_step(fixed_batch(dtype))
    if not result.applied:
        raise RuntimeError(f"the step was not applied (gradient norm {result.grad_norm})")
    return recorder.grads, result.grad_norm


def _rank(rank: int, setup: Setup, port_pipe: Any, out: Path) -> None:
    """One forked rank: join the group as torchrun's ranks do, wrap the model as a run
    does, take the step; rank 0 saves the gradient and the ranks' shares to ``out``."""
    torch.set_num_threads(1)
    port = port_pipe.recv()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(setup.ranks),
        LOCAL_WORLD_SIZE=str(setup.ranks),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # The store is this script's (as torchrun's agent hosts it): join it as a client.
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        CUDA_VISIBLE_DEVICES="",  # gloo on the CPU, also on a machine with one GPU
    )
    from dapo.models.data_parallel import wrap_data_parallel
    from dapo.parallel import distributed as D
    from dapo.training.microbatch import loss_denominator

    info = D.init_distributed()
    model = build_model(getattr(torch, setup.dtype))
    _, ddp = wrap_data_parallel(model, info, setup.data_parallel, lambda _: None)
    wrong = setup.normalisation == "per-rank"
    with per_rank_denominator(info.world_size) if wrong else contextlib.nullcontext():
        grads, norm = one_step(setup, ddp, model)
    batch = fixed_batch(getattr(torch, setup.dtype))
    share = [batch[i] for i in D.token_share([s.length for s in batch], info)]
    shares = D.all_gather_objects((len(share), loss_denominator(share, loss_settings(setup))))
    if info.is_main:
        torch.save({"grads": grads, "grad_norm": norm, "shares": shares}, out)
    D.destroy()


def on_ranks(setup: Setup, out: Path) -> None:
    """Fork the ranks, host their store (after the fork: a forked copy of its server thread
    would not run), and wait for them; a failed rank raises."""
    import torch.distributed as dist

    ctx = multiprocessing.get_context("fork")  # the ranks start with this process's imports
    pipes, procs = [], []
    for rank in range(setup.ranks):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_rank, args=(rank, setup, theirs, out), daemon=True)
        proc.start()
        pipes.append(mine)
        procs.append(proc)
    store = dist.TCPStore("127.0.0.1", 0, setup.ranks, is_master=True, wait_for_workers=False)
    for pipe in pipes:
        pipe.send(store.port)
    # As torchrun does: once a rank fails, its peers (blocked in a collective) are stopped.
    deadline = time.monotonic() + RANK_TIMEOUT_S
    running = list(procs)
    while running and time.monotonic() < deadline:
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=1.0)
        running = [p for p in running if p.exitcode is None]
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
    for proc in running:
        proc.kill()
        proc.join()
    codes = [proc.exitcode for proc in procs]
    del store
    if any(code != 0 for code in codes):
        raise RuntimeError(f"a rank failed or timed out (exit codes {codes}); see its output above")


@dataclass(frozen=True)
class Difference:
    """One parameter's gradient on N ranks against one process."""

    name: str
    abs_diff: float  # max |g_N - g_1|
    scale: float  # max |g_1|
    relative: float  # abs_diff / scale (abs_diff where the gradient is all zero)


def differences(
    single: dict[str, torch.Tensor], ranks: dict[str, torch.Tensor]
) -> list[Difference]:
    """Every parameter's :class:`Difference`, in the model's order."""
    if set(single) != set(ranks):
        raise RuntimeError(f"different parameters: {sorted(set(single) ^ set(ranks))}")
    out = []
    for name, g1 in single.items():
        diff = float((ranks[name].to(g1) - g1).abs().max())
        scale = float(g1.abs().max())
        out.append(Difference(name, diff, scale, diff / scale if scale > 0 else diff))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (default 2)")
    parser.add_argument("--data-parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--loss-agg", choices=LOSS_AGG_MODES, default="token-mean")
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float64")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest relative difference that passes (default 1e-9 in float64, 1e-4 in float32)",
    )
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=70,
        help="train.micro_batch_tokens: several micro-batches per rank (default 70)",
    )
    parser.add_argument(
        "--normalisation",
        choices=["global", "per-rank"],
        default="global",
        help="global: dapo's (the all-reduced count); per-rank: the mistake, which must fail",
    )
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error("--ranks must be >= 2")
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[args.dtype]
    setup = Setup(
        args.ranks,
        args.data_parallel,
        args.loss_agg,
        args.dtype,
        args.micro_batch_tokens,
        args.normalisation,
    )
    batch = fixed_batch(torch.float64)
    tokens = sum(sum(s.loss_mask) for s in batch)
    lengths = [len(s.response_ids) for s in batch]
    print(
        f"one mini-batch: {len(batch)} responses of {min(lengths)}-{max(lengths)} tokens "
        f"({sum(1 for s in batch if not any(s.loss_mask))} masked), {tokens:.0f} loss tokens; "
        f"the built-in model's architecture at seed 3 in {args.dtype}; loss {args.loss_agg}, "
        f"micro-batches of {args.micro_batch_tokens} tokens"
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.pt"
        try:
            on_ranks(setup, out)
        except RuntimeError as exc:
            print(f"grad_exactness: {exc}", file=sys.stderr)
            return 2
        multi = torch.load(out)
    torch.set_num_threads(1)
    single, single_norm = one_step(setup)
    for rank, (n, count) in enumerate(multi["shares"]):
        print(f"rank {rank}: {n} responses, loss denominator {count:g}")
    rows = differences(single, multi["grads"])
    width = max(len(r.name) for r in rows)
    print(f"\n{'parameter':<{width}}  max |diff|  max |grad|  relative")
    for r in rows:
        print(f"{r.name:<{width}}  {r.abs_diff:10.2e}  {r.scale:10.2e}  {r.relative:8.2e}")
    worst_abs = max(rows, key=lambda r: r.abs_diff)
    worst_rel = max(rows, key=lambda r: r.relative)
    print(
        f"\n1 process vs {args.ranks} ranks ({args.data_parallel}, gloo), normalisation "
        f"{args.normalisation}: gradient norm {single_norm:.6g} vs {multi['grad_norm']:.6g}"
    )
    print(f"largest absolute difference: {worst_abs.abs_diff:.2e} ({worst_abs.name})")
    print(f"largest relative difference: {worst_rel.relative:.2e} ({worst_rel.name})")
    passed = worst_rel.relative <= tolerance
    print(f"tolerance (relative): {tolerance:.0e}: {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
