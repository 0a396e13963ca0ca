"""The policy's output layer: whether it is a plain linear layer, and replacing what it computes.

dapo applies the output layer itself where that saves memory or precision (chunked
log-probs in training, float32 logits in generation: ``dapo.models.chunked_logprobs``). That is exact only
when the model's logits are that ``nn.Linear`` applied to the final hidden states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from dapo.models.vision import text_config

# Config fields of heads that scale or cap the logits after the output layer (Gemma 2's
# soft-capping, Cohere's and Granite's scales): such models keep their own head.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "lm_head_multiplier",
    "output_multiplier_scale",
)


def output_head(model: nn.Module) -> nn.Linear | None:
    """The model's output layer when its logits are exactly that ``nn.Linear`` applied to the
    final hidden states, else None.

    None for heads that are not a plain ``nn.Linear`` (e.g. wrapped by an adapter) and for
    models whose config scales or caps the logits (``final_logit_softcapping`` of Gemma 2,
    ``logit_scale`` of Cohere, ``logits_scaling`` of Granite, ...): those compute their whole
    ``[tokens x vocabulary]`` logits themselves.
    """
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear:
        return None
    config = getattr(model, "config", None)
    text = text_config(config)
    for name in _LOGIT_TRANSFORMS:
        if getattr(text, name, None) not in (None, 1, 1.0):
            return None
    return head


@contextlib.contextmanager
def head_replaced(
    head: nn.Module | None, forward: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """Inside, ``head`` computes ``forward(x)`` instead (a no-op for None). The module stays
    registered, so FSDP still gathers its weight with the root's."""
    if head is None:
        yield
        return
    head.forward = forward
    try:
        yield
    finally:
        del head.forward
