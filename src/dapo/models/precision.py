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
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from dapo.models.chunked_logprobs import Float32Linear
from dapo.models.head import head_replaced, output_head
from dapo.models.inputs import device_of
from dapo.parallel.sharding import is_fsdp

_ATTR = "_dapo_precision"
RESOLVED = ("fp32", "bf16-mixed", "bf16")


# On a CPU with native bf16, the hidden size from which bf16-mixed pays. Measured on a 2-core
# Intel Xeon with AVX-512 BF16 and AMX (2026-11-28): builtin:tiny (hidden 128) runs its default
# run at 1.22 s per step in bf16-mixed against 0.64 s in fp32 (per-operator casts outweigh the
# faster products at that size); SmolLM2-135M (hidden 576) updates 1.15-1.45x faster.
CPU_BF16_MIN_HIDDEN = 512


def _small_for_cpu_bf16(hidden_size: int | None) -> bool:
    return hidden_size is not None and hidden_size < CPU_BF16_MIN_HIDDEN


def resolve_precision(
    requested: str, cuda: bool, cpu_bf16: bool | None = None, hidden_size: int | None = None
) -> str:
    """``train.precision`` with ``auto`` resolved: ``bf16-mixed`` on CUDA, and on a CPU that
    computes bf16 natively (``cpu_bf16``, default :func:`cpu_has_native_bf16`) for a model
    whose ``hidden_size`` (None: unknown) is at least :data:`CPU_BF16_MIN_HIDDEN`; else
    ``fp32``."""
    if requested == "auto":
        if cuda:
            return "bf16-mixed"
        native = cpu_has_native_bf16() if cpu_bf16 is None else cpu_bf16
        return "bf16-mixed" if native and not _small_for_cpu_bf16(hidden_size) else "fp32"
    if requested not in RESOLVED:
        raise ValueError(f"unknown precision {requested!r}; choose one of {('auto', *RESOLVED)}")
    return requested


def precision_origin(
    requested: str, cuda: bool, cpu_bf16: bool, hidden_size: int | None = None
) -> str:
    """What ``auto`` was resolved from, for the start-up line (empty when not ``auto``)."""
    if requested != "auto":
        return ""
    if cuda:
        return " (auto: CUDA)"
    if cpu_bf16 and _small_for_cpu_bf16(hidden_size):
        return (
            f" (auto: no CUDA; a CPU with native bf16, but at hidden size {hidden_size} "
            f"(< {CPU_BF16_MIN_HIDDEN}) float32 is faster)"
        )
    return f" (auto: no CUDA, a CPU with {'native' if cpu_bf16 else 'no native'} bf16)"


