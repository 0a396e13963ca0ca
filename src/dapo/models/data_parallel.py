"""Choose and apply the data-parallel wrapping of the policy: FSDP2 sharding or DDP.

It lives with the policy rather than in :mod:`dapo.parallel` because the choice reads the
policy's precision (FSDP2 then gathers bf16 parameters); ``dapo.parallel`` is the layer below,
the torch.distributed machinery that knows nothing of dapo's models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dapo.errors import TrainingError
from dapo.models.precision import mixed_precision_dtype
from dapo.models.vision import images_in_forward, is_vision_config
from dapo.parallel import sharding
from dapo.parallel.distributed import DistInfo


def wrap_data_parallel(
    model: torch.nn.Module, info: DistInfo, requested: str, log: Callable[[str], None]
) -> tuple[str, torch.nn.Module | None]:
    """Shard ``model`` in place with FSDP2, or wrap it with DDP: ``(kind, ddp_module)``.

    ``requested`` is ``train.data_parallel`` (auto, fsdp or ddp). Call it before the
    optimizer is created: with FSDP the optimizer must hold the sharded parameters.
    """
    where = f"{info.world_size} ranks, {info.backend}"
    choice = requested
    if choice == "auto" and not torch.cuda.is_available():
        # FSDP2 works on CPU (train.data_parallel=fsdp), but its per-layer collectives
        # made a step ~1.4x slower than DDP here: sharding pays off on accelerators.
        choice = "ddp"
    why_not = None if choice == "ddp" else sharding.fsdp_support(info)
    if choice != "ddp" and why_not is None:
        mixed = mixed_precision_dtype(model)
        if is_vision_config(getattr(model, "config", None)):
            images_in_forward(model)  # its embeddings are whole only inside its forward
        sharding.shard_model(model, info, param_dtype=mixed)
        mp = "; bf16 parameters in forward/backward, fp32 gradient reduction" if mixed else ""
        log(f"data parallel: fsdp (FSDP2 fully_shard, parameters sharded{mp}; {where})")
        return "fsdp", None
    if choice == "fsdp":
        raise TrainingError(
            f"`train.data_parallel` = 'fsdp', but FSDP2 sharding does not work on this "
            f"platform: {why_not}. Use train.data_parallel=ddp (or auto)"
        )
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    because = f"; fsdp does not work here: {why_not}" if why_not else ""
    if requested == "auto" and not torch.cuda.is_available():
        because = "; auto uses fsdp on GPUs only, set train.data_parallel=fsdp to shard"
    log(f"data parallel: ddp (parameters replicated; {where}{because})")
    return "ddp", ddp
