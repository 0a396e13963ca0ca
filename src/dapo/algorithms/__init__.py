"""The algorithm core: pure functions on tensors, no I/O, no globals.

Notation follows the DAPO paper (arXiv 2503.14476). A batch holds B responses laid out
group after group (rows ``k*G .. k*G+G-1`` are prompt k's G responses); per-token tensors
are ``[B, T]`` with a ``mask`` that is 1 on the response tokens that count in the loss.

One module per concept: :mod:`.advantages`, :mod:`.aggregation` (the loss normalisations),
:mod:`.policy_loss`, :mod:`.kl`, :mod:`.entropy`, :mod:`.logprobs`. Their public names are
re-exported here (``from dapo import algorithms as alg; alg.policy_loss(...)``).
"""

from dapo.algorithms.advantages import EPS, group_advantages
from dapo.algorithms.aggregation import aggregate_loss, masked_mean, masked_sum
from dapo.algorithms.entropy import entropy_from_logits
from dapo.algorithms.kl import kl_penalty
from dapo.algorithms.logprobs import gen_prob, token_logprobs
from dapo.algorithms.policy_loss import policy_loss
from dapo.choices import (  # the names of the variants (one source, shared with config)
    ADVANTAGE_SCALES,
    KL_KINDS,
    LOSS_AGG_MODES,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "EPS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "entropy_from_logits",
    "gen_prob",
    "group_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "token_logprobs",
]
