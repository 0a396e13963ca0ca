"""The loss variants of ``dapo.algorithms`` against their papers' formulas.

GSPO (arXiv 2507.18071), CISPO (MiniMax-M1, arXiv 2506.13585), the engine-vs-trainer
importance weights (token / sequence, truncate / mask), the entropy bonus, and Clip-Cov /
KL-Cov (arXiv 2505.22617). Every expected value is either worked out by hand in a comment
or computed by a plain-Python transcription of the paper's formula (loops over floats,
``math.exp`` / ``math.log``), so the reference cannot share a vectorisation bug with the
implementation. Gradients are checked with ``torch.autograd.gradcheck`` in float64 where
the loss is an ordinary function of the log-probs, and against analytic gradients written
here where a stop-gradient makes the loss's value and its gradient different functions.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dapo import algorithms as alg
from dapo.algorithms import LossSettings, compute_loss

F64 = torch.float64


def _close(actual, expected, tol=1e-12):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), rtol=tol, atol=tol
    )


def _batch(seed: int, B: int = 5, T: int = 7, spread: float = 0.3):
    """Random float64 log-probs, old log-probs (ratios around 1), advantages and a ragged mask
    (every row has at least one token)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3.0 - 0.1
    lp = old + spread * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(F64)
    return lp, old, adv, mask


def _rows(t: torch.Tensor) -> list[list[float]]:
    return [[float(x) for x in row] for row in t]


def _grad(fn, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = lp.detach().clone().requires_grad_(True)
    loss = fn(leaf)
    loss.backward()
    return loss.detach(), leaf.grad.detach()


# ======================================================================================
# GSPO
# ======================================================================================


def _ref_gspo(lp, old, adv, mask, eps_low, eps_high):
    """GSPO, eq. (5)-(7) of arXiv 2507.18071, transcribed:
    s_i = exp(1/|y_i| sum_t (log pi - log pi_old)),  J = 1/G sum_i min(s_i A_i, clip(s_i) A_i).
    Returns (loss = -J, d loss / d log pi_it), the gradient derived by hand:
    d s_i / d log pi_it = s_i / |y_i|, and 0 where the clipped term is the one taken."""
    lp, old, m = _rows(lp), _rows(old), _rows(mask)
    G = len(lp)
    loss, grad = 0.0, [[0.0] * len(lp[0]) for _ in range(G)]
    for i in range(G):
        n = sum(m[i])
        s = math.exp(sum((lp[i][t] - old[i][t]) * m[i][t] for t in range(len(lp[i]))) / n)
        a = float(adv[i])
        clipped = min(max(s, 1 - eps_low), 1 + eps_high)
        loss -= min(s * a, clipped * a) / G
        active = not ((a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low))
        for t in range(len(lp[i])):
            if m[i][t] and active:
                grad[i][t] = -a * s / n / G
    return loss, grad


def test_gspo_by_hand() -> None:
    """Response 1: token ratios 1.2 and 1.5, s = sqrt(1.8) = 1.3416 > 1 + 0.2, A = +1: the
    clipped term 1.2 is taken, the loss of the response is -1.2 and its gradient is 0.
    Response 2: one token, ratio 0.9 = s, A = -2: min(-1.8, clip(0.9) * -2 = -1.8) = -1.8,
    loss +1.8 and gradient -A s / |y| = 1.8. Mean over G = 2: (-1.2 + 1.8) / 2 = 0.3."""
    lp = torch.log(torch.tensor([[0.6, 0.3], [0.45, 1.0]], dtype=F64))
    old = torch.log(torch.tensor([[0.5, 0.2], [0.5, 1.0]], dtype=F64))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    adv = torch.tensor([1.0, -2.0], dtype=F64)

    def fn(x):
        loss, _ = alg.policy_loss(
            x, old, adv, mask, kind="gspo", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean"
        )
        return loss

    loss, grad = _grad(fn, lp)
    _close(loss, 0.3)
    _close(grad, [[0.0, 0.0], [1.8 / 2, 0.0]])
    _, stats = alg.policy_loss(
        lp, old, adv, mask, kind="gspo", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean"
    )
    # 2 of the 3 loss tokens belong to the clipped response (upper bound, A > 0).
    _close(stats["clip_frac_high"], 2 / 3)
    _close(stats["clip_frac_low"], 0.0)
    _close(stats["ratio_mean"], (2 * math.sqrt(1.8) + 0.9) / 3)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.05, 0.1), (0.2, 0.28)])
