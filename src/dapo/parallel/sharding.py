"""FSDP2 (``fully_shard``) sharding of the policy: DDP's memory-saving alternative.

Each rank keeps 1/N of every parameter (a DTensor sharded on dim 0), all-gathers a decoder
layer's parameters just before the layer runs and reduce-scatters its gradient after
backward. Unlike DDP, which communicates once per optimizer step, FSDP issues collectives
in every forward and backward, so the ranks must run the same sequence of passes:

- passes whose count depends on each rank's data and that need no gradient (generation,
  one forward per decoding step; log-prob passes) run inside :func:`full_params`, which
  gathers the parameters once and keeps them whole until it ends;
- training micro-batches are padded to the same count on every rank (``dapo.training.learner``).

FSDP checkpoints are written in shards by every rank (``dapo.training.checkpoint``); the
full (gathered) state dicts here serve the final ``save_pretrained`` export
(:func:`pretrained_state`) and loading a single-process checkpoint into a sharded model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dapo.parallel.distributed import DistInfo, all_reduce_sum

try:  # public since torch 2.6
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - older torch: DDP only
    FSDPModule = None  # type: ignore[assignment,misc]
    MixedPrecisionPolicy = None  # type: ignore[assignment,misc]
    fully_shard = None  # type: ignore[assignment]


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is sharded with ``fully_shard``."""
    return FSDPModule is not None and isinstance(model, FSDPModule)


def _device_type(info: DistInfo) -> str:
    return "cuda" if info.backend == "nccl" else "cpu"


def _mesh(info: DistInfo) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_device_type(info), (info.world_size,))


def fsdp_support(info: DistInfo) -> str | None:
    """None when ``fully_shard`` works in this process group, else why not.

    Shards a two-layer toy module and runs one forward and backward on every rank (the
    answer depends on the torch build and the backend's collectives); the ranks agree on
    the answer, so all of them take the same path.
    """
    reason = None
    if fully_shard is None:
        reason = f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard"
    else:
        try:
            device = torch.device(f"cuda:{info.local_rank}" if info.backend == "nccl" else "cpu")
            toy = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).to(device)
            mesh = _mesh(info)
            fully_shard(toy[0], mesh=mesh)
            fully_shard(toy, mesh=mesh)
            toy(torch.ones(2, 4, device=device)).sum().backward()
            grad = toy[0].weight.grad
            if grad is None or not bool(torch.isfinite(grad.full_tensor()).all()):
                reason = "a test backward through fully_shard gave no finite gradient"
        except Exception as exc:  # any failure means: not on this platform
            reason = f"fully_shard failed on a test module ({type(exc).__name__}: {exc})"
    (failed,) = all_reduce_sum([float(reason is not None)])
    if failed and reason is None:
        reason = "fully_shard failed on another rank"
    return reason


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model, outermost first.

    transformers names them in ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``);
    otherwise the children of the largest ``nn.ModuleList`` (``model.model.layers``).
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(biggest)


