"""How a rollout step's samples are cut and normalised: optimizer updates (mini-batches),
micro-batches, the global loss denominator, and the tensors of one micro-batch.

The loss of a mini-batch is normalised by a denominator of the *whole* mini-batch (for
``token-mean``, its number of loss tokens after overlong filtering and IS masking, summed
over ranks), computed once before any micro-batch runs. Each micro-batch then contributes
``sum(loss tokens) / global`` and the accumulated gradient equals the one of a single pass
over the whole mini-batch, whatever the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from dapo.algorithms import LossSettings
from dapo.data.images import prompt_key
from dapo.errors import TrainingError
from dapo.models.inputs import left_pad, right_pad
from dapo.training.batch import Sample


def plan_updates(
    n_samples: int,
    group_size: int | Sequence[int],
    prompts_per_step: int,
    mini_batch_size: int,
    epochs: int,
    *,
    seed: int,
) -> list[tuple[int, list[int]]]:
    """``(epoch, sample indices)`` of every optimizer update of a rollout step: whole groups,
    shuffled per epoch (seeded), cut into mini-batches of ``mini_batch_size`` prompts.

    A full batch (``prompts_per_step`` groups) makes ``prompts_per_step / mini_batch_size``
    updates per epoch. A short batch of ``n`` groups (the round cap with
    ``algorithm.round_cap=train``) makes ``ceil(n / mini_batch_size)`` updates whose sizes
    differ by at most one group (29 groups with mini-batches of 16: 15 + 14, not 16 + 13),
    so no update is a sliver and no sample is used more often than in a full batch. Each
    update is still normalised by its own global token count.

    ``group_size`` may list each group's number of consecutive samples instead (agent
    episodes add a sample per extra segment: :func:`dapo.training.batch.group_sizes`).
    """
    if isinstance(group_size, int):
        n_groups, rest = divmod(n_samples, group_size)
        if rest:
            raise TrainingError(f"{n_samples} samples do not make groups of {group_size} responses")
        lengths = [group_size] * n_groups
    else:
        lengths = list(group_size)
        n_groups = len(lengths)
        if sum(lengths) != n_samples:
            raise TrainingError(f"{n_samples} samples are not groups of sizes {lengths}")
    starts = [sum(lengths[:g]) for g in range(n_groups)]
    if n_groups > prompts_per_step:
        raise TrainingError(f"{n_groups} groups exceed train.prompts_per_step={prompts_per_step}")
    count = n_updates(n_groups, mini_batch_size)
    base, extra = divmod(n_groups, max(count, 1))
    sizes = [base + (m < extra) for m in range(count)]
    gen = torch.Generator().manual_seed(seed)
    plan = []
    for epoch in range(epochs):
        order = torch.randperm(n_groups, generator=gen).tolist()
        start = 0
        for size in sizes:
            gids = order[start : start + size]
            start += size
            plan.append((epoch, [starts[g] + j for g in gids for j in range(lengths[g])]))
    return plan


def n_updates(n_groups: int, mini_batch_size: int) -> int:
    """Updates per epoch for ``n_groups`` groups: ``prompts_per_step / mini_batch_size`` for a
    full batch, ``ceil(n / mini_batch_size)`` for a short one."""
    return -(-n_groups // mini_batch_size)


def loss_denominator(samples: Sequence[Sample], settings: LossSettings) -> float:
    """The normaliser of a mini-batch for the configured aggregation.

    ``token-mean``: loss tokens (masked ones do not count: truncated responses under
    overlong filtering, tokens or responses dropped by masked importance sampling,
    environment tokens of multi-turn episodes); ``seq-mean-token-mean``: responses;
    ``seq-mean-token-sum-norm``: responses x L_max. In data-parallel training the caller
    sums this over ranks.
    """
    if settings.loss_agg == "token-mean":
        return float(sum(float(s.train_mask().sum()) for s in samples))
    if settings.loss_agg == "seq-mean-token-mean":
        return float(len(samples))
    return float(len(samples) * settings.max_len)


def micro_batches(
    samples: Sequence[Sample], token_budget: int, *, packed: bool = False
) -> list[list[int]]:
    """Indices of samples split into micro-batches of at most ``token_budget`` padded tokens
    (``packed``: tokens of the packed row, see :func:`packed_micro_batches`).

    Samples are kept in groups (the responses of one prompt), so that a micro-batch
    forwards each of its prompts once (see :func:`dapo.training.forward.response_states`):
    groups sorted by their longest sample fill the micro-batches one after the other, and a
    group is split only when it alone exceeds the budget. Sorting by length keeps padding
    small. The split does not change the result, only the memory and time it takes.
    Samples without response tokens are left out (they have nothing to train).
    """
    if packed:
        return packed_micro_batches(samples, token_budget)
    members = [sorted(g, key=lambda i: samples[i].length) for g in _groups(samples)]
    members.sort(key=lambda g: samples[g[-1]].length)
    chunks: list[list[int]] = []
    current: list[int] = []
    widest = 0
    for group in members:
        longest = samples[group[-1]].length
        together = max(widest, longest) * (len(current) + len(group))
        if current and longest * len(group) <= token_budget < together:
            chunks.append(current)
            current, widest = [], 0
        for i in group:  # all at once unless the group alone exceeds the budget
            w = max(widest, samples[i].length)
            if current and w * (len(current) + 1) > token_budget:
                chunks.append(current)
                current, w = [], samples[i].length
            current.append(i)
            widest = w
    if current:
        chunks.append(current)
    return chunks


def response_widths(response_mask: torch.Tensor) -> list[int]:
    """Each row's response width: one past its last response token (right-padded rows)."""
    columns = torch.arange(1, response_mask.shape[1] + 1)
    return (torch.where(response_mask.cpu() > 0, columns, 0).amax(-1)).tolist()


