"""Drawing the next token from a row of logits, with the log-prob it was drawn with.

Pure functions on tensors of static shape (no host synchronisation), shared by the
transformers engine's decode step and its tests.
"""

from __future__ import annotations

import torch

from dapo.rollout.base import SamplingParams


def process_logits(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering; removed entries are -inf."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


BLOCK = 256  # vocabulary entries per block of the two-level draw (see _draw)


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass in ``cdf`` exceeds ``target [B, 1]``
    (kept under the row's total, so that rounding never runs past the last entry): never an
    entry of mass 0."""
    total = cdf[:, -1:]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs [B, V]`` (non-negative, any total), drawn with the uniform
    numbers ``u [B]``: the first entry whose cumulative mass exceeds ``u`` times the total,
    summed in float64 so that no entry of positive mass is rounded away.

    Over a large vocabulary the draw is two-level, with the same distribution: a block of
    :data:`BLOCK` entries by the blocks' masses, then an entry of that block by its share of
    the block. Converting every entry to float64 costs more than the rest of sampling
    (~20 ms of a 128 x 49,152 draw on two CPU cores); this converts the block sums and one
    block per row."""
    rows, vocab = probs.shape
    if vocab <= 2 * BLOCK:
        cdf = probs.double().cumsum_(-1)
        return _first_above(cdf, u.to(cdf.dtype)[:, None] * cdf[:, -1:]).squeeze(-1)
    full = vocab // BLOCK * BLOCK
    sums = probs[:, :full].reshape(rows, -1, BLOCK).sum(-1)
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], -1)
    cum = sums.double().cumsum_(-1)
    target = u.to(cum.dtype)[:, None] * cum[:, -1:]
    block = _first_above(cum, target)  # [B, 1]: a block of positive mass
    after = cum.gather(-1, block)
    before = torch.where(block > 0, cum.gather(-1, (block - 1).clamp(min=0)), 0.0)
    idx = block * BLOCK + torch.arange(BLOCK, device=probs.device)
    inside = probs.gather(-1, idx.clamp(max=vocab - 1)).masked_fill(idx >= vocab, 0)
    inside = inside.double().cumsum_(-1)
    # Where the target falls in the block, as a share of the block's own float64 total.
    share = ((target - before) / (after - before)).clamp(0, 1)
    return (idx.gather(-1, _first_above(inside, share * inside[:, -1:]))).squeeze(-1)


def sample_with(
    logits: torch.Tensor, params: SamplingParams, u: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` and its log-prob under the distribution it was
    drawn from (after temperature, top-k and top-p); greedy at temperature 0.

    ``u [B]`` holds one uniform number in [0, 1) per row (unused when greedy): the token is
    the first whose cumulative probability exceeds ``u`` times the total (:func:`_draw`).
    This draws from the same distribution as ``torch.multinomial``, whose one-sample path
    draws an exponential number for every vocabulary entry (a fifth of a 135M model's
    decoding time with a 49k vocabulary on CPU), and it takes its randomness as an input,
    so a captured CUDA graph replays it with new numbers.
    """
    if params.temperature == 0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
    assert u is not None, "sampling at temperature > 0 needs uniform numbers"
    logp = torch.log_softmax(
        process_logits(logits, params.temperature, params.top_p, params.top_k), -1
    )
    tok = _draw(logp.exp(), u)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_with` with uniform numbers drawn from ``gen``."""
    u = None
    if params.temperature != 0:
        u = torch.rand(logits.shape[0], generator=gen, device=logits.device, dtype=torch.float64)
    return sample_with(logits, params, u)
