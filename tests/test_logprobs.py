"""Chunked log-probs and entropy (dapo.models.chunked_logprobs): equal to the whole-logits computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dapo import algorithms as alg
from dapo.models.chunked_logprobs import chunked_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")
N, H, V = 37, 16, 50


def reference(h, w, b, y, t):
    """The unchunked computation with autograd: log-softmax and entropy of (h w^T + b) / t."""
    logits = F.linear(h, w, b).float() / t
    log_p = torch.log_softmax(logits, -1)
    return alg.token_logprobs(logits, y), -(log_p.exp() * log_p).sum(-1)


def inputs(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    cl = torch.randn(N, generator=g)  # weights of a loss that uses both outputs
    ce = torch.randn(N, generator=g)
    return h, w, b, y, cl, ce


def values_and_grads(fn, h, w, b, cl, ce, use_entropy=True):
    tensors = [x for x in (h, w, b) if x is not None]
    for x in tensors:
        x.grad = None
    logp, ent = fn()
    loss = (logp * cl).sum() + ((ent * ce).sum() if use_entropy else 0.0)
    loss.backward()
    return logp.detach(), ent.detach(), [x.grad.clone() for x in tensors]


@pytest.mark.parametrize("chunk", [1, 5, N, 4 * N])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_equals_unchunked_values_and_gradients(chunk: int, bias: bool) -> None:
    h, w, b, y, cl, ce = inputs(bias=bias)
    t = 0.7
    ref = values_and_grads(lambda: reference(h, w, b, y, t), h, w, b, cl, ce)
    got = values_and_grads(
        lambda: chunked_logprobs(h, w, y, bias=b, temperature=t, chunk_size=chunk), h, w, b, cl, ce
    )
    assert got[0].dtype == got[1].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        got[1], alg.entropy_from_logits(F.linear(h, w, b) / t), atol=1e-6, rtol=1e-6
    )
    for a, r in zip(got[2], ref[2], strict=True):
        # A gradient entry sums N terms: both orders of summation are within float32 rounding
        # of the largest entry.
        scale = float(r.abs().max())
        assert scale > 1e-2
        torch.testing.assert_close(a, r, atol=1e-6 * scale, rtol=1e-6)


def test_log_prob_only_loss_and_frozen_weights() -> None:
    """The entropy's gradient only when the loss uses it; no gradient for a frozen weight."""
    h, w, b, y, cl, ce = inputs()
    ref = values_and_grads(lambda: reference(h, w, b, y, 1.0), h, w, b, cl, ce, use_entropy=False)
    got = values_and_grads(
        lambda: chunked_logprobs(h, w, y, bias=b, chunk_size=8), h, w, b, cl, ce, use_entropy=False
    )
    for a, r in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, r, atol=1e-6 * float(r.abs().max()), rtol=1e-6)
    w.requires_grad_(False)
    h.grad = w.grad = None
    logp, ent = chunked_logprobs(h, w, y, chunk_size=8)
    (logp.sum() + ent.sum()).backward()
    assert h.grad is not None and w.grad is None


def test_bf16_products_float32_results() -> None:
    """compute_dtype=bfloat16 (mixed precision): the products take bf16 inputs but are summed
    and returned in float32, so the logits are not rounded to bf16: the log-probs are those
    of float32 arithmetic on the bf16-rounded hidden states and weight, and the gradients
    are within bf16 rounding of the float32 ones."""
    h, w, b, y, cl, ce = inputs()
    ref = values_and_grads(lambda: reference(h, w, b, y, 1.0), h, w, b, cl, ce)
    got = values_and_grads(
        lambda: chunked_logprobs(h, w, y, bias=b, chunk_size=8, compute_dtype=torch.bfloat16),
        h,
        w,
        b,
        cl,
        ce,
    )
    assert got[0].dtype == torch.float32 and got[2][1].dtype == torch.float32
    rounded = reference(
        h.detach().bfloat16().float(), w.detach().bfloat16().float(), b.detach(), y, 1.0
    )
    torch.testing.assert_close(got[0], rounded[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], rounded[1], atol=1e-6, rtol=1e-6)
    bf16_logits = F.linear(h.detach().bfloat16(), w.detach().bfloat16()).float() + b.detach()
    rounded_away = alg.token_logprobs(bf16_logits, y)  # what bf16 logits would give
    assert (got[0] - ref[0]).abs().max() < (rounded_away - ref[0]).abs().max()
    for a, r in zip(got[2], ref[2], strict=True):
        assert (a - r).norm() / r.norm() < 2e-2


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else [out]:
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_no_tokens_by_vocabulary_tensor_exists() -> None:
    """Forward and backward create nothing larger than a chunk of logits (or the weight)."""
    n, vocab, chunk = 400, 300, 16
    g = torch.Generator().manual_seed(1)
    h = torch.randn(n, H, generator=g, requires_grad=True)
    w = torch.randn(vocab, H, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, (n,), generator=g)
    with LargestTensor() as mode:
        logp, ent = chunked_logprobs(h, w, y, chunk_size=chunk)
        (logp.sum() + ent.sum()).backward()
    assert mode.largest == max(chunk * vocab, vocab * H, n * H)
    with LargestTensor() as mode:  # the unchunked computation, for contrast
        logp, ent = reference(h, w, None, y, 1.0)
    assert mode.largest == n * vocab