def test_gspo_matches_the_paper_formula_and_its_gradient(seed, eps) -> None:
    lp, old, adv, mask = _batch(seed, spread=0.05 if eps[0] < 0.01 else 0.3)
    ref_loss, ref_grad = _ref_gspo(lp, old, adv, mask, *eps)

    def fn(x):
        return alg.policy_loss(
            x,
            old,
            adv,
            mask,
            kind="gspo",
            clip_low=eps[0],
            clip_high=eps[1],
            agg="seq-mean-token-mean",
        )[0]

    loss, grad = _grad(fn, lp)
    _close(loss, ref_loss)
    _close(grad, ref_grad)


def test_gspo_gradcheck() -> None:
    """GSPO-token's stop-gradients leave the value and the gradient of the sequence
    objective (the two forms are equal), so finite differences agree with autograd."""
    lp, old, adv, mask = _batch(11, B=3, T=4, spread=0.1)
    assert torch.autograd.gradcheck(
        lambda x: alg.policy_loss(
            x, old, adv, mask, kind="gspo", clip_low=0.05, clip_high=0.08, agg="seq-mean-token-mean"
        )[0],
        (lp.clone().requires_grad_(True),),
    )


def test_gspo_ratio_is_one_per_response_and_ignores_masked_tokens() -> None:
    lp, old, adv, mask = _batch(3)
    lp2 = lp.clone()
    lp2[mask == 0] += 5.0  # padding / filtered tokens must not move s_i
    a = alg.policy_loss(lp, old, adv, mask, kind="gspo", agg="seq-mean-token-mean")[0]
    b = alg.policy_loss(lp2, old, adv, mask, kind="gspo", agg="seq-mean-token-mean")[0]
    _close(a, b)


# ======================================================================================
# CISPO
# ======================================================================================


def _ref_cispo(lp, old, adv, mask, eps_low, eps_high):
    """CISPO, eq. (4)-(5) of arXiv 2506.13585, transcribed:
    J = 1/sum_i |o_i| sum_i sum_t sg(r^_it) A_i log pi_it, r^ = clip(r, 1 - eps_low, 1 + eps_high).
    Returns (-J, d(-J)/d log pi_it = -r^_it A_i / N): sg makes r^ a constant."""
    lp, old, m = _rows(lp), _rows(old), _rows(mask)
    n = sum(sum(row) for row in m)
    loss, grad = 0.0, [[0.0] * len(lp[0]) for _ in lp]
    for i in range(len(lp)):
        for t in range(len(lp[i])):
            if not m[i][t]:
                continue
            r = math.exp(lp[i][t] - old[i][t])
            w = min(max(r, 1 - eps_low), 1 + eps_high)
            loss -= w * float(adv[i]) * lp[i][t] / n
            grad[i][t] = -w * float(adv[i]) / n
    return loss, grad


def test_cispo_by_hand() -> None:
    """One token: r = 1.5, eps_high 0.2, so r^ = 1.2; A = 2; log pi = ln 0.5:
    loss = -1.2 * 2 * ln 0.5 = 1.6635532333438687, gradient -r^ A = -2.4 (not 0: CISPO keeps
    the gradient of a token that PPO's clip would drop)."""
    lp = torch.log(torch.tensor([[0.5]], dtype=F64))
    old = torch.log(torch.tensor([[0.5 / 1.5]], dtype=F64))
    mask = torch.ones(1, 1, dtype=F64)
    adv = torch.tensor([2.0], dtype=F64)
    loss, grad = _grad(
        lambda x: alg.policy_loss(x, old, adv, mask, kind="cispo", clip_low=1.0, clip_high=0.2)[0],
        lp,
    )
    _close(loss, 1.6635532333438687)
    _close(grad, [[-2.4]])
    ppo_loss, ppo_grad = _grad(
        lambda x: alg.policy_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.2)[0], lp
    )
    _close(ppo_grad, [[0.0]])  # the contrast: PPO's clip drops this token's gradient


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("eps", [(1.0, 4.0), (0.2, 0.28), (10.0, 0.05)])
def test_cispo_matches_the_paper_formula_and_its_gradient(seed, eps) -> None:
    lp, old, adv, mask = _batch(seed, spread=0.5)
    ref_loss, ref_grad = _ref_cispo(lp, old, adv, mask, *eps)
    loss, grad = _grad(
        lambda x: alg.policy_loss(
            x, old, adv, mask, kind="cispo", clip_low=eps[0], clip_high=eps[1]
        )[0],
        lp,
    )
    _close(loss, ref_loss)
    _close(grad, ref_grad)


