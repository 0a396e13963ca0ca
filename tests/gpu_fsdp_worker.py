"""FSDP2 at world size 1 over NCCL, on one GPU (``tests/test_gpu.py`` runs this in a process of
its own: a process group is process-wide).

dapo treats one process as not distributed (``WORLD_SIZE=1`` makes no process group), so a
one-GPU machine never runs its FSDP2 code in training. Here the pieces are driven directly,
in a process group of one rank (``cpu:gloo,cuda:nccl``, as ``init_distributed`` makes):

1. ``wrap_data_parallel(..., "fsdp")`` shards the bf16-mixed policy (``MixedPrecisionPolicy``:
   bf16 parameters in forward and backward, float32 gradient reduction over NCCL); the
   gradient of one optimizer step is compared with the float32 model's;
2. two optimizer steps with torch's fused AdamW on the sharded (DTensor) parameters;
3. a ``torch.distributed.checkpoint`` checkpoint (``model_optim/``) by
   ``save_checkpoint``'s sharded path (``dapo.training.checkpoint`` takes it when the
   group is "enabled"; here it is told so, as one rank is), then resumed into a fresh
   sharded model and optimizer: the same weights and AdamW moments, and the same next step.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=P RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 \\
        python tests/gpu_fsdp_worker.py OUT_DIR [cpu]     # writes OUT_DIR/result.json

With ``cpu`` the same runs on gloo and the CPU (the tier's CPU stand-in of this script).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_support import relative_error, samples  # tests/ (this script's directory)
from learner_utils import learner

from dapo.algorithms import LossSettings
from dapo.config import TrainConfig
from dapo.models.data_parallel import wrap_data_parallel
from dapo.models.precision import set_precision
from dapo.models.tiny import build_model
from dapo.parallel import distributed as D
from dapo.parallel.sharding import is_fsdp
from dapo.training import checkpoint
from dapo.training.forward import compute_logprobs
from dapo.training.optim import make_optimizer


@dataclass(frozen=True)
class OneRankGroup(D.DistInfo):
    """A process group of one rank that the checkpoint code treats as data-parallel."""

    @property
    def enabled(self) -> bool:
        return True


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (or the tensor), on the CPU."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()


def policy(seed: int, info: D.DistInfo, log: list[str]) -> torch.nn.Module:
    model = set_precision(build_model(99, seed=seed), "bf16-mixed").to(DEVICE).train()
    kind, _ = wrap_data_parallel(model, info, "fsdp", log.append)
    assert kind == "fsdp" and is_fsdp(model), log
    return model


def main(out: Path) -> None:
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    info = D.current()
    assert (info.world_size, info.backend) == (1, "nccl" if cuda else "gloo"), info
    result: dict = {"log": []}
    settings = LossSettings()
    train = TrainConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)

    # 1. One step's gradient: sharded bf16-mixed against the plain float32 model.
    reference = build_model(99, seed=3).to(DEVICE).train()
    model = policy(3, info, result["log"])
    batch = samples(seed=1)
    for m in (reference, model):
        learner(m, settings, token_budget=400, shared_prompt=False).optimizer_step(batch)
    want = {n: full(p.grad) for n, p in reference.named_parameters() if p.grad is not None}
    got = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    result["grad_rel_error"] = relative_error(got, want)
    result["grad_dtypes"] = sorted({str(g.dtype) for g in got.values()})
    model.zero_grad(set_to_none=True)

    # 2. Two optimizer steps (fused AdamW over DTensors).
    opt = make_optimizer(model, train)
    result["fused"] = all(group["fused"] for group in opt.param_groups)
    trainer = learner(
        model, settings, token_budget=400, shared_prompt=False, optimizer=opt, max_grad_norm=1.0
    )
    result["steps"] = []
    for step in range(2):
        r = trainer.optimizer_step(samples(seed=10 + step))
        result["steps"].append(
            {"applied": r.applied, "grad_norm": r.grad_norm, "loss": r.stats.parts["loss"]}
        )
    old = compute_logprobs(model, samples(seed=20), trainer.forward)
    result["logprobs_finite"] = all(bool(torch.isfinite(x).all()) for x in old)

    # 3. The sharded checkpoint, then a fresh sharded model and optimizer resumed from it.
    checkpoint.current = lambda: OneRankGroup(0, 1, 0, info.backend)  # see the docstring
    path = checkpoint.save_checkpoint(out / "checkpoints", 2, model, opt, {"step": 2})
    result["checkpoint_files"] = sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()
    )
    resumed = policy(4, info, result["log"])
    opt2 = make_optimizer(resumed, train)
    state = checkpoint.load_checkpoint(path, resumed, opt2)
    result["resumed_step"] = state["step"]
    params = dict(model.named_parameters())
    result["weights_equal"] = all(
        torch.equal(full(p), full(params[n])) for n, p in resumed.named_parameters()
    )
    moments = 0.0
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            moments = max(
                moments, float((full(opt.state[p][key]) - full(opt2.state[q][key])).abs().max())
            )
    result["moments_max_diff"] = moments
    # The next step from either: the same weights.
    batch = samples(seed=30)
    trainer2 = learner(
        resumed, settings, token_budget=400, shared_prompt=False, optimizer=opt2, max_grad_norm=1.0
    )
    for t in (trainer, trainer2):
        assert t.optimizer_step(batch).applied
    params = dict(model.named_parameters())
    result["next_step_max_diff"] = max(
        float((full(p) - full(params[n])).abs().max()) for n, p in resumed.named_parameters()
    )
    result["finite"] = all(math.isfinite(s["loss"]) for s in result["steps"])
    (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


DEVICE = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cuda")

if __name__ == "__main__":
    main(Path(sys.argv[1]))
