"""Tests for ``dapo.algorithms``: advantages, the DAPO policy loss, KL, entropy and helpers.

Every expected number is computed inside this file, either by hand (the arithmetic is
written out in comments) or by a plain-Python transcription of the paper's formulas
with explicit loops over ``float`` values (``math.exp`` / ``math.log``). None of the
reference code below is vectorised, so it cannot share a bug with the implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

from dapo.algorithms import (
    entropy_from_logits,
    gen_prob,
    group_advantages,
    kl_penalty,
    masked_mean,
    policy_loss,
    token_logprobs,
)

F64 = torch.float64
EPS_STD = 1e-6  # the constant added to the std in group_advantages


# --------------------------------------------------------------------------------------
# Plain-Python references (lists of floats, explicit loops)
# --------------------------------------------------------------------------------------


def _ref_token_loss(
    lp: float, old: float, a: float, clip_low: float, clip_high: float, clip_c: float | None
) -> float:
    """Negative clipped surrogate of one token, straight from the paper's formula."""
    r = math.exp(lp - old)
    clipped_r = min(max(r, 1.0 - clip_low), 1.0 + clip_high)
    surrogate = min(r * a, clipped_r * a)
    if clip_c is not None and a < 0:
        surrogate = max(surrogate, clip_c * a)
    return -surrogate


def _ref_token_grad(
    lp: float, old: float, a: float, clip_low: float, clip_high: float, clip_c: float | None
) -> float:
    """d(per-token loss)/d(logprob), derived by hand case by case.

    Unclipped: loss = -r*A and dr/dlp = r, so the derivative is -r*A. Whenever a
    constant (clipped) term is the one selected, the derivative is 0.
    """
    r = math.exp(lp - old)
    if a > 0 and r > 1.0 + clip_high:
        return 0.0  # upper clip active
    if a < 0 and r < 1.0 - clip_low:
        return 0.0  # lower clip active
    if a < 0 and clip_c is not None and r > clip_c:
        return 0.0  # dual clip active: the bound clip_c * A is taken
    return -r * a


def _rows(t: torch.Tensor) -> list[list[float]]:
    return [[float(x) for x in row] for row in t]


def _adv_rows(adv: torch.Tensor, T: int) -> list[list[float]]:
    if adv.dim() == 1:
        return [[float(a)] * T for a in adv]
    return _rows(adv)


def _ref_policy_loss(
    lp,
    old,
    adv,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.28,
    clip_c=None,
    agg="token-mean",
    num_tokens=None,
    max_len=None,
):
    """Return (loss, grad wrt logprobs as nested list) computed with loops."""
    lp_r, old_r, m_r = _rows(lp), _rows(old), _rows(mask)
    B, T = len(lp_r), len(lp_r[0])
    a_r = _adv_rows(adv, T)
    losses = [[0.0] * T for _ in range(B)]
    grads = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if m_r[i][t] > 0:
                losses[i][t] = _ref_token_loss(
                    lp_r[i][t], old_r[i][t], a_r[i][t], clip_low, clip_high, clip_c
                )
                grads[i][t] = _ref_token_grad(
                    lp_r[i][t], old_r[i][t], a_r[i][t], clip_low, clip_high, clip_c
                )
    # weight[i][t] = d loss / d per_token_loss[i][t]
    weight = [[0.0] * T for _ in range(B)]
    if agg == "token-mean":
        n = sum(sum(row) for row in m_r) if num_tokens is None else float(num_tokens)
        for i in range(B):
            for t in range(T):
                weight[i][t] = m_r[i][t] / n
    elif agg == "seq-mean-token-mean":
        for i in range(B):
            n_i = sum(m_r[i])
            assert n_i > 0, "reference only defined for non-empty rows"
            for t in range(T):
                weight[i][t] = m_r[i][t] / n_i / B
    elif agg == "seq-mean-token-sum-norm":
        L = T if max_len is None else max_len
        for i in range(B):
            for t in range(T):
                weight[i][t] = m_r[i][t] / (B * L)
    else:
        raise AssertionError(agg)
    loss = 0.0
    for i in range(B):
        for t in range(T):
            loss += weight[i][t] * losses[i][t]
    grad = [[weight[i][t] * grads[i][t] for t in range(T)] for i in range(B)]
    return loss, grad