def test_cispo_clip_fractions_count_truncated_weights_whatever_the_advantage_sign() -> None:
    ratios = torch.tensor([[0.5, 0.9, 1.1, 1.6]], dtype=F64)
    old = torch.full((1, 4), -1.0, dtype=F64)
    lp = old + torch.log(ratios)
    mask = torch.ones(1, 4, dtype=F64)
    for a in (1.0, -1.0):
        _, stats = alg.policy_loss(
            lp, old, torch.tensor([a], dtype=F64), mask, kind="cispo", clip_low=0.2, clip_high=0.28
        )
        _close(stats["clip_frac_low"], 0.25)  # 0.5 < 0.8
        _close(stats["clip_frac_high"], 0.25)  # 1.6 > 1.28


def test_registry_matches_the_config_choices() -> None:
    assert tuple(alg.REGISTRY) == alg.POLICY_LOSSES == ("ppo", "gspo", "cispo")
    with pytest.raises(ValueError, match="unknown policy loss"):
        alg.policy_loss(*_batch(0)[:4], kind="grpo")


# ======================================================================================
# Engine-vs-trainer importance weights
# ======================================================================================


def _ref_is(old, samp, mask, cap, level, mode):
    """rho_t = pi_old / pi_engine = exp(old_t - samp_t); sequence: rho_i = prod_t rho_t.
    truncate: w = min(rho, C); mask: w = rho, dropped (w = 0, keep = 0) where rho > C."""
    old, samp, m = _rows(old), _rows(samp), _rows(mask)
    W, K = [], []
    for i in range(len(old)):
        if level == "sequence":
            prod = 1.0
            for t in range(len(old[i])):
                if m[i][t]:
                    prod *= math.exp(old[i][t] - samp[i][t])
            rhos = [prod] * len(old[i])
        else:
            rhos = [math.exp(old[i][t] - samp[i][t]) for t in range(len(old[i]))]
        w_row, k_row = [], []
        for t, rho in enumerate(rhos):
            if not m[i][t]:
                w_row.append(0.0)
                k_row.append(0.0)
            elif mode == "truncate":
                w_row.append(min(rho, cap))
                k_row.append(1.0)
            else:
                w_row.append(rho if rho <= cap else 0.0)
                k_row.append(1.0 if rho <= cap else 0.0)
        W.append(w_row)
        K.append(k_row)
    return W, K


def test_is_weights_by_hand() -> None:
    """Two tokens with rho 2.5 and 1.6: token/truncate C=2 -> [2, 1.6]; token/mask -> [0, 1.6]
    (first dropped); sequence: rho = 2.5 * 1.6 = 4 on both -> truncate [2, 2], mask [0, 0]."""
    samp = torch.log(torch.tensor([[0.2, 0.5]], dtype=F64))
    old = torch.log(torch.tensor([[0.5, 0.8]], dtype=F64))
    mask = torch.ones(1, 2, dtype=F64)
    cases = {
        ("token", "truncate"): ([2.0, 1.6], [1, 1]),
        ("token", "mask"): ([0.0, 1.6], [0, 1]),
        ("sequence", "truncate"): ([2.0, 2.0], [1, 1]),
        ("sequence", "mask"): ([0.0, 0.0], [0, 0]),
    }
    for (level, mode), (w, keep) in cases.items():
        got_w, got_keep, over = alg.is_weights(old, samp, mask, cap=2.0, level=level, mode=mode)
        _close(got_w, [w])
        _close(got_keep, [keep])
        _close(over, [[1.0, 0.0]] if level == "token" else [[1.0, 1.0]])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_is_weights_match_the_transcription(level, mode) -> None:
    g = torch.Generator().manual_seed(5)
    _, old, _, mask = _batch(7, B=6, T=5)
    samp = old + 0.4 * torch.randn(old.shape, generator=g, dtype=F64)
    w, keep, _ = alg.is_weights(old, samp, mask, cap=1.5, level=level, mode=mode)
    ref_w, ref_keep = _ref_is(old, samp, mask, 1.5, level, mode)
    _close(w, ref_w)
    _close(keep, ref_keep)
    assert (keep[mask > 0] == 0).any() == (mode == "mask")  # the data does cross the cap


