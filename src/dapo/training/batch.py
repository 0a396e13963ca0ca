"""The unit of training: one response with its advantage, loss mask and log-probs.

:func:`build_samples` turns a batch of scored groups into samples: group-normalised
advantages (``dapo.algorithms.group_advantages``) and loss masks with overlong filtering
(``dapo.rewards.overlong_filter_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dapo import algorithms as alg
from dapo.errors import TrainingError
from dapo.handover import ScoredGroup
from dapo.rewards.shaping import overlong_filter_mask


@dataclass
class Sample:
    """One response ready for training."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    loss_mask: list[float]  # per response token; all 0 for a filtered (truncated) response
    old_logprobs: torch.Tensor | None = None  # [len(response_ids)], trainer's, no grad
    ref_logprobs: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None  # the rollout engine's, for algorithm.is_*
    # Engine-vs-trainer importance weights per response token (algorithm.is_cap), and the
    # tokens they keep (0: dropped by is_mode=mask); None: no correction.
    is_weight: torch.Tensor | None = None
    is_keep: torch.Tensor | None = None
    # Multi-turn: 1 on the tokens the model sampled, 0 on the environment's (which count in
    # no loss, denominator, importance weight or engine comparison); None: all the model's.
    model_mask: list[int] | None = None
    # The policy version that sampled each response token (streaming rollouts), for the
    # log-linear proximal policy (algorithm.proximal_logprobs=loglinear).
    versions: torch.Tensor | None = None
    # On-policy distillation: the per-token advantage [len(response_ids)] that replaces
    # `advantage` in the loss (dapo.algorithms.distill_advantages); None: `advantage`.
    token_advantages: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def sampled(self) -> torch.Tensor:
        """1.0 on the response tokens the model sampled ``[len(response_ids)]``."""
        if self.model_mask is None:
            return torch.ones(len(self.response_ids))
        return torch.tensor(self.model_mask, dtype=torch.float32)

    def train_mask(self) -> torch.Tensor:
        """The tokens that count in the loss ``[len(response_ids)]``: the loss mask (overlong
        filtering) without the tokens dropped by masked importance sampling."""
        mask = torch.tensor(self.loss_mask, dtype=torch.float32)
        return mask if self.is_keep is None else mask * self.is_keep.to(mask)


def build_samples(
    groups: list[ScoredGroup],
    *,
    step: int,
    advantage_scale: str = "group",
    overlong_filter: bool = True,
    keep_engine_logprobs: bool = False,
    exact_sampling_logprobs: bool = True,
) -> list[Sample]:
    """One :class:`Sample` per response of ``groups``, in order; after each group's, the
    earlier segments of its agent episodes (``episode_stats[i]["extra_segments"]``), each
    with its episode's advantage (:func:`group_sizes` counts them).

    ``keep_engine_logprobs`` attaches the engine's sampling log-probs (for the mismatch
    metric and the importance-sampling correction, ``algorithm.is_cap``). A group carried
    over from an earlier step than ``step`` takes its ratio against the policy that
    generated it: its old log-probs are the engine's, when those are the exact sampling
    distribution (``exact_sampling_logprobs``: no top-p / top-k truncation).
    """
    g_size = groups[0].size
    if any(g.size != g_size for g in groups):
        raise TrainingError("all groups of a batch must have the same number of responses")
    rewards = torch.tensor([x for g in groups for x in g.rewards], dtype=torch.float64)
    adv = alg.group_advantages(rewards, g_size, advantage_scale).tolist()
    truncated = torch.tensor([t for g in groups for t in g.truncated])
    keep = torch.ones(len(truncated), 1)
    if overlong_filter:
        keep = overlong_filter_mask(keep, truncated)
    keep_list = keep[:, 0].tolist()
    samples: list[Sample] = []
    logprobs: list[list[float]] = []  # each sample's engine log-probs
    stale: list[bool] = []  # each sample's group was generated before `step`
    k = 0
    for g in groups:
        masks = g.model_mask or [None] * g.size
        factors = []  # each response's loss factor (overlong filtering, failed episodes)
        for j, (resp, lp, model) in enumerate(
            zip(g.response_ids, g.sample_logprobs, masks, strict=True)
        ):
            if model is None:
                factors.append(keep_list[k + j])
                s = Sample(g.prompt_ids, resp, adv[k + j], [factors[j]] * len(resp))
            else:  # environment tokens are in no loss, nor is an episode its environment failed
                failed = g.episode_stats[j]["end"] == "env_failure"
                factors.append(0.0 if failed else keep_list[k + j])
                s = Sample(
                    g.prompt_ids,
                    resp,
                    adv[k + j],
                    [factors[j] * m for m in model],
                    model_mask=model,
                )
            if g.versions is not None:
                s.versions = torch.tensor(g.versions[j], dtype=torch.float32)
            samples.append(s)
            logprobs.append(lp)
        # Agent episodes that rewrote their history: each earlier segment is a sample of
        # its own, with its episode's advantage and loss factor.
        for j, stats in enumerate(g.episode_stats or []):
            for seg in stats.get("extra_segments") or []:
                model = seg["model_mask"]
                samples.append(
                    Sample(
                        seg["prompt_ids"],
                        seg["response_ids"],
                        adv[k + j],
                        [factors[j] * m for m in model],
                        model_mask=model,
                    )
                )
                logprobs.append(seg["logprobs"])
        k += g.size
        stale.extend([g.step < step] * (len(logprobs) - len(stale)))
    for s, lp, old in zip(samples, logprobs, stale, strict=True):
        if keep_engine_logprobs:
            s.sampling_logprobs = torch.tensor(lp)
        if old and exact_sampling_logprobs:
            s.old_logprobs = torch.tensor(lp)
    return samples


def group_sizes(groups: list[ScoredGroup]) -> list[int]:
    """How many samples :func:`build_samples` makes of each group: its responses, and the
    extra segments of agent episodes."""
    return [
        g.size + sum(len(s.get("extra_segments") or []) for s in g.episode_stats or [])
        for g in groups
    ]