def shard_model(
    model: nn.Module, info: DistInfo, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root (embeddings, norm, head), in place.

    The shards (and so the optimizer state) stay in the parameters' dtype. With
    ``param_dtype`` (mixed precision, e.g. bf16) the gathered parameters that forward and
    backward use are cast to it and gradients are reduce-scattered in float32
    (``MixedPrecisionPolicy``). Create the optimizer after this: it must hold the sharded
    parameters.
    """
    if fully_shard is None:  # pragma: no cover
        raise RuntimeError(f"torch {torch.__version__} has no fully_shard")
    mesh = _mesh(info)
    kw: dict[str, Any] = {"mesh": mesh}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in reversed(decoder_layers(model)):  # bottom-up: inner blocks first
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _fsdp_modules(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_params(model: nn.Module) -> Iterator[None]:
    """Inside, ``model`` holds its whole parameters and forwards without collectives.

    For FSDP this is one all-gather per sharded module on entry (every rank must enter) and
    a reshard on exit, so each rank may run any number of forward passes inside, e.g. one
    per decoding step. Nested uses gather once. A no-op for any other module.
    """
    if not is_fsdp(model) or getattr(model, "_dapo_full_params", False):
        yield
        return
    modules = _fsdp_modules(model)
    # Marks which module is the root before anything is unsharded (a forward would do it).
    model._get_fsdp_state()._lazy_init()
    model._dapo_full_params = True
    try:
        for m in modules:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)
        yield
    finally:
        for m in modules:
            # As shard_model leaves them: layers free their parameters after forward, the
            # root keeps them for the backward that follows.
            m.set_reshard_after_forward(m is not model, recurse=False)
            m.reshard()
        model._dapo_full_params = False


def _param_units(model: nn.Module) -> list[tuple[Any, list[str]]]:
    """``model.named_parameters()`` names grouped by the sharded module that gathers them
    (the innermost ``fully_shard`` module around each), outermost module first; one group
    with every name and no module for an unsharded model."""
    names = [n for n, _ in model.named_parameters()]
    if not is_fsdp(model) or getattr(model, "_dapo_full_params", False):
        return [(None, names)]
    prefixes = {m: p for p, m in model.named_modules() if isinstance(m, FSDPModule)}
    units: dict[Any, list[str]] = {m: [] for m in prefixes}
    for name in names:
        owner = max(
            (m for m, p in prefixes.items() if not p or name.startswith(p + ".")),
            key=lambda m: len(prefixes[m]),
        )
        units[owner].append(name)
    return [(m, ns) for m, ns in units.items() if ns]


class FullParameters:
    """A model's parameters as whole tensors under their checkpoint names (those of
    ``named_parameters()``, tied parameters once), for a rollout engine that holds its own
    copy of the weights: iterate over it for ``(name, tensor)`` pairs.

    With FSDP one sharded module (the root's embeddings, norm and head, then each decoder
    layer) is gathered at a time and resharded before the next, so a rank never holds more
    than one module twice; the tensors are copies that outlive the reshard. Iterating is
    then a collective: every rank must consume the whole iterator, in step. Without FSDP the
    tensors are the parameters themselves (DDP: the local module's). :attr:`specs` names
    dtype and full shape of each tensor, in iteration order, before any is gathered.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.units = _param_units(model)
        params = dict(model.named_parameters())
        self.specs = [
            (n, params[n].dtype, tuple(params[n].shape)) for _, names in self.units for n in names
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        model = self.model
        if self.units[0][0] is None:
            params = dict(model.named_parameters())
            for name in self.units[0][1]:
                yield name, params[name].detach()
            return
        model._get_fsdp_state()._lazy_init()
        for module, names in self.units:
            module.unshard()
            try:
                for name in names:
                    yield name, model.get_parameter(name).detach().clone()
            finally:
                module.reshard()


def full_named_parameters(model: nn.Module) -> FullParameters:
    """:class:`FullParameters` of ``model`` (see there: with FSDP, a collective)."""
    return FullParameters(model)


def reshard(model: nn.Module) -> None:
    """Make sure the registered parameters are the shards (before the optimizer changes them).

    The root keeps its gathered parameters after a forward; a backward frees them, but a
    no-grad forward outside :func:`full_params` would leave a stale copy.
    """
    if is_fsdp(model):
        for m in _fsdp_modules(model):
            m.reshard()


def grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (before clipping), clipping to ``max_norm`` if > 0.

    With sharded (DTensor) gradients torch reduces the per-shard norms over the ranks; the
    result is returned as a plain tensor, equal on every rank.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


# --- full (unsharded) state dicts in the single-process format ----------------------------


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in the order of ``optimizer.state_dict()``."""
    name_of = {p: n for n, p in model.named_parameters()}
    return [name_of[p] for g in optimizer.param_groups for p in g["params"]]


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict.

    For FSDP every rank must call it (it gathers); rank 0 gets the tensors on CPU and the
    others an empty dict.
    """
    if not is_fsdp(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def pretrained_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """What ``save_pretrained(state_dict=...)`` should write: None (the model's own state)
    for an unsharded model, else the full tensors (rank 0; every rank must call this).

    Names of one shared (tied) parameter point to one tensor again, as in a plain
    ``state_dict()``, so that transformers stores it once.
    """
    if not is_fsdp(model):
        return None
    weights = full_model_state(model)
    first: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p in first and name in weights and first[p] in weights:
            weights[name] = weights[first[p]]
        first.setdefault(p, name)
    return weights


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with full tensors, keyed by parameter index as usual.

    For FSDP every rank must call it; rank 0 gets the state and the others an empty dict.
    """
    if not is_fsdp(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if not by_name:
        return {}
    index = {n: i for i, n in enumerate(_param_names(model, optimizer))}
    return {
        "state": {index[n]: s for n, s in by_name["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]
        ],
    }


def load_full_model_state(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into the shards of an FSDP model (every rank passes all of them)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, weights, options=_options(strict=False))


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a single-process ``optimizer.state_dict()`` into the optimizer of an FSDP model."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = _param_names(model, optimizer)
    groups = state["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of "
            "optimizer's group"
        )
    by_name = {
        "state": {names[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=_options())
    # Hyperparameters exactly as saved (the helper turns tuples such as betas into lists).
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