# ======================================================================================
# Entropy bonus
# ======================================================================================


def test_token_entropy_values_and_gradcheck() -> None:
    uniform = torch.zeros(1, 4, dtype=F64)
    _close(alg.token_entropy(uniform), [math.log(4)])
    # p = (0.5, 0.25, 0.25): H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2.
    _close(
        alg.token_entropy(torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=F64))),
        [1.5 * math.log(2)],
    )
    logits = torch.randn(2, 3, 5, dtype=F64, generator=torch.Generator().manual_seed(0))
    _close(alg.token_entropy(logits), alg.entropy_from_logits(logits))
    assert torch.autograd.gradcheck(alg.token_entropy, (logits.requires_grad_(True),))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_entropy_bonus_is_subtracted_with_the_policy_loss_normalisation(agg) -> None:
    lp, old, adv, mask = _batch(2)
    ent = torch.rand(lp.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    base = LossSettings(loss_agg=agg, max_len=9)
    with_bonus = LossSettings(loss_agg=agg, max_len=9, entropy_coef=0.01)
    plain, _ = compute_loss(lp, old, adv, mask, base, denominator=17.0)
    loss, stats = compute_loss(lp, old, adv, mask, with_bonus, denominator=17.0, entropy=ent)
    h = alg.aggregate_loss(ent, mask, agg, num_tokens=17.0, max_len=9)
    _close(loss, plain - 0.01 * h)
    _close(stats["entropy_bonus"], 0.01 * h)
    if agg == "token-mean":  # by hand: sum of masked entropies / 17
        _close(h, float((ent * mask).sum()) / 17.0)
    with pytest.raises(ValueError, match="entropy"):
        compute_loss(lp, old, adv, mask, with_bonus)


# ======================================================================================
# Clip-Cov and KL-Cov
# ======================================================================================


def _ref_covariance(lp, adv, mask):
    """Cov(y_t) = (log pi(y_t) - 1/N sum_j log pi(y_j)) * (A(y_t) - 1/N sum_j A(y_j)) over the
    N loss tokens of the batch (arXiv 2505.22617, section 4)."""
    lp, m = _rows(lp), _rows(mask)
    toks = [(i, t) for i in range(len(lp)) for t in range(len(lp[i])) if m[i][t]]
    n = len(toks)
    mean_lp = sum(lp[i][t] for i, t in toks) / n
    mean_a = sum(float(adv[i]) for i, _ in toks) / n
    return {(i, t): (lp[i][t] - mean_lp) * (float(adv[i]) - mean_a) for i, t in toks}


def test_covariance_by_hand() -> None:
    """Tokens (log pi, A): (-1, 1), (-3, 1), (-2, -1). Means: log pi -2, A 1/3.
    Cov = (1)(2/3), (-1)(2/3), (0)(-4/3) = 2/3, -2/3, 0; the masked fourth token is 0."""
    lp = torch.tensor([[-1.0, -3.0], [-2.0, -9.0]], dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    _close(alg.token_covariance(lp, adv, mask), [[2 / 3, -2 / 3], [0.0, 0.0]])


def test_selection_count_is_the_papers() -> None:
    assert alg.selection_count(10_000, 2e-4) == 2  # int(r N)
    assert alg.selection_count(100, 2e-4) == 1  # at least one token
    assert alg.selection_count(0, 2e-4) == 0


@pytest.mark.parametrize("seed", range(5))
def test_kl_cov_selects_the_top_k_by_covariance(seed) -> None:
    lp, _, adv, mask = _batch(seed, B=6, T=8)
    ratio = 0.1
    cov = _ref_covariance(lp, adv, mask)
    k = max(int(ratio * len(cov)), 1)
    top = sorted(cov, key=lambda it: (-cov[it], it))[:k]  # ties: row-major order
    got = alg.kl_cov_select(lp, adv, mask, ratio=ratio)
    assert sorted(map(tuple, got.nonzero().tolist())) == sorted(top)
    for (i, t), c in cov.items():
        _close(alg.token_covariance(lp, adv, mask)[i, t], c)


@pytest.mark.parametrize("seed", range(5))
def test_clip_cov_selects_random_tokens_inside_the_window(seed) -> None:
    lp, _, adv, mask = _batch(seed, B=8, T=10, spread=0.0)
    priority = torch.rand(lp.shape, dtype=F64, generator=torch.Generator().manual_seed(seed))
    cov = _ref_covariance(lp, adv, mask)
    low, high, ratio = 0.05, 0.8, 0.05
    candidates = [it for it, c in cov.items() if low < c < high]
    k = max(int(ratio * len(cov)), 1)
    expected = sorted(candidates, key=lambda it: float(priority[it]))[:k]  # random k of them
    got = alg.clip_cov_select(lp, adv, mask, priority, ratio=ratio, low=low, high=high)
    assert len(candidates) > k  # a real choice was made
    assert sorted(map(tuple, got.nonzero().tolist())) == sorted(expected)
    # Fewer candidates than k: all of them.
    got = alg.clip_cov_select(lp, adv, mask, priority, ratio=1.0, low=low, high=high)
    assert sorted(map(tuple, got.nonzero().tolist())) == sorted(candidates)


def test_clip_cov_draw_is_uniform_among_candidates() -> None:
    """Over many random priorities each of 6 candidates is chosen about k/6 of the time."""
    keys_cov = torch.tensor([[2.0, 2.0, 2.0, 0.5, 2.0, 2.0, 2.0, 9.0]], dtype=F64)
    mask = torch.ones_like(keys_cov)
    counts = torch.zeros(8)
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        keys = alg.clip_cov_keys(
            keys_cov, mask, torch.rand(1, 8, generator=g, dtype=F64), low=1.0, high=5.0
        )
        counts += alg.top_k_mask(keys, 2)[0].float()
    assert counts[3] == 0 and counts[7] == 0  # outside the window (0.5 <= 1, 9 >= 5)
    share = counts[[0, 1, 2, 4, 5, 6]] / 3000
    assert torch.allclose(share, torch.full((6,), 2 / 6), atol=0.04)


def test_clip_cov_loss_drops_exactly_the_selected_tokens() -> None:
    """L = PPO's per-token term except 0 on I_clip: the selected tokens' gradient is 0, every
    other token's is PPO's."""
    lp, old, adv, mask = _batch(4, spread=0.1)
    selected = torch.zeros_like(mask, dtype=torch.bool)
    selected[0, 0] = selected[2, 0] = True
    settings = LossSettings(entropy_control="clip_cov", clip_low=1.0, clip_high=1.0)
    loss, grad = _grad(
        lambda x: compute_loss(x, old, adv, mask, settings, selected=selected)[0], lp
    )
    keep = mask * (~selected).to(F64)
    ref_loss, ref_grad = _grad(
        lambda x: alg.aggregate_loss(
            alg.ppo_token_loss(x, old, adv[:, None], mask, clip_low=1.0, clip_high=1.0)[0] * keep,
            mask,
        ),
        lp,
    )
    _close(loss, ref_loss)
    _close(grad, ref_grad)
    assert grad[0, 0] == 0 and grad[2, 0] == 0 and grad[1, 0] != 0
    # The paper's formula: with a clip range of 1 and ratios near 1 the term is -r A.
    n = float(mask.sum())
    by_hand = sum(
        -math.exp(float(lp[i, t] - old[i, t])) * float(adv[i]) / n
        for i in range(lp.shape[0])
        for t in range(lp.shape[1])
        if keep[i, t]
    )
    _close(loss, by_hand)


def test_clip_cov_keeps_the_dual_clip() -> None:
    """Clip-Cov is PPO's clipped surrogate with tokens dropped, so algorithm.clip_c bounds it
    too. By hand, A = -1, c = 3: a token at ratio 10 has -min(10 A, 1.28 A) = 10, dual-clipped
    to min(10, c) = 3 with no gradient; a token at ratio 1 keeps -r A = 1 and gradient
    dL/dlogp = -r A = 1 (each divided by the 2 tokens of the token mean)."""
    lp = torch.tensor([[math.log(10.0), 0.0]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    adv = torch.tensor([-1.0], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    none = torch.zeros(1, 2, dtype=torch.bool)
    settings = LossSettings(entropy_control="clip_cov", clip_low=0.2, clip_high=0.28, clip_c=3.0)
    loss, _ = compute_loss(lp, old, adv, mask, settings, selected=none)
    loss.backward()
    _close(loss, (3.0 + 1.0) / 2)
    _close(lp.grad, torch.tensor([[0.0, 0.5]], dtype=F64))


def test_kl_cov_loss_and_gradient() -> None:
    """L_t = -r_t A + beta |log pi_t - log pi_old_t| on I_KL, -r_t A elsewhere (no clipping);
    d/d log pi_t = -r_t A + beta sign(log r_t) on I_KL."""
    lp, old, adv, mask = _batch(6, spread=0.6)
    selected = alg.kl_cov_select(old, adv, mask, ratio=0.2)
    assert selected.sum() >= 2
    beta = 0.7
    settings = LossSettings(entropy_control="kl_cov", kl_cov_coef=beta)
    loss, grad = _grad(
        lambda x: compute_loss(x, old, adv, mask, settings, selected=selected)[0], lp
    )
    L, m, o, s = _rows(lp), _rows(mask), _rows(old), _rows(selected.to(F64))
    n = sum(sum(row) for row in m)
    ref_loss, ref_grad = 0.0, [[0.0] * len(L[0]) for _ in L]
    for i in range(len(L)):
        for t in range(len(L[i])):
            if not m[i][t]:
                continue
            r, a = math.exp(L[i][t] - o[i][t]), float(adv[i])
            ref_loss += (-r * a + beta * abs(L[i][t] - o[i][t]) * s[i][t]) / n
            ref_grad[i][t] = (-r * a + beta * math.copysign(1.0, L[i][t] - o[i][t]) * s[i][t]) / n
    _close(loss, ref_loss)
    _close(grad, ref_grad)
    assert torch.autograd.gradcheck(
        lambda x: compute_loss(x, old, adv, mask, settings, selected=selected)[0],
        (lp.clone().requires_grad_(True),),
    )


def test_compute_loss_weights_the_policy_term_by_is_weights() -> None:
    lp, old, adv, mask = _batch(8)
    w = torch.rand(lp.shape, dtype=F64, generator=torch.Generator().manual_seed(2)) + 0.5
    for kind in alg.POLICY_LOSSES:
        settings = LossSettings(policy_loss=kind, loss_agg="seq-mean-token-mean")
        loss, _ = compute_loss(lp, old, adv, mask, settings, is_weights=w)
        per_token, _ = alg.REGISTRY[kind](
            lp, old, adv[:, None], mask, clip_low=0.2, clip_high=0.28, clip_c=None
        )
        _close(loss, alg.aggregate_loss(per_token * w, mask, "seq-mean-token-mean"))


def test_random_total_order_top_k() -> None:
    rng = random.Random(0)
    keys = torch.tensor([[rng.choice([1.0, 2.0, -math.inf]) for _ in range(6)] for _ in range(3)])
    flat = [(-float(v), n) for n, v in enumerate(keys.reshape(-1)) if math.isfinite(v)]
    for k in range(0, 20, 3):
        want = {n for _, n in sorted(flat)[:k]}
        got = set(alg.top_k_mask(keys, k).reshape(-1).nonzero()[:, 0].tolist())
        assert got == want
