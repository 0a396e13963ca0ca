"""Per-token log-probs and entropies from hidden states, chunk by chunk: pure tensor maths.

A language model's loss needs, for each response position n with final hidden state
``h_n`` (``[N, H]``) and sampled token ``y_n``, only two numbers: the log-prob of ``y_n`` and
the entropy of the next-token distribution. Computing the ``[N, V]`` logits at once (V is
~150k for real vocabularies) costs ``4 N V`` bytes in float32, and autograd keeps them for
backward. :func:`chunked_logprobs` applies the output layer, the log-softmax and the entropy
to ``chunk_size`` positions at a time and recomputes each chunk's logits in backward, so the
extra memory is ``O(chunk_size x V)`` whatever N. With output weight ``W`` (``[V, H]``),
optional bias ``b`` and sampling temperature ``T``:

    z_n      = (W h_n + b) / T                         (float32)
    logp_n   = z_n[y_n] - logsumexp(z_n)
    H_n      = -sum_v p_nv log p_nv,                    p_n = softmax(z_n)

and for upstream gradients ``g`` (of logp) and ``e`` (of the entropy):

    dz_n     = g_n (onehot(y_n) - p_n) - e_n p_n (log p_n + H_n)
    dh_n     = W^T dz_n / T,   dW = sum_n dz_n h_n^T / T,   db = sum_n dz_n / T

The entropy's gradient costs nothing unless the entropy is used in the loss. The products
``W h`` take their inputs in ``compute_dtype`` (bfloat16 under mixed precision) but sum and
return them in float32 (:class:`Float32Linear`): the logits are not rounded to bfloat16's 8
significant bits, which at a logit of 20 would be an error of up to 0.06 in every log-prob.
Everything after the products is float32. ``dapo.algorithms``' ``token_logprobs`` and
``entropy_from_logits`` are the unchunked reference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Float32Linear", "chunked_logprobs"]

_LOW = (torch.bfloat16, torch.float16)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)``, each float32 ``[N]``, of ``softmax((hidden @ weight.T + bias) / T)``
    at ``targets`` (``[N]`` token ids), ``chunk_size`` positions at a time.

    ``hidden`` is ``[N, H]`` and ``weight`` ``[V, H]`` (an ``nn.Linear``'s); both outputs are
    differentiable with respect to ``hidden``, ``weight`` and ``bias``. ``compute_dtype``
    (default: ``weight``'s dtype) is the dtype of the matrix products.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [N, H] and targets [N], got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if chunk_size < 1 or temperature <= 0:
        raise ValueError(f"chunk_size ({chunk_size}) and temperature ({temperature}) must be > 0")
    dtype = compute_dtype or weight.dtype
    return _ChunkedLogprobs.apply(
        hidden, weight, bias, targets, float(temperature), int(chunk_size), dtype
    )


def _operand(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype``, as a product's input: low precision on CUDA (whose matrix
    products can return float32); on other devices upcast again to float32, exactly."""
    x = x.to(dtype)
    return x.float() if dtype in _LOW and not x.is_cuda else x


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two :func:`_operand` matrices, summed and returned in float32 (or the
    operands' dtype when that is wider)."""
    if a.dtype in _LOW:
        return torch.mm(a, b, out_dtype=torch.float32)
    out = a @ b
    return out if out.dtype == torch.float64 else out.float()


class Float32Linear:
    """``x -> x W^T + b`` with ``x`` and ``W`` rounded to ``dtype`` and the products summed and
    returned in float32: a bf16 matrix product without rounding its result to bf16. The
    weight is rounded once, when this is built."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.weight = _operand(weight, dtype)
        self.bias = bias.float() if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are explicit here
            shape = x.shape[:-1]
            if self.dtype not in _LOW:  # plain float32 (or wider): as nn.Linear computes it
                z = F.linear(x.to(self.dtype), self.weight).float()
            else:
                z = _product(_operand(x.reshape(-1, x.shape[-1]), self.dtype), self.weight.T)
            z = z.reshape(*shape, -1)
            return z + self.bias if self.bias is not None else z


def _logits(head: Float32Linear, h: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 ``(h w^T + b) / T`` for one chunk."""
    z = head(h)
    return z / temperature if temperature != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        head = Float32Linear(weight.detach(), bias.detach() if bias is not None else None, dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit here
            for s in range(0, n, chunk_size):
                rows = slice(s, s + chunk_size)
                z = _logits(head, hidden[rows], temperature)
                lse[rows] = torch.logsumexp(z, -1)
                log_p = z.sub_(lse[rows, None])  # in place: two [k, V] buffers in all
                p = torch.exp(log_p)
                logp[rows] = log_p.gather(-1, targets[rows, None])[:, 0]
                entropy[rows] = -(p[:, None, :] @ log_p[:, :, None])[:, 0, 0]  # no [k, V] temp
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[Any, ...]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 7
        if (g_logp is None and g_ent is None) or not (need_h or need_w or need_b):
            return none
        t, k, dtype = ctx.temperature, ctx.chunk_size, ctx.dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        grad_b = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        )
        head = Float32Linear(weight, bias, dtype)
        w = head.weight
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], k):
                rows = slice(s, s + k)
                h = _operand(hidden[rows], dtype)
                # Recomputed (nothing of size V was kept), in place: two [k, V] buffers.
                log_p = _logits(head, hidden[rows], t).sub_(lse[rows, None])
                p = torch.exp(log_p)
                if g_ent is not None:  # -e p (log p + H)
                    dz = log_p.add_(entropy[rows, None]).mul_(p).mul_(-g_ent[rows, None].float())
                else:
                    dz = log_p.zero_()
                if g_logp is not None:  # + g (onehot(y) - p)
                    g = g_logp[rows, None].float()
                    dz.sub_(p.mul_(g)).scatter_add_(-1, targets[rows, None], g)
                if t != 1.0:
                    dz /= t
                dz_c = _operand(dz, dtype)
                if grad_h is not None:
                    grad_h[rows] = _product(dz_c, w).to(hidden.dtype)
                if grad_w is not None:
                    grad_w += _product(dz_c.T, h)  # summed over chunks in float32
                if grad_b is not None:
                    grad_b += dz.sum(0)
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
        )
