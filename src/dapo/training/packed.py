"""The packed training forward: a micro-batch as one row without padding.

Each distinct prompt is placed once, followed by its first response; its other responses
follow as segments that attend to that prompt's keys (:mod:`dapo.models.packing`), so a
prompt is forwarded once per micro-batch as in the unpacked shared-prompt path, and no
position holds padding. Positions restart at 0 for each prompt and continue from the
prompt's length for each response, so every token sees exactly the keys, values and
rotary positions of its unpacked forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dapo.models.inputs import device_of
from dapo.models.packing import LAYOUT_KEY, Layout, Segment
from dapo.training.microbatch import MicroBatch, response_widths


@dataclass
class PackedRow:
    """One packed row: its tokens ``[1, T]``, positions ``[1, T]``, segments, and the row
    positions whose outputs predict the response tokens, in the order of
    ``batch.response_mask > 0`` (row by row)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: Layout
    gather: torch.Tensor


def pack(batch: MicroBatch, *, shared_prompt: bool = True) -> PackedRow:
    """``batch`` packed into one row (:class:`PackedRow`); ``shared_prompt`` off places each
    response after its own copy of its prompt."""
    widths = response_widths(batch.response_mask)
    ids: list[int] = []
    pos: list[int] = []
    segments: list[Segment] = []
    predicts: list[list[int]] = [[] for _ in batch.owner]  # per row: the state of each column
    placed: dict[int, tuple[int, int]] = {}  # owner -> (start, length) of its prompt in the row
    for row, owner in enumerate(batch.owner):
        response = batch.response_ids[row, : max(widths[row] - 1, 0)].tolist()  # inputs only
        key = owner if shared_prompt else -1 - row
        start = len(ids)
        if key in placed:  # the prompt is in the row: the response attends to it
            a, p = placed[key]
            if response:
                segments.append(Segment(start, start + len(response), (a, a + p)))
        else:
            prompt = batch.prompt_ids[row][batch.prompt_mask[row] > 0].tolist()
            a, p = start, len(prompt)
            placed[key] = (a, p)
            ids.extend(prompt)
            pos.extend(range(p))
            start = len(ids)
            segments.append(Segment(a, start + len(response)))
        ids.extend(response)
        pos.extend(range(p, p + len(response)))
        predicts[row] = [a + p - 1, *range(start, start + len(response))]
    valid = batch.response_mask > 0
    gather = [predicts[r][c] for r, c in valid.nonzero().tolist()]
    return PackedRow(
        input_ids=torch.tensor([ids]),
        position_ids=torch.tensor([pos]),
        layout=Layout(tuple(segments)),
        gather=torch.tensor(gather, dtype=torch.long),
    )


def packed_states(
    model: torch.nn.Module, row: PackedRow, first_pass: torch.nn.Module | None = None
) -> torch.Tensor:
    """The model's output (hidden states under a bypassed head, or logits) at ``row.gather``:
    ``[N, .]``, one per response token of the micro-batch. ``first_pass`` (a DDP wrapper of
    ``model``) runs the forward when given."""
    device = device_of(model)
    out = (first_pass or model)(
        input_ids=row.input_ids.to(device),
        attention_mask=torch.ones_like(row.input_ids, device=device),  # no mask: see packing
        position_ids=row.position_ids.to(device),
        logits_to_keep=row.gather.to(device),
        use_cache=False,
        **{LAYOUT_KEY: row.layout},
    )
    return out.logits[0]