CPU_BF16_ENV = "DAPO_CPU_BF16"  # "1" or "0": overrides the detection (the test suite sets 0)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products in hardware: AVX-512 BF16 or AMX (the
    flags of /proc/cpuinfo), where they are 1.3-1.45x faster than float32 on 2 cores. Without
    them PyTorch emulates bf16 and a product runs ~100x slower than in float32 (1.3 against
    153 GFLOP/s on an AMD EPYC with AVX2, measured 2026-11-27). ``$DAPO_CPU_BF16`` (0 or 1)
    overrides the detection."""
    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def bf16_cpu_slowdown(size: int = 256) -> float:
    """How many times slower a ``size``-square bf16 matrix product runs than a float32 one on
    this CPU, on one thread (the fastest of 5 runs each; ~0.15 s where bf16 is emulated). One
    thread, so that another busy process slows both alike: on two threads the float32
    product waits for the other core, and a median of 3 read 3x where the products are 70x
    apart."""

    def seconds(dtype: torch.dtype) -> float:
        a = torch.randn(size, size).to(dtype)
        a @ a  # warm-up
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ a
            runs.append(time.perf_counter() - t0)
        return min(runs)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return seconds(torch.bfloat16) / max(seconds(torch.float32), 1e-9)
    finally:
        torch.set_num_threads(threads)


def cpu_bf16_warning(precision: str, slowdown: float) -> str:
    """The warning for bf16 compute asked for on a CPU without native bf16."""
    return (
        f"warning: train.precision={precision} on a CPU without native bf16 (no AVX-512 BF16 "
        f"or AMX): a bf16 matrix product measured {slowdown:.0f}x slower than float32 here, "
        "and every forward pass and generated token pays it. Use train.precision=auto "
        "(fp32 on this CPU) or fp32."
    )


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
def autocast(model: nn.Module, cache: bool = True) -> Iterator[None]:
    """bf16 autocast around ``model``'s forward passes under ``bf16-mixed``; a no-op otherwise,
    and for an FSDP2 model, whose ``MixedPrecisionPolicy`` casts the parameters itself.
    ``cache=False``: no cast is reused across ops (inside a captured CUDA graph a cached cast
    would be a tensor freed when the context ends)."""
    dtype = mixed_precision_dtype(model)
    if dtype is None or is_fsdp(model):
        yield
        return
    with torch.autocast(device_of(model).type, dtype=dtype, cache_enabled=cache):
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


class GenerationWeights:
    """The weights generation reads, in the dtype its products run in, cast once per call.

    Under ``bf16-mixed`` the policy keeps float32 weights and autocast would round every
    linear layer's weight to bf16 for every decoding step. Inside :meth:`applied` each
    ``nn.Linear`` (but one sharing its weight with the input embedding, which is looked up in
    float32) reads a bf16 copy instead, which autocast takes as it is: the same products,
    one cast per call. The output layer becomes a
    :class:`~dapo.models.chunked_logprobs.Float32Linear` (float32 logits from bf16 products,
    as the training log-probs). The copies are kept between calls and refreshed in place, so
    their addresses do not change (a captured CUDA graph keeps reading them) until
    :meth:`release`. In ``fp32`` the
    model is used as it is; an FSDP2 model's ``MixedPrecisionPolicy`` casts at the gather.
    """

    def __init__(self) -> None:
        self._copies: dict[int, torch.Tensor] = {}
        self._head: tuple[int, Float32Linear] | None = None
        self._head_is_weight = False  # the model holds it in the compute dtype already

    def nbytes(self) -> int:
        """The memory the kept copies take (not the output layer's weight where the model
        already holds it in the compute dtype, and the copy is the weight itself)."""
        head = 0
        if self._head is not None and not self._head_is_weight:
            head = self._head[1].weight.nbytes
        return head + sum(c.nbytes for c in self._copies.values())

    def release(self) -> None:
        """Free the copies (the next call makes new ones, at other addresses)."""
        self._copies.clear()
        self._head = None

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        dtype = compute_dtype(model)
        head = output_head(model)
        if dtype not in (torch.bfloat16, torch.float16) or is_fsdp(model):
            with float32_logits(model):
                yield
            return
        swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
        if mixed_precision_dtype(model) is not None:
            embedding = (
                model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            )
            tied = {id(embedding.weight)} if embedding is not None else set()
            for module in model.modules():
                if isinstance(module, nn.Linear) and module is not head:
                    w = module.weight
                    if id(w) in tied:
                        continue
                    copy_ = self._copies.get(id(w))
                    if copy_ is None or copy_.shape != w.shape or copy_.device != w.device:
                        copy_ = self._copies[id(w)] = torch.empty_like(w, dtype=dtype)
                    copy_.copy_(w.detach())
                    swapped.append((w, w.data))
                    w.data = copy_
        try:
            if head is None:
                yield
                return
            if self._head is None or self._head[0] != id(head.weight):
                self._head = (
                    id(head.weight),
                    Float32Linear(head.weight.detach(), head.bias, dtype),
                )
                self._head_is_weight = self._head[1].weight.data_ptr() == head.weight.data_ptr()
            fl = self._head[1]
            fl.weight.copy_(head.weight.detach().to(dtype))
            if head.bias is not None:
                fl.bias.copy_(head.bias.detach())
            with head_replaced(head, fl):
                yield
        finally:
            for w, data in swapped:
                w.data = data


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
