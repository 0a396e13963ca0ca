"""Per-token weights and selections that must be known before the micro-batches run, and the
engine-vs-trainer log-prob comparison.

- :func:`attach_is_weights`: the engine-vs-trainer importance weights of a rollout step's
  samples (``algorithm.is_*``). Masked IS drops tokens from the loss, so it must run before
  the loss denominators are counted; it needs only the old and the engine's log-probs.
- :func:`cov_selection`: the Clip-Cov / KL-Cov token selection of one mini-batch
  (``algorithm.entropy_control``), made over the *whole* mini-batch on all ranks: global
  means, a global count and a global top-k with a total order (key, then sample index in
  the mini-batch, then position) and per-sample random draws seeded by the sample's index,
  so the same tokens are chosen whatever the micro-batch split and the number of ranks.
  It uses the old policy's log-probs, the ones known before the micro-batches (equal to
  the current policy's at the first update of a rollout step; verl selects per
  micro-batch from the current ones, which is not split-invariant).

- :func:`logprob_mismatch`: ``rollout/logprob_mismatch`` and ``rollout/mismatch_kl``, how
  far the engine's sampling log-probs are from the trainer's.

The maths is in :mod:`dapo.algorithms` (``is_weights``, ``token_covariance``,
``clip_cov_keys``, ``kl_cov_keys``, ``selection_count``); this module gathers across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dapo import algorithms as alg
from dapo.algorithms import LossSettings
from dapo.errors import TrainingError
from dapo.parallel.distributed import all_gather_objects, all_reduce_sum
from dapo.seeding import mix_seed
from dapo.training.batch import Sample


def attach_is_weights(samples: Sequence[Sample], settings: LossSettings) -> dict[str, float]:
    """Set ``is_weight`` and ``is_keep`` of every sample that has both the engine's and the
    trainer's old log-probs; the correction's metrics over all ranks.

    ``rollout/is_weight_mean``: mean weight over the loss tokens kept; ``rollout/is_truncated_frac``
    (``is_mode=truncate``) or ``rollout/is_masked_frac`` (``mask``): the share of loss tokens
    (``is_level=token``) or of responses with loss tokens (``sequence``, ``geometric``) above
    ``is_cap``.
    """
    if settings.is_cap is None:
        return {}
    weight_sum = kept = over = total = 0.0
    for s in samples:
        if s.sampling_logprobs is None or s.old_logprobs is None:
            continue
        w, keep, above = alg.is_weights(
            s.old_logprobs[None].double(),
            s.sampling_logprobs[None],
            s.sampled()[None],
            cap=settings.is_cap,
            level=settings.is_level,
            mode=settings.is_mode,
        )
        s.is_weight, s.is_keep = w[0].to(s.old_logprobs.dtype), keep[0]
        loss = torch.tensor(s.loss_mask, dtype=torch.float64)
        weight_sum += float((w[0] * keep[0] * loss).sum())
        kept += float((keep[0] * loss).sum())
        if settings.is_level == "token":
            over += float((above[0] * loss).sum())
            total += float(loss.sum())
        elif loss.sum() > 0:
            over += float(above[0, 0])
            total += 1.0
    weight_sum, kept, over, total = all_reduce_sum([weight_sum, kept, over, total])
    if not total:
        return {}
    share = (
        "rollout/is_truncated_frac" if settings.is_mode == "truncate" else "rollout/is_masked_frac"
    )
    return {"rollout/is_weight_mean": weight_sum / max(kept, 1.0), share: over / total}


def logprob_mismatch(
    samples: Sequence[Sample], trainer: Sequence[torch.Tensor]
) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the trainer's, over the response
    tokens the model sampled (an environment's tokens were not sampled: they do not count),
    all ranks together (``trainer``: each sample's log-probs under the trainer's forward):

    - ``rollout/logprob_mismatch``: the mean ``|log pi_engine - log pi_trainer|``;
    - ``rollout/mismatch_kl``: the k3 estimate of ``KL(pi_engine || pi_trainer)`` from the
      engine's own samples, the mean of ``r - 1 - log r`` with ``r = pi_trainer / pi_engine``
      (unbiased, never negative; :func:`dapo.algorithms.kl_penalty`'s ``k3``);
    - ``rollout/logprob_ratio_p001`` and ``_p999``: the 0.1th and 99.9th percentiles of the
      per-token ``r`` (a mean hides a few tokens far off), and ``rollout/logprob_ratio_outside``:
      the share of tokens with ``r`` outside ``[0.8, 1.25]``.

    Nothing when no sample has the engine's log-probs."""
    gap_sum = kl_sum = count = 0.0
    log_ratios: list[torch.Tensor] = []
    for s, lp in zip(samples, trainer, strict=True):
        if s.sampling_logprobs is None:
            continue
        trainer_lp = lp.detach().double().cpu()
        engine_lp = s.sampling_logprobs.to(trainer_lp)
        sampled = s.sampled().to(trainer_lp)
        gap_sum += float(((engine_lp - trainer_lp).abs() * sampled).sum())
        kl_sum += float((alg.kl_penalty(engine_lp, trainer_lp, "k3") * sampled).sum())
        count += float(sampled.sum())
        log_ratios.append((trainer_lp - engine_lp)[sampled.bool()])
    gap_sum, kl_sum, n = all_reduce_sum([gap_sum, kl_sum, count])
    if not n:
        return {}
    mine = torch.cat(log_ratios) if log_ratios else torch.zeros(0, dtype=torch.float64)
    ratio = torch.cat(all_gather_objects(mine)).exp()  # every rank's tokens
    low, high = torch.quantile(ratio, torch.tensor([0.001, 0.999], dtype=ratio.dtype)).tolist()
    outside = (ratio < 0.8) | (ratio > 1.25)
    return {
        "rollout/logprob_mismatch": gap_sum / n,
        "rollout/mismatch_kl": kl_sum / n,
        "rollout/logprob_ratio_p001": low,
        "rollout/logprob_ratio_p999": high,
        "rollout/logprob_ratio_outside": float(outside.double().mean()),
    }