def _groups(samples: Sequence[Sample]) -> list[list[int]]:
    """Indices of the samples with response tokens (an episode whose environment failed to
    open has none), grouped by prompt in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        if s.response_ids:
            groups.setdefault(tuple(s.prompt_ids), []).append(i)
    return list(groups.values())


def packed_micro_batches(samples: Sequence[Sample], token_budget: int) -> list[list[int]]:
    """Indices of samples split into micro-batches whose packed rows hold at most
    ``token_budget`` tokens: each prompt once, then its responses (verl's
    ``ppo_max_token_len_per_gpu``). Whole groups fill a micro-batch one after the other; a
    group is split only when it alone exceeds the budget, and a sample longer than the budget
    is a micro-batch of its own.
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for group in _groups(samples):
        prompt = len(samples[group[0]].prompt_ids)
        size = prompt + sum(len(samples[i].response_ids) for i in group)
        if current and used + size > token_budget and size <= token_budget:
            chunks.append(current)
            current, used = [], 0
        placed = False  # is the prompt in the current micro-batch?
        for i in group:
            cost = len(samples[i].response_ids) + (0 if placed else prompt)
            if current and used + cost > token_budget:
                chunks.append(current)
                current, used, placed = [], 0, False
                cost = len(samples[i].response_ids) + prompt
            current.append(i)
            used += cost
            placed = True
    if current:
        chunks.append(current)
    return chunks


