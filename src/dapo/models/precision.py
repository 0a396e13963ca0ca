"""Numeric precision of the policy (``train.precision``): what is stored, what is computed.

| precision | weights, gradients, AdamW state | forward and backward |
|---|---|---|
| ``fp32`` | float32 (16 bytes per parameter) | float32 |
| ``bf16-mixed`` | float32 (16 bytes per parameter) | bfloat16: ``torch.autocast`` on one process and DDP; FSDP2 gathers bf16 copies of the parameters and reduces gradients in float32 (``MixedPrecisionPolicy``) |
| ``bf16`` | bfloat16 (~8 bytes per parameter) | bfloat16 |

The policy module carries its precision (:func:`set_precision`), so every pass that runs it
(training micro-batches, old and reference log-probs, generation) enters the same
:func:`autocast` without an extra argument. Log-probs, ratios, the loss and the entropy are
float32 in every mode (``dapo.models.chunked_logprobs``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from dapo.models.chunked_logprobs import Float32Linear
from dapo.models.head import head_replaced, output_head
from dapo.models.inputs import device_of
from dapo.parallel.sharding import is_fsdp

_ATTR = "_dapo_precision"
RESOLVED = ("fp32", "bf16-mixed", "bf16")


def resolve_precision(requested: str, cuda: bool) -> str:
    """``train.precision`` with ``auto`` resolved: ``bf16-mixed`` on CUDA, else ``fp32``."""
    if requested == "auto":
        return "bf16-mixed" if cuda else "fp32"
    if requested not in RESOLVED:
        raise ValueError(f"unknown precision {requested!r}; choose one of {('auto', *RESOLVED)}")
    return requested


def load_dtype(precision: str) -> str:
    """The dtype (name) the weights are loaded and kept in."""
    return "bfloat16" if precision == "bf16" else "float32"


def set_precision(model: nn.Module, precision: str) -> nn.Module:
    """Mark ``model`` with its precision (and cast it to bfloat16 for ``bf16``), in place."""
    if precision == "bf16":
        model.to(torch.bfloat16)
    setattr(model, _ATTR, precision)
    return model


def precision_of(model: nn.Module) -> str:
    """The precision :func:`set_precision` gave ``model`` or the module a DDP wrapper holds
    (``fp32`` when none)."""
    inner = getattr(model, "module", None)
    return getattr(model, _ATTR, None) or getattr(inner, _ATTR, None) or "fp32"


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ``model``'s matrix products run in: bfloat16 under ``bf16-mixed`` and
    ``bf16``, else the dtype of its weights."""
    if precision_of(model) in ("bf16-mixed", "bf16"):
        return torch.bfloat16
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def mixed_precision_dtype(model: nn.Module) -> torch.dtype | None:
    """bfloat16 when ``model`` keeps float32 weights but computes in bf16, else None."""
    return torch.bfloat16 if precision_of(model) == "bf16-mixed" else None


@contextlib.contextmanager
def autocast(model: nn.Module) -> Iterator[None]:
    """bf16 autocast around ``model``'s forward passes under ``bf16-mixed``; a no-op otherwise,
    and for an FSDP2 model, whose ``MixedPrecisionPolicy`` casts the parameters itself."""
    dtype = mixed_precision_dtype(model)
    if dtype is None or is_fsdp(model):
        yield
        return
    with torch.autocast(device_of(model).type, dtype=dtype):
        yield


@contextlib.contextmanager
def float32_logits(model: nn.Module) -> Iterator[None]:
    """Inside, a bf16 ``model``'s output layer returns float32 logits: bf16 inputs, products
    summed in float32 (:class:`~dapo.models.chunked_logprobs.Float32Linear`), as the training log-probs are
    computed, instead of logits rounded to bf16. A no-op in fp32 and for heads that are not
    a plain linear layer."""
    head = output_head(model)
    dtype = compute_dtype(model)
    if head is None or dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    with head_replaced(head, Float32Linear(head.weight.detach(), head.bias, dtype)):
        yield


def bf16_rounding_warning(lr: float) -> str:
    """The start-up warning of ``train.precision=bf16``, with the learning rate's cost."""
    return (
        "warning: train.precision=bf16 keeps the weights and AdamW state in bfloat16 (8 "
        "significant bits): an update smaller than ~1/512-1/256 of a weight rounds away. "
        f"At train.lr={lr:g} (an AdamW step moves a weight by about lr) weights larger than "
        f"~{256 * lr:.1e} in magnitude do not change at all. Use train.precision=bf16-mixed "
        "(float32 weights, bf16 compute) unless memory forces pure bf16."
    )


def reference_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` for the KL reference, in the cheapest form that computes
    the same log-probs.

    Under ``bf16-mixed`` the linear layers' weights (and biases) are stored in bfloat16:
    autocast casts them to bf16 for every product anyway, so the copy computes exactly what
    the policy computes at the start (the rest, embeddings and norms, stays float32; a weight
    shared with the input embedding too). Call it before the policy is sharded or wrapped.
    """
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    if precision_of(model) != "bf16-mixed":
        return ref
    embedding = ref.get_input_embeddings() if hasattr(ref, "get_input_embeddings") else None
    shared = {id(embedding.weight)} if embedding is not None else set()
    for module in ref.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in shared:
            module.to(torch.bfloat16)
    return ref