def cov_selection(
    samples: Sequence[Sample], ids: Sequence[int], settings: LossSettings, *, seed: int
) -> tuple[list[torch.Tensor | None], dict[str, float]]:
    """The Clip-Cov / KL-Cov selection of this rank's ``samples`` (``ids``: their indices in
    the mini-batch, the same on every rank), as one bool tensor per sample, and
    ``actor/cov_selected_frac`` (selected / loss tokens of the mini-batch). Every rank of the
    mini-batch must call it (it gathers)."""
    if settings.entropy_control == "none":
        return [None] * len(samples), {}
    if any(s.old_logprobs is None for s in samples):
        raise TrainingError(
            "algorithm.entropy_control needs the old policy's log-probs of every sample"
        )
    masks = [s.train_mask().double() for s in samples]
    # Global means, summed exactly in mini-batch order: the same bits on any number of ranks.
    parts = [
        (
            i,
            float(m.sum()),
            float((s.old_logprobs.double() * m).sum()),
            s.advantage * float(m.sum()),
        )
        for i, s, m in zip(ids, samples, masks, strict=True)
    ]
    everything = sorted(p for rank in all_gather_objects(parts) for p in rank)
    n_tokens = math.fsum(p[1] for p in everything)
    if n_tokens == 0:
        return [None] * len(samples), {"actor/cov_selected_frac": 0.0}
    mean_lp = math.fsum(p[2] for p in everything) / n_tokens
    mean_adv = math.fsum(p[3] for p in everything) / n_tokens
    if settings.entropy_control == "clip_cov":
        k = alg.selection_count(n_tokens, settings.clip_cov_ratio)
    else:
        k = alg.selection_count(n_tokens, settings.kl_cov_ratio)
    keys = []
    for i, s, m in zip(ids, samples, masks, strict=True):
        adv = torch.full((1,), s.advantage, dtype=torch.float64)
        cov = alg.token_covariance(
            s.old_logprobs[None].double(),
            adv,
            m[None],
            mean_logprob=mean_lp,
            mean_advantage=mean_adv,
        )[0]
        if settings.entropy_control == "clip_cov":
            gen = torch.Generator().manual_seed(mix_seed(seed, i))
            priority = torch.rand(len(s.response_ids), generator=gen, dtype=torch.float64)
            keys.append(
                alg.clip_cov_keys(
                    cov, m, priority, low=settings.clip_cov_low, high=settings.clip_cov_high
                )
            )
        else:
            keys.append(alg.kl_cov_keys(cov, m))
    chosen = _global_top_k(keys, ids, k)
    selected = [torch.zeros(len(s.response_ids), dtype=torch.bool) for s in samples]
    where = {i: j for j, i in enumerate(ids)}
    for i, t in chosen:
        if i in where:
            selected[where[i]][t] = True
    return selected, {"actor/cov_selected_frac": len(chosen) / n_tokens}


def _global_top_k(keys: list[torch.Tensor], ids: Sequence[int], k: int) -> list[tuple[int, int]]:
    """``(sample index, position)`` of the ``k`` largest finite keys over all ranks, ties
    broken by sample index then position."""
    best: list[tuple[float, int, int]] = []
    if keys and k > 0:  # this rank's candidates for the global top k
        order = sorted(range(len(ids)), key=lambda j: ids[j])
        flat = torch.cat([keys[j] for j in order])
        owner = torch.cat([torch.full((keys[j].numel(),), ids[j]) for j in order])
        pos = torch.cat([torch.arange(keys[j].numel()) for j in order])
        top = torch.sort(-flat, stable=True).indices[:k]  # stable: ties in (index, position) order
        top = top[torch.isfinite(flat[top])]
        best = list(zip((-flat[top]).tolist(), owner[top].tolist(), pos[top].tolist(), strict=True))
    merged = sorted(c for rank in all_gather_objects(best) for c in rank)[:k]
    return [(i, t) for _, i, t in merged]