def test_bad_shapes_are_refused() -> None:
    h, w, b, y, _, _ = inputs()
    with pytest.raises(ValueError, match=r"hidden must be \[N, H\]"):
        chunked_logprobs(h[None], w, y)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(h, w, y, chunk_size=0)


# --- the model-level path: hidden states out, chunked head applied -------------------------


def _model_samples():
    import random

    from dapo.training.batch import Sample

    rng = random.Random(0)
    out = []
    for lp, lrs in [(5, [9, 3, 14]), (8, [1]), (3, [11, 6])]:
        prompt = [rng.randrange(3, 99) for _ in range(lp)]
        for lr in lrs:
            out.append(Sample(prompt, [rng.randrange(3, 99) for _ in range(lr)], 1.0, [1.0] * lr))
    return out


def _whole_logits(model, batch, temperature, shared):
    """Log-probs and entropies from the [b, R, V] logits, as before chunking."""
    from dapo.training.forward import response_logits
    from dapo.training.microbatch import collate

    logits = response_logits(
        model, collate(batch, 0), temperature=temperature, shared_prompt=shared
    )
    log_p = torch.log_softmax(logits, -1)
    ids = collate(batch, 0).response_ids
    return alg.token_logprobs(logits, ids), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("shared", [False, True])
def test_model_logprobs_equal_the_whole_logits_path(shared: bool) -> None:
    """response_logprobs (the model up to its hidden states, then the chunked head) gives
    the values and parameter gradients of the whole-logits computation."""
    from dapo.models.head import output_head
    from dapo.models.tiny import build_model, build_tokenizer
    from dapo.training.forward import ForwardOptions, response_logprobs
    from dapo.training.microbatch import collate

    model = build_model(len(build_tokenizer()), seed=3)
    model.train()
    assert output_head(model) is model.lm_head
    batch = _model_samples()
    mask = collate(batch, 0).loss_mask
    g = torch.Generator().manual_seed(2)
    cl, ce = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)

    def run(fn):
        model.zero_grad(set_to_none=True)
        logp, ent = fn()
        ((logp * cl * mask).sum() + (ent * ce * mask).sum()).backward()
        return (
            logp.detach() * mask,
            ent.detach() * mask,
            [p.grad.clone() for p in model.parameters()],
        )

    ref = run(lambda: _whole_logits(model, batch, 0.7, shared))
    got = run(
        lambda: response_logprobs(
            model,
            collate(batch, 0),
            ForwardOptions(0, 0.7, logits_chunk_size=7, shared_prompt=shared),
        )
    )
    torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-6)
    for a, r in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, r, atol=1e-6 * float(r.abs().max()), rtol=1e-5)


def test_heads_that_transform_the_logits_take_the_whole_logits_path() -> None:
    """Gemma 2 soft-caps its logits after the output layer, and an adapter-wrapped head is
    no plain nn.Linear: both are computed from the whole logits, with the same results."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from dapo.models.head import output_head
    from dapo.training.forward import ForwardOptions, response_logprobs
    from dapo.training.microbatch import collate

    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=99,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            head_dim=16,
            num_attention_heads=2,
            num_key_value_heads=1,
            final_logit_softcapping=0.5,
            sliding_window=64,
        )
    )
    assert output_head(gemma) is None
    batch = _model_samples()
    logp, ent = response_logprobs(gemma, collate(batch, 0), ForwardOptions(0, 1.0))
    ref_logp, ref_ent = _whole_logits(gemma, batch, 1.0, True)
    for j, s in enumerate(batch):
        n = len(s.response_ids)
        torch.testing.assert_close(logp[j, :n], ref_logp[j, :n], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ent[j, :n], ref_ent[j, :n], atol=1e-6, rtol=1e-6)
        assert (logp[j, n:] == 0).all()
    from dapo.models.tiny import build_model, build_tokenizer

    wrapped = build_model(len(build_tokenizer()), seed=1)
    wrapped.lm_head = torch.nn.Sequential(wrapped.lm_head)
    assert output_head(wrapped) is None