@dataclass
class MicroBatch:
    """Every tensor one micro-batch needs, collated once: the model's inputs and the loss's.

    ``b`` samples, responses right-padded to ``R`` columns, prompts left-padded to ``P``.
    Optional per-token tensors are None when no sample of the micro-batch has them.
    """

    prompt_ids: torch.Tensor  # [b, P] left-padded
    prompt_mask: torch.Tensor  # [b, P]
    response_ids: torch.Tensor  # [b, R] right-padded
    response_mask: torch.Tensor  # [b, R] 1 on response tokens (model and environment)
    owner: list[int]  # each row's prompt among the distinct prompts, in order of first row
    loss_mask: torch.Tensor  # [b, R] float: the tokens that count in the loss
    advantages: torch.Tensor  # [b] float, or [b, R] when a sample has per-token ones
    old_logprobs: torch.Tensor | None  # [b, R]; rows of `has_old` only
    has_old: torch.Tensor  # [b] bool: the row has old log-probs (else: ratio 1, this forward's)
    ref_logprobs: torch.Tensor | None  # [b, R], beta > 0
    is_weights: torch.Tensor | None  # [b, R] engine-vs-trainer importance weights
    selected: torch.Tensor | None  # [b, R] bool: the Clip-Cov / KL-Cov selection
    # algorithm.proximal_logprobs=loglinear: the behaviour policy's log-probs and versions.
    behaviour_logprobs: torch.Tensor | None = None  # [b, R]
    versions: torch.Tensor | None = None  # [b, R]
    # Each row's prompt and response as given (an ImagePrompt carries its images:
    # dapo.data.images; a response does when an episode's later turns hold images).
    prompts: list[Sequence[int]] = field(default_factory=list)
    responses: list[Sequence[int]] = field(default_factory=list)

    @property
    def width(self) -> int:
        return self.response_ids.shape[1]

    @property
    def distinct_prompts(self) -> list[int]:
        """The first row of each distinct prompt."""
        first: dict[int, int] = {}
        for row, o in enumerate(self.owner):
            first.setdefault(o, row)
        return list(first.values())

    def to(self, device: torch.device) -> MicroBatch:
        if device.type == "cpu":
            return self
        moved = {
            f.name: getattr(self, f.name).to(device)
            if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in fields(self)
        }
        return MicroBatch(**moved)


def pad_rows(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Float rows right-padded with zeros to ``[len(rows), width]``."""
    out = torch.zeros((len(rows), width))
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def advantages(samples: Sequence[Sample], width: int) -> torch.Tensor:
    """``[b]`` advantages, or ``[b, width]`` when some sample has per-token ones (on-policy
    distillation; the others' scalar repeated on their tokens)."""
    if all(s.token_advantages is None for s in samples):
        return torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return pad_rows(
        [
            s.token_advantages
            if s.token_advantages is not None
            else torch.full((len(s.response_ids),), float(s.advantage))
            for s in samples
        ],
        width,
    )


def collate(
    samples: Sequence[Sample],
    pad_id: int,
    selected: Sequence[torch.Tensor | None] | None = None,
    *,
    behaviour: bool = False,
) -> MicroBatch:
    """One micro-batch's tensors (on the CPU; :meth:`MicroBatch.to` moves them).

    ``selected``: each sample's Clip-Cov / KL-Cov token selection, when entropy control is on.
    ``behaviour``: also the behaviour log-probs and versions (the log-linear proximal policy).
    """
    width = max(len(s.response_ids) for s in samples)
    prompt_ids, prompt_mask = left_pad([s.prompt_ids for s in samples], pad_id)
    response_ids, response_mask = right_pad([s.response_ids for s in samples], width, pad_id)
    owner: dict[tuple[int, ...], int] = {}  # a prompt is its tokens and its images
    rows = [owner.setdefault(prompt_key(s.prompt_ids), len(owner)) for s in samples]

    def optional(values: list[torch.Tensor | None], fill: float) -> torch.Tensor | None:
        if all(v is None for v in values):
            return None
        return pad_rows(
            [
                v if v is not None else torch.full((len(s.response_ids),), fill)
                for v, s in zip(values, samples, strict=True)
            ],
            width,
        )

    chosen = None
    if selected is not None and any(x is not None for x in selected):
        chosen = optional([None if x is None else x.float() for x in selected], 0.0) > 0
    return MicroBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        owner=rows,
        loss_mask=pad_rows([s.train_mask() for s in samples], width),
        advantages=advantages(samples, width),
        old_logprobs=optional([s.old_logprobs for s in samples], 0.0),
        has_old=torch.tensor([s.old_logprobs is not None for s in samples]),
        ref_logprobs=optional([s.ref_logprobs for s in samples], 0.0),
        is_weights=optional([s.is_weight for s in samples], 1.0),
        behaviour_logprobs=optional([s.sampling_logprobs for s in samples], 0.0)
        if behaviour
        else None,
        versions=optional([s.versions for s in samples], 0.0) if behaviour else None,
        selected=chosen,
        prompts=[s.prompt_ids for s in samples],
        responses=[s.response_ids for s in samples],
    )