def _ref_group_advantages(rewards: list[float], G: int, scale: str) -> list[float]:
    n = len(rewards)
    batch_mean = sum(rewards) / n
    batch_std = math.sqrt(sum((x - batch_mean) ** 2 for x in rewards) / (n - 1))
    out = []
    for k in range(n // G):
        grp = rewards[k * G : (k + 1) * G]
        if G == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(grp) / G
            std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
        for x in grp:
            if scale == "group":
                out.append((x - mean) / (std + EPS_STD))
            elif scale == "batch":
                out.append((x - mean) / (batch_std + EPS_STD))
            else:
                out.append(x - mean)
    return out


def _ref_entropy(row: list[float]) -> float:
    """-sum p log p with a max-shift so +-1e4 logits do not overflow."""
    m = max(row)
    z = sum(math.exp(x - m) for x in row)
    h = 0.0
    for x in row:
        p = math.exp(x - m) / z
        if p > 0.0:
            h -= p * math.log(p)
    return h


def _ref_log_softmax(row: list[float], idx: int) -> float:
    m = max(row)
    z = sum(math.exp(x - m) for x in row)
    return (row[idx] - m) - math.log(z)


def _from_ratios(ratios, old=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Build (logprobs, old_logprobs) in float64 such that exp(lp - old) == ratios."""
    ratios = torch.as_tensor(ratios, dtype=F64)
    if old is None:
        g = torch.Generator().manual_seed(1234)
        old = -torch.rand(ratios.shape, generator=g, dtype=F64) * 3.0 - 0.1
    lp = old + torch.log(ratios)
    return lp, old


def _loss_and_grad(lp, old, adv, mask, **kw):
    leaf = lp.detach().clone().requires_grad_(True)
    loss, stats = policy_loss(leaf, old, adv, mask, **kw)
    loss.backward()
    return loss.detach(), leaf.grad.detach(), stats


def _close(actual, expected, tol=1e-12):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), rtol=tol, atol=tol
    )


# --------------------------------------------------------------------------------------
# 1. Clip-Higher bounds
# --------------------------------------------------------------------------------------

BELOW = 1.0 - 1e-6
ABOVE = 1.0 + 1e-6


@pytest.mark.parametrize("adv", [1.5, 0.3])
def test_upper_clip_starts_exactly_at_1_28_for_positive_advantage(adv):
    mask = torch.ones(1, 1, dtype=F64)
    a = torch.tensor([adv], dtype=F64)

    # just inside the bound: unclipped, loss -r*A, gradient -r*A (num_tokens = 1)
    r = 1.28 * BELOW
    lp, old = _from_ratios([[r]])
    loss, grad, stats = _loss_and_grad(lp, old, a, mask)
    _close(loss, -r * adv)
    _close(grad, [[-r * adv]])
    assert float(grad[0, 0]) != 0.0
    assert float(stats["clip_frac_high"]) == 0.0

    # just outside the bound: loss is the constant -1.28*A, gradient exactly zero
    for r in (1.28 * ABOVE, 1.5, 7.0):
        lp, old = _from_ratios([[r]])
        loss, grad, stats = _loss_and_grad(lp, old, a, mask)
        _close(loss, -1.28 * adv)
        assert float(grad[0, 0]) == 0.0
        assert float(stats["clip_frac_high"]) == 1.0
        assert float(stats["clip_frac_low"]) == 0.0


@pytest.mark.parametrize("adv", [-1.5, -0.3])
def test_lower_clip_starts_exactly_at_0_8_for_negative_advantage(adv):
    mask = torch.ones(1, 1, dtype=F64)
    a = torch.tensor([adv], dtype=F64)

    r = 0.8 * ABOVE  # just inside
    lp, old = _from_ratios([[r]])
    loss, grad, stats = _loss_and_grad(lp, old, a, mask)
    _close(loss, -r * adv)
    _close(grad, [[-r * adv]])
    assert float(grad[0, 0]) != 0.0
    assert float(stats["clip_frac_low"]) == 0.0

    for r in (0.8 * BELOW, 0.5, 0.01):  # outside: loss -0.8*A = 0.8*|A|, zero gradient
        lp, old = _from_ratios([[r]])
        loss, grad, stats = _loss_and_grad(lp, old, a, mask)
        _close(loss, -0.8 * adv)
        assert float(grad[0, 0]) == 0.0
        assert float(stats["clip_frac_low"]) == 1.0
        assert float(stats["clip_frac_high"]) == 0.0


@pytest.mark.parametrize(("ratio", "adv"), [(0.5, 1.0), (0.05, 2.0), (1.5, -1.0), (2.5, -0.4)])
def test_clip_is_one_sided(ratio, adv):
    """The min() never clips A>0 below 1-eps_low nor A<0 above 1+eps_high (no clip_c)."""
    lp, old = _from_ratios([[ratio]])
    loss, grad, stats = _loss_and_grad(
        lp, old, torch.tensor([adv], dtype=F64), torch.ones(1, 1, dtype=F64)
    )
    _close(loss, -ratio * adv)
    _close(grad, [[-ratio * adv]])
    assert float(stats["clip_frac_low"]) == 0.0
    assert float(stats["clip_frac_high"]) == 0.0


def test_symmetric_preset_clips_at_1_2():
    mask = torch.ones(1, 1, dtype=F64)
    a = torch.tensor([2.0], dtype=F64)
    for r in (1.2 * ABOVE, 1.25):  # 1.25 would be unclipped with the default 0.28
        lp, old = _from_ratios([[r]])
        loss, grad, stats = _loss_and_grad(lp, old, a, mask, clip_low=0.2, clip_high=0.2)
        _close(loss, -1.2 * 2.0)
        assert float(grad[0, 0]) == 0.0
        assert float(stats["clip_frac_high"]) == 1.0
        # the same ratio is inside the Clip-Higher bound
        loss_dapo, grad_dapo, _ = _loss_and_grad(lp, old, a, mask)
        _close(loss_dapo, -r * 2.0)
        assert float(grad_dapo[0, 0]) != 0.0
    r = 1.2 * BELOW
    lp, old = _from_ratios([[r]])
    loss, grad, stats = _loss_and_grad(lp, old, a, mask, clip_low=0.2, clip_high=0.2)
    _close(loss, -r * 2.0)
    _close(grad, [[-r * 2.0]])
    assert float(stats["clip_frac_high"]) == 0.0


def test_clip_fractions_count_exactly_the_tokens_beyond_the_bounds():
    # row 0 has A = +1, row 1 has A = -1; the last column(s) are masked out and hold
    # ratios that would be clipped, so they must not be counted.
    ratios = [
        [1.0, 1.3, 1.5, 0.5, 1.27, 2.0],  # A>0: high-clipped: 1.3, 1.5 -> 2 ; 0.5 not low
        [0.7, 0.79, 0.5, 0.81, 1.5, 0.1],  # A<0: low-clipped: 0.7, 0.79, 0.5 -> 3 ; 1.5 not
    ]
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]], dtype=F64)  # 10 tokens
    lp, old = _from_ratios(ratios)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    _, grad, stats = _loss_and_grad(lp, old, adv, mask)
    assert float(stats["clip_frac_high"]) == pytest.approx(2 / 10, abs=1e-12)
    assert float(stats["clip_frac_low"]) == pytest.approx(3 / 10, abs=1e-12)
    # zero gradient exactly on the clipped and the masked tokens, nonzero elsewhere
    zero = [[False, True, True, False, False, True], [True, True, True, False, False, True]]
    for i in range(2):
        for t in range(6):
            assert (float(grad[i, t]) == 0.0) == zero[i][t], (i, t, float(grad[i, t]))


def test_ratio_one_never_clips():
    lp, old = _from_ratios(torch.ones(3, 5, dtype=F64))
    mask = torch.ones(3, 5, dtype=F64)
    _, _, stats = _loss_and_grad(lp, old, torch.tensor([1.0, -1.0, 0.5], dtype=F64), mask)
    assert float(stats["clip_frac_low"]) == 0.0
    assert float(stats["clip_frac_high"]) == 0.0
    assert float(stats["ratio_mean"]) == pytest.approx(1.0, abs=1e-12)
    assert float(stats["ppo_kl"]) == pytest.approx(0.0, abs=1e-12)


def test_ratio_mean_and_ppo_kl_are_masked_means():
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(3, 4, generator=g, dtype=F64) * 2
    lp = old + torch.randn(3, 4, generator=g, dtype=F64) * 0.3
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 0, 0]], dtype=F64)
    lp[mask == 0] = 8.0  # garbage in masked positions (ratio ~ e^10) must not count
    _, _, stats = _loss_and_grad(lp, old, torch.tensor([0.5, -1.0, 2.0], dtype=F64), mask)
    n, r_sum, kl_sum = 0, 0.0, 0.0
    for i in range(3):
        for t in range(4):
            if float(mask[i, t]):
                n += 1
                r_sum += math.exp(float(lp[i, t]) - float(old[i, t]))
                kl_sum += float(old[i, t]) - float(lp[i, t])
    assert float(stats["ratio_mean"]) == pytest.approx(r_sum / n, rel=1e-12)
    assert float(stats["ppo_kl"]) == pytest.approx(kl_sum / n, rel=1e-12)


# --------------------------------------------------------------------------------------
# 2. Dual clip
# --------------------------------------------------------------------------------------


def test_dual_clip_bounds_negative_advantage_with_huge_ratio():
    mask = torch.ones(1, 1, dtype=F64)
    a = torch.tensor([-2.0], dtype=F64)
    lp, old = _from_ratios([[10.0]])
    # without dual clip: surrogate = min(10*-2, 1.28*-2) = -20 -> loss 20, grad -r*A = 20
    loss, grad, _ = _loss_and_grad(lp, old, a, mask)
    _close(loss, 20.0)
    _close(grad, [[20.0]])
    # with clip_c = 3: surrogate = max(-20, 3*-2) = -6 -> loss 6 = clip_c*|A|, no gradient
    loss, grad, _ = _loss_and_grad(lp, old, a, mask, clip_c=3.0)
    _close(loss, 6.0)
    assert float(grad[0, 0]) == 0.0


def test_dual_clip_boundary_is_at_ratio_clip_c():
    mask = torch.ones(1, 1, dtype=F64)
    a = torch.tensor([-2.0], dtype=F64)
    r = 3.0 * BELOW  # inside: loss = -r*A = 2r, gradient 2r
    lp, old = _from_ratios([[r]])
    loss, grad, _ = _loss_and_grad(lp, old, a, mask, clip_c=3.0)
    _close(loss, 2 * r)
    _close(grad, [[2 * r]])
    r = 3.0 * ABOVE  # outside: loss = 3*2 = 6, zero gradient
    lp, old = _from_ratios([[r]])
    loss, grad, _ = _loss_and_grad(lp, old, a, mask, clip_c=3.0)
    _close(loss, 6.0)
    assert float(grad[0, 0]) == 0.0
    # ratio 2 < clip_c: dual clip inactive, identical to plain PPO: loss 4, gradient 4
    lp, old = _from_ratios([[2.0]])
    loss, grad, _ = _loss_and_grad(lp, old, a, mask, clip_c=3.0)
    _close(loss, 4.0)
    _close(grad, [[4.0]])
    # ratio 0.5 < 1 - eps_low: the ordinary lower clip still applies: loss 0.8*2
    lp, old = _from_ratios([[0.5]])
    loss, grad, _ = _loss_and_grad(lp, old, a, mask, clip_c=3.0)
    _close(loss, 1.6)
    assert float(grad[0, 0]) == 0.0


@pytest.mark.parametrize("ratio", [0.1, 0.9, 1.0, 1.2, 1.29, 10.0, 100.0])
def test_dual_clip_leaves_positive_advantages_alone(ratio):
    lp, old = _from_ratios([[ratio]])
    a = torch.tensor([2.0], dtype=F64)
    mask = torch.ones(1, 1, dtype=F64)
    loss_plain, grad_plain, _ = _loss_and_grad(lp, old, a, mask)
    loss_dual, grad_dual, _ = _loss_and_grad(lp, old, a, mask, clip_c=3.0)
    expected = -min(ratio * 2.0, min(max(ratio, 0.8), 1.28) * 2.0)
    _close(loss_plain, expected)
    _close(loss_dual, expected)
    _close(grad_dual, grad_plain)


# --------------------------------------------------------------------------------------
# 3. Aggregation modes
# --------------------------------------------------------------------------------------

RAGGED_MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]


def test_aggregations_by_hand_at_ratio_one():
    """Ratio 1 everywhere: per-token loss is -A_i. Row lengths 4, 2, 1; A = 1, -2, 0.5."""
    lp, old = _from_ratios(torch.ones(3, 4, dtype=F64))
    mask = torch.tensor(RAGGED_MASK, dtype=F64)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    # token sums per row: -4, +4, -0.5 ; total -0.5 over 7 tokens
    loss, _ = policy_loss(lp, old, adv, mask, agg="token-mean")
    _close(loss, -0.5 / 7)
    # row means: -1, +2, -0.5 ; mean over 3 rows = 0.5/3
    loss, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-mean")
    _close(loss, 0.5 / 3)
    # summed tokens / (B * max_len) = -0.5 / (3*4)
    loss, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum-norm")
    _close(loss, -0.5 / 12)
    loss, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum-norm", max_len=10)
    _close(loss, -0.5 / 30)
    loss, _ = policy_loss(lp, old, adv, mask, agg="token-mean", num_tokens=20)
    _close(loss, -0.5 / 20)


def _ragged_example(adv_per_token: bool):
    ratios = [
        [1.0, 1.4, 0.6, 1.1],  # 1.4 above 1.28, 0.6 below 0.8
        [0.75, 1.29, 9.9, 9.9],  # last two masked (garbage ratios)
        [5.0, 9.9, 9.9, 9.9],  # only the first token is unmasked
    ]
    lp, old = _from_ratios(ratios)
    mask = torch.tensor(RAGGED_MASK, dtype=F64)
    if adv_per_token:
        adv = torch.tensor(
            [[0.7, 1.1, -0.4, -1.3], [-0.9, 0.2, 5.0, 5.0], [-1.7, 3.0, 3.0, 3.0]], dtype=F64
        )
    else:
        adv = torch.tensor([0.7, -0.9, -1.7], dtype=F64)
    return lp, old, adv, mask


AGG_CASES = [
    ("token-mean", {}),
    ("token-mean", {"num_tokens": 11}),
    ("seq-mean-token-mean", {}),
    ("seq-mean-token-sum-norm", {}),
    ("seq-mean-token-sum-norm", {"max_len": 6}),
]


@pytest.mark.parametrize("adv_per_token", [False, True])
@pytest.mark.parametrize("clip_c", [None, 3.0])
@pytest.mark.parametrize(("agg", "extra"), AGG_CASES)
def test_aggregations_match_loop_reference(agg, extra, clip_c, adv_per_token):
    lp, old, adv, mask = _ragged_example(adv_per_token)
    loss, grad, _ = _loss_and_grad(lp, old, adv, mask, agg=agg, clip_c=clip_c, **extra)
    ref_loss, ref_grad = _ref_policy_loss(lp, old, adv, mask, agg=agg, clip_c=clip_c, **extra)
    assert loss.dim() == 0
    _close(loss, ref_loss)
    _close(grad, ref_grad)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_random_batch_matches_loop_reference(agg):
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    old = -torch.rand(B, T, generator=g, dtype=F64) * 4
    lp = old + torch.randn(B, T, generator=g, dtype=F64) * 0.4  # many ratios clip
    adv = torch.randn(B, generator=g, dtype=F64)
    lengths = [7, 1, 4, 2, 6]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=F64)
    loss, grad, _ = _loss_and_grad(lp, old, adv, mask, agg=agg)
    ref_loss, ref_grad = _ref_policy_loss(lp, old, adv, mask, agg=agg)
    _close(loss, ref_loss)
    _close(grad, ref_grad)


def test_row_advantages_equal_broadcast_token_advantages():
    lp, old, adv, mask = _ragged_example(adv_per_token=False)
    adv_bt = adv[:, None].expand(3, 4).contiguous()
    for agg, extra in AGG_CASES:
        l1, g1, _ = _loss_and_grad(lp, old, adv, mask, agg=agg, **extra)
        l2, g2, _ = _loss_and_grad(lp, old, adv_bt, mask, agg=agg, **extra)
        _close(l1, l2)
        _close(g1, g2)


def test_bool_mask_equals_float_mask():
    lp, old, adv, mask = _ragged_example(adv_per_token=False)
    for agg, extra in AGG_CASES:
        l1, g1, s1 = _loss_and_grad(lp, old, adv, mask, agg=agg, **extra)
        l2, g2, s2 = _loss_and_grad(lp, old, adv, mask.bool(), agg=agg, **extra)
        _close(l1, l2)
        _close(g1, g2)
        for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "ppo_kl"):
            assert float(s1[key]) == pytest.approx(float(s2[key]), abs=1e-12)


def test_seq_mean_token_mean_with_an_empty_row_is_finite():
    lp, old, adv, mask = _ragged_example(adv_per_token=False)
    mask = mask.clone()
    mask[2] = 0.0  # a fully masked (truncated / filtered) response
    loss, grad, stats = _loss_and_grad(lp, old, adv, mask, agg="seq-mean-token-mean")
    assert torch.isfinite(loss)
    assert torch.isfinite(grad).all()
    assert (grad[2] == 0).all()
    for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "ppo_kl"):
        assert math.isfinite(float(stats[key]))


def test_masked_tokens_get_zero_gradient_and_do_not_change_the_loss():
    lp, old, adv, mask = _ragged_example(adv_per_token=False)
    lp2 = lp.clone()
    lp2[mask == 0] = lp2[mask == 0] + 3.0  # change only masked positions
    for agg, extra in AGG_CASES:
        l1, g1, _ = _loss_and_grad(lp, old, adv, mask, agg=agg, **extra)
        l2, g2, _ = _loss_and_grad(lp2, old, adv, mask, agg=agg, **extra)
        _close(l1, l2)
        assert (g1[mask == 0] == 0).all()
        assert (g2[mask == 0] == 0).all()


# --------------------------------------------------------------------------------------
# 4. Exactness under micro-batching
# --------------------------------------------------------------------------------------


def _long_batch():
    """Rows of very different lengths; rows 2 and 4 are truncated and fully masked."""
    g = torch.Generator().manual_seed(42)
    B, T = 6, 16
    lengths = [16, 1, 0, 9, 0, 3]
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    lp = old + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    adv = torch.tensor([1.3, -0.7, 0.9, -1.1, 0.4, 2.0], dtype=F64)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=F64)
    return lp, old, adv, mask, lengths


SPLITS = [[[0, 1, 2], [3, 4, 5]], [[0], [1, 2, 3, 4, 5]], [[0, 3], [1, 2, 4, 5]]]


@pytest.mark.parametrize("global_count_as_tensor", [False, True])
@pytest.mark.parametrize("split", SPLITS)
def test_token_mean_is_exact_under_micro_batching(split, global_count_as_tensor):
    lp, old, adv, mask, lengths = _long_batch()
    n_global = int(mask.sum())  # 29 unmasked tokens
    assert n_global == 29

    full_leaf = lp.clone().requires_grad_(True)
    full_loss, _ = policy_loss(full_leaf, old, adv, mask, agg="token-mean")
    full_loss.backward()

    mb_leaf = lp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    naive_sum = 0.0
    naive_losses = []
    for rows in split:
        idx = torch.tensor(rows)
        t_mb = max(1, max(lengths[r] for r in rows))  # each micro-batch padded to its own T
        lp_mb, old_mb = mb_leaf[idx, :t_mb], old[idx, :t_mb]
        mask_mb, adv_mb = mask[idx, :t_mb], adv[idx]
        count = torch.tensor(float(n_global), dtype=F64) if global_count_as_tensor else n_global
        loss_mb, _ = policy_loss(lp_mb, old_mb, adv_mb, mask_mb, agg="token-mean", num_tokens=count)
        assert torch.isfinite(loss_mb)
        loss_mb.backward()  # gradient accumulation
        total = total + loss_mb.detach()
        if mask_mb.sum() > 0:
            with torch.no_grad():
                naive, _ = policy_loss(lp_mb, old_mb, adv_mb, mask_mb, agg="token-mean")
            naive_losses.append(float(naive))
            naive_sum += float(naive)

    _close(total, full_loss.detach())
    _close(mb_leaf.grad, full_leaf.grad)

    # The bug the reference warns about: normalising each micro-batch by its own token
    # count gives another value, whether the micro-batch losses are summed or averaged.
    assert abs(naive_sum - float(full_loss.detach())) > 1e-3
    assert abs(sum(naive_losses) / len(split) - float(full_loss.detach())) > 1e-3


def test_fully_masked_micro_batch_with_global_count_contributes_zero():
    lp, old, adv, mask, _ = _long_batch()
    idx = torch.tensor([2, 4])  # both truncated, no unmasked token
    leaf = lp[idx].clone().requires_grad_(True)
    loss, _ = policy_loss(leaf, old[idx], adv[idx], mask[idx], agg="token-mean", num_tokens=29)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert (leaf.grad == 0).all()


def test_seq_mean_token_sum_norm_micro_batches_with_global_max_len():
    """Dr. GRPO: each row is divided by the same constant max_len, whatever the padding.

    With micro-batches padded to their own length, passing the global max_len and
    weighting micro-batch b by B_b / B reproduces the full-batch loss and gradient.
    """
    lp, old, adv, mask, lengths = _long_batch()
    B, T = mask.shape
    full_leaf = lp.clone().requires_grad_(True)
    full_loss, _ = policy_loss(full_leaf, old, adv, mask, agg="seq-mean-token-sum-norm")
    full_loss.backward()

    mb_leaf = lp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    naive_total = 0.0
    for rows in SPLITS[0]:
        idx = torch.tensor(rows)
        t_mb = max(lengths[r] for r in rows)  # 16 for the first half, 9 for the second
        args = (mb_leaf[idx, :t_mb], old[idx, :t_mb], adv[idx], mask[idx, :t_mb])
        loss_mb, _ = policy_loss(*args, agg="seq-mean-token-sum-norm", max_len=T)
        (loss_mb * len(rows) / B).backward()
        total = total + loss_mb.detach() * len(rows) / B
        with torch.no_grad():  # default max_len = the micro-batch's own padded length
            naive, _ = policy_loss(*args, agg="seq-mean-token-sum-norm")
        naive_total += float(naive) * len(rows) / B
    _close(total, full_loss.detach())
    _close(mb_leaf.grad, full_leaf.grad)
    assert abs(naive_total - float(full_loss.detach())) > 1e-3


# --------------------------------------------------------------------------------------
# 5. Group advantages
# --------------------------------------------------------------------------------------


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=F64)
    # group 1: mean 0, unbiased std sqrt(4/3); group 2: all equal -> 0
    s = math.sqrt(4 / 3)
    a = 1 / (s + 1e-6)
    _close(group_advantages(rewards, 4, scale="group"), [a, -a, -a, a, 0, 0, 0, 0])
    _close(group_advantages(rewards, 4), [a, -a, -a, a, 0, 0, 0, 0])  # default "group"
    # batch: mean 0.5, deviations +-0.5 (x6) and -1.5 (x2): sum sq 6, var 6/7
    b = 1 / (math.sqrt(6 / 7) + 1e-6)
    _close(group_advantages(rewards, 4, scale="batch"), [b, -b, -b, b, 0, 0, 0, 0])
    _close(group_advantages(rewards, 4, scale="none"), [1, -1, -1, 1, 0, 0, 0, 0])


def test_group_advantages_by_hand_uneven_group():
    # rewards 1, -1, -1 : mean -1/3 ; deviations 4/3, -2/3, -2/3 ; sum sq 24/9 ; var 4/3
    rewards = torch.tensor([1.0, -1.0, -1.0], dtype=F64)
    s = math.sqrt(4 / 3)
    expected = [(4 / 3) / (s + 1e-6), (-2 / 3) / (s + 1e-6), (-2 / 3) / (s + 1e-6)]
    _close(group_advantages(rewards, 3, scale="group"), expected)
    _close(group_advantages(rewards, 3, scale="none"), [4 / 3, -2 / 3, -2 / 3])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("G", [2, 3, 5])
def test_group_advantages_match_loop_reference(scale, G):
    g = torch.Generator().manual_seed(G)
    rewards = torch.randn(4 * G, generator=g, dtype=F64)
    out = group_advantages(rewards, G, scale=scale)
    assert out.shape == (4 * G,)
    _close(out, _ref_group_advantages([float(x) for x in rewards], G, scale))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("value", "G"), [(0.7, 7), (0.1, 16), (-0.83, 5), (0.2, 3), (1.0, 4)])
def test_all_equal_group_gives_exact_zero(scale, dtype, value, G):
    # values such as 0.7 are not representable: a naive (R - mean) / (std + eps) gives
    # e.g. 0.056 in float32 for G=7 instead of 0. The spec requires exactly zero.
    mixed = [1.0, -1.0] + [0.0] * (G - 2)  # a second, non-degenerate group
    rewards = torch.tensor([value] * G + mixed, dtype=dtype)
    out = group_advantages(rewards, G, scale=scale)
    assert not torch.isnan(out).any()
    assert (out[:G] == 0).all(), out[:G].tolist()
    assert (out[G:] != 0).any()
    # the whole batch degenerate (batch std 0 too)
    out = group_advantages(torch.tensor([value] * (2 * G), dtype=dtype), G, scale=scale)
    assert not torch.isnan(out).any()
    assert (out == 0).all(), out.tolist()


def test_group_size_one():
    rewards = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    out = group_advantages(rewards, 1, scale="group")
    _close(out, [0.5 / (1 + 1e-6), -1.0 / (1 + 1e-6), 2.0 / (1 + 1e-6)])
    assert not torch.isnan(out).any()


def test_group_advantages_errors():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="bogus"):
        group_advantages(torch.zeros(8), 4, scale="bogus")


# --------------------------------------------------------------------------------------
# 6. KL estimators
# --------------------------------------------------------------------------------------


def _kl_inputs():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(3, 5, generator=g, dtype=F64) * 5
    ref = logp + torch.randn(3, 5, generator=g, dtype=F64)
    ref[0, 0] = logp[0, 0]  # one position where the two policies agree
    return logp, ref


def test_kl_estimators_match_formulas():
    logp, ref = _kl_inputs()
    k1, k2, k3 = (kl_penalty(logp, ref, kind=k) for k in ("k1", "k2", "k3"))
    for out in (k1, k2, k3):
        assert out.shape == logp.shape
    for i in range(3):
        for t in range(5):
            lp, rf = float(logp[i, t]), float(ref[i, t])
            assert float(k1[i, t]) == pytest.approx(lp - rf, rel=1e-12, abs=1e-15)
            assert float(k2[i, t]) == pytest.approx(0.5 * (lp - rf) ** 2, rel=1e-12, abs=1e-15)
            # pi_ref/pi - log(pi_ref/pi) - 1
            ratio = math.exp(rf) / math.exp(lp)
            expected = ratio - math.log(ratio) - 1
            assert float(k3[i, t]) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    _close(kl_penalty(logp, ref), k3)  # default kind is k3


def test_k3_is_nonnegative_and_zero_when_equal():
    logp, ref = _kl_inputs()
    k3 = kl_penalty(logp, ref, kind="k3")
    assert (k3 >= 0).all()
    assert float(k3[0, 0]) == 0.0
    assert (k3.flatten()[1:] > 0).all()
    assert (kl_penalty(logp, logp.clone(), kind="k3") == 0).all()


def test_kl_unknown_kind():
    logp, ref = _kl_inputs()
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, kind="k4")


# --------------------------------------------------------------------------------------
# 7. Entropy, token log-probs, masked means
# --------------------------------------------------------------------------------------


def test_entropy_uniform_and_peaked():
    V = 11
    uniform = torch.zeros(2, 3, V, dtype=F64)
    _close(entropy_from_logits(uniform), torch.full((2, 3), math.log(V), dtype=F64))
    peaked = torch.full((2, 3, V), -1e4, dtype=F64)
    peaked[..., 4] = 1e4
    h = entropy_from_logits(peaked)
    assert torch.isfinite(h).all()
    assert (h.abs() < 1e-12).all()


def _entropy_logits(dtype):
    g = torch.Generator().manual_seed(11)
    B, T, V = 2, 5, 7
    logits = torch.randn(B, T, V, generator=g, dtype=F64) * 3
    logits[0, 1] = torch.tensor([1e4, -1e4, 1e4, -1e4, -1e4, -1e4, -1e4])  # entropy log 2
    logits[0, 2] = torch.tensor([1e4, 1e4 - 1, 1e4 - 2, -1e4, 1e4 - 0.5, -1e4, 0.0])
    logits[1, 3] = torch.tensor([-1e4, -1e4 + 1, -1e4, -1e4 + 3, -1e4, -1e4, -1e4 + 0.25])
    logits[1, 4] = -1e4  # all equal: uniform, log 7
    return logits.to(dtype)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-9), (torch.float32, 5e-3)])
def test_entropy_matches_explicit_sum_with_large_logits(dtype, tol):
    logits = _entropy_logits(dtype)
    h = entropy_from_logits(logits)
    assert h.shape == logits.shape[:-1]
    assert torch.isfinite(h).all()
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            expected = _ref_entropy([float(x) for x in logits[b, t]])
            assert float(h[b, t]) == pytest.approx(expected, abs=tol), (b, t)
    assert float(h[0, 1]) == pytest.approx(math.log(2), abs=tol)
    assert float(h[1, 4]) == pytest.approx(math.log(7), abs=tol)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4, 7, 1000])
def test_entropy_chunked_equals_unchunked(chunk_size):
    logits = _entropy_logits(F64)
    ref = torch.tensor(
        [[_ref_entropy([float(x) for x in logits[b, t]]) for t in range(5)] for b in range(2)],
        dtype=F64,
    )
    h = entropy_from_logits(logits, chunk_size=chunk_size)
    _close(h, entropy_from_logits(logits, chunk_size=10_000), tol=1e-12)
    _close(h, ref, tol=1e-9)


def test_entropy_two_dim_input():
    logits = _entropy_logits(F64)[0]  # [T, V]
    h = entropy_from_logits(logits, chunk_size=2)
    assert h.shape == (5,)
    for t in range(5):
        assert float(h[t]) == pytest.approx(_ref_entropy([float(x) for x in logits[t]]), abs=1e-9)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-9), (torch.float32, 5e-3)])
def test_token_logprobs_matches_explicit_log_softmax(dtype, tol):
    logits = _entropy_logits(dtype)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 7, (2, 5), generator=g)
    tokens[0, 1] = 1  # a token at -1e4 next to two at +1e4: log p = -2e4 - log 2
    out = token_logprobs(logits, tokens)
    assert out.shape == (2, 5)
    assert torch.isfinite(out).all()
    for b in range(2):
        for t in range(5):
            expected = _ref_log_softmax([float(x) for x in logits[b, t]], int(tokens[b, t]))
            assert float(out[b, t]) == pytest.approx(expected, rel=1e-6, abs=tol), (b, t)
    assert float(out[0, 1]) == pytest.approx(-2e4 - math.log(2), rel=1e-6)


@pytest.mark.parametrize("bool_mask", [False, True])
def test_masked_mean_and_gen_prob(bool_mask):
    g = torch.Generator().manual_seed(9)
    values = torch.randn(3, 4, generator=g, dtype=F64)
    logprobs = -torch.rand(3, 4, generator=g, dtype=F64) * 4
    mask = torch.tensor(RAGGED_MASK, dtype=F64)
    values[mask == 0] = 1e6  # garbage that must be ignored
    logprobs[mask == 0] = 0.0
    m = mask.bool() if bool_mask else mask
    total, p_total, n = 0.0, 0.0, 0
    for i in range(3):
        for t in range(4):
            if RAGGED_MASK[i][t]:
                total += float(values[i, t])
                p_total += math.exp(float(logprobs[i, t]))
                n += 1
    assert float(masked_mean(values, m)) == pytest.approx(total / n, rel=1e-12)
    assert float(gen_prob(logprobs, m)) == pytest.approx(p_total / n, rel=1e-12)


# --------------------------------------------------------------------------------------
# 8. Loss ~ 0 at ratio 1 with zero-mean advantages, yet the gradient is not zero
# --------------------------------------------------------------------------------------


def test_zero_loss_at_ratio_one_still_has_gradient():
    """With one update per rollout (ratio 1) and zero-mean advantages over equally long
    responses the logged loss is ~0, but d loss / d logprob_it = -A_i / N != 0."""
    T = 6
    a = 1 / (math.sqrt(4 / 3) + 1e-6)  # group advantages of rewards 1, -1, -1, 1
    adv = torch.tensor([a, -a, -a, a], dtype=F64)
    old = -torch.rand(4, T, generator=torch.Generator().manual_seed(2), dtype=F64)
    lp = old.clone()  # same policy: ratio exactly 1
    mask = torch.ones(4, T, dtype=F64)
    loss, grad, stats = _loss_and_grad(lp, old, adv, mask)
    assert abs(float(loss)) < 1e-12
    n = 4 * T
    expected = [[-float(adv[i]) / n] * T for i in range(4)]
    _close(grad, expected)
    assert float(grad.abs().min()) > 0.01
    assert float(stats["clip_frac_low"]) == 0.0 and float(stats["clip_frac_high"]) == 0.0
