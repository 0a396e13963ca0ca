"""The algorithm core: pure functions on tensors, no I/O, no globals.

Notation follows the DAPO paper (arXiv 2503.14476). A batch holds B responses laid out
group after group (rows ``k*G .. k*G+G-1`` are prompt k's G responses); per-token tensors
are ``[B, T]`` with a ``mask`` that is 1 on the response tokens that count in the loss.

One module per concept: :mod:`.advantages`, :mod:`.aggregation` (the loss normalisations),
:mod:`.policy_loss` (ppo, gspo, cispo behind one contract), :mod:`.corrections`
(engine-vs-trainer importance weights), :mod:`.entropy` (entropy, Clip-Cov, KL-Cov),
:mod:`.kl`, :mod:`.logprobs`, :mod:`.distill` (a teacher's per-token advantage), and :mod:`.objective`, which combines them into the loss of a
micro-batch. Their public names are re-exported here
(``from dapo import algorithms as alg; alg.policy_loss(...)``).
"""

from dapo.algorithms.advantages import EPS, group_advantages
from dapo.algorithms.aggregation import aggregate_loss, masked_mean, masked_sum
from dapo.algorithms.corrections import is_weights, loglinear_proximal
from dapo.algorithms.distill import distill_advantages, distill_metrics, distill_sums
from dapo.algorithms.entropy import (
    clip_cov_keys,
    clip_cov_select,
    clip_cov_token_loss,
    entropy_from_logits,
    kl_cov_keys,
    kl_cov_select,
    kl_cov_token_loss,
    selection_count,
    token_covariance,
    token_entropy,
    top_k_mask,
)
from dapo.algorithms.kl import kl_penalty
from dapo.algorithms.logprobs import gen_prob, token_logprobs
from dapo.algorithms.objective import LOSS_PARTS, LossSettings, compute_loss
from dapo.algorithms.policy_loss import (
    REGISTRY,
    TokenLossFn,
    cispo_token_loss,
    gspo_token_loss,
    policy_loss,
    ppo_token_loss,
)
from dapo.choices import (  # the names of the variants (one source, shared with config)
    ADVANTAGE_SCALES,
    ENTROPY_CONTROLS,
    IS_LEVELS,
    IS_MODES,
    KL_KINDS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "ENTROPY_CONTROLS",
    "EPS",
    "IS_LEVELS",
    "IS_MODES",
    "KL_KINDS",
    "LOSS_PARTS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "REGISTRY",
    "LossSettings",
    "TokenLossFn",
    "aggregate_loss",
    "cispo_token_loss",
    "clip_cov_keys",
    "clip_cov_select",
    "clip_cov_token_loss",
    "compute_loss",
    "distill_advantages",
    "distill_metrics",
    "distill_sums",
    "entropy_from_logits",
    "gen_prob",
    "group_advantages",
    "gspo_token_loss",
    "is_weights",
    "loglinear_proximal",
    "kl_cov_keys",
    "kl_cov_select",
    "kl_cov_token_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "ppo_token_loss",
    "selection_count",
    "token_covariance",
    "token_entropy",
    "token_logprobs",
    "top_k_mask",
]
