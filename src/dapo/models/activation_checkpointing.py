"""Activation (gradient) checkpointing of the decoder layers, compatible with a key/value cache.

transformers' own ``gradient_checkpointing_enable`` turns the cache off in training (a
recomputed layer would append its keys and values to the cache a second time). dapo
checkpoints each decoder layer itself, with non-reentrant ``torch.utils.checkpoint``: the
layer keeps only its inputs in forward and runs again in backward to rebuild what its
gradient needs. The training passes give it caches whose ``update`` gives the same result
when called again (``dapo.training.forward``), so the shared-prompt forward keeps working.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dapo.parallel.sharding import decoder_layers


class _CheckpointedLayer(nn.Module):
    """Mixed into a decoder layer's class: forward under ``torch.utils.checkpoint`` when it
    builds a graph (training with gradients), plain otherwise (generation, no-grad passes)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward
        if self.training and torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)


_CLASSES: dict[type, type] = {}


def checkpoint_layers(model: nn.Module) -> int:
    """Checkpoint every decoder layer of ``model`` in place; the number of layers.

    The layer's class becomes a subclass that adds the checkpoint (names, parameters and
    state dicts are unchanged, so do copies). Returns 0, changing nothing, when ``model``
    has no recognisable decoder layers.
    """
    layers = decoder_layers(model)
    for layer in layers:
        cls = type(layer)
        if issubclass(cls, _CheckpointedLayer):
            continue
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (_CheckpointedLayer, cls), {})
        layer.__class__ = _CLASSES[cls]
    return len(layers)


def is_checkpointed(model: nn.Module) -> bool:
    """Whether :func:`checkpoint_layers` was applied to ``model``."""
    return any(isinstance(m, _CheckpointedLayer) for m in model.modules())
