"""The key/value caches of the shared-prompt training forward.

A training micro-batch forwards each distinct prompt once into a :class:`SharedPromptCache`,
then forwards all response tokens at once on top of the prompt's keys and values
(:meth:`SharedPromptCache.expand`). Unlike transformers' ``DynamicCache``, whose ``update``
appends, both caches give the same result whenever ``update`` is called again with the same
states: under activation checkpointing (``models.activation_checkpointing``) every layer's forward
runs a second time in backward, and an appending cache would then hand the attention twice
the keys.

- prompt pass: the cache starts empty, so ``update`` *replaces* the layer's keys and values
  with the new ones (equal to appending to nothing), and returns them;
- a pass that continues fixed keys and values (the prompts after a prefix they all share,
  forwarded once on one row as a prompt pass; the responses after their prompts):
  ``update`` returns the fixed ones followed by the new ones and keeps that result in place
  of its last (replacing, as above, never appending to what it kept).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class _PromptLayer(DynamicLayer):
    """Keys and values of a pass that starts from nothing: ``update`` replaces them."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _PrefixLayer(DynamicLayer):
    """Fixed keys and values that a pass continues (the prompts', or a prefix they share):
    ``update`` returns them followed by the new ones, and keeps that as the layer's keys and
    values (so a prompt pass after a shared prefix leaves the whole prompts behind)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.prefix = keys, values
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = torch.cat([self.prefix[0], key_states], -2)
        self.values = torch.cat([self.prefix[1], value_states], -2)
        return self.keys, self.values


class SharedPromptCache(DynamicCache):
    """A full-attention cache for the prompt pass; :meth:`expand` gives the response pass's."""

    def __init__(self, layers: list[DynamicLayer]) -> None:
        Cache.__init__(self, layers=layers)

    @classmethod
    def empty(cls, depth: int) -> SharedPromptCache:
        return cls([_PromptLayer() for _ in range(depth)])

    def continued(self, n: int) -> SharedPromptCache:
        """The cache of a pass that continues this one-row pass (a prefix that ``n`` prompts
        share) on ``n`` rows; afterwards it holds the whole prompts, ready to :meth:`expand`.
        The prefix is broadcast, so each prompt's gradient flows back into the one pass."""
        return SharedPromptCache(
            [
                _PrefixLayer(layer.keys.expand(n, -1, -1, -1), layer.values.expand(n, -1, -1, -1))
                for layer in self.layers
            ]
        )

    def expand(self, rows: torch.Tensor) -> SharedPromptCache:
        """The cache of the response pass: prompt ``rows[i]``'s keys and values for response
        ``i`` (an ``index_select``, so each response's gradient flows back into its prompt)."""
        return SharedPromptCache(
            [
                _PrefixLayer(layer.keys.index_select(0, rows), layer.values.index_select(0, rows))
                for layer in self.layers
            ]
        )
