"""What identifies the model a rollout engine serves: vocabulary, EOS, parameter shapes.

The rollout server states its model's :class:`Fingerprint` (``/health`` a summary,
``/parameters`` the full list) and the trainer compares it with its policy's when it
connects: a server started with another checkpoint, or one whose vocabulary the trainer
has since extended, would otherwise be sent token ids and weights it cannot take. Shapes,
not values, are compared: the trainer pushes its own weights anyway.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from dapo.models.vision import is_vision_config, text_config

# (name, shape) of one parameter, as ``named_parameters()`` of the transformers model
# names it (the names the weight pushes use).
Param = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class Fingerprint:
    """A model's vocabulary size, end-of-sequence id and parameter names and shapes.

    ``parameters`` is None when they could not be read (an architecture transformers cannot
    build); then only vocabulary and EOS are compared. ``name`` (a path or hub id) is for
    messages only.
    """

    vocab_size: int
    eos_token_id: int
    parameters: tuple[Param, ...] | None
    name: str = ""

    @property
    def digest(self) -> str:
        """16 hex digits of a hash over the sorted ``name:shape`` lines (None: ``-``)."""
        if self.parameters is None:
            return "-"
        lines = "\n".join(f"{n}:{list(s)}" for n, s in sorted(self.parameters))
        return hashlib.sha256(lines.encode()).hexdigest()[:16]

    def summary(self) -> dict[str, Any]:
        """The ``/health`` form: counts and the hash, not the full list."""
        params = self.parameters
        return {
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "num_tensors": None if params is None else len(params),
            "num_elements": None if params is None else sum(math.prod(s) for _, s in params),
            "hash": self.digest,
        }

    def describe(self) -> str:
        """One phrase for messages: ``vocabulary 99, EOS 1, 38 tensors (818,304 elements)``."""
        s = self.summary()
        tensors = (
            ""
            if s["num_tensors"] is None
            else (
                f", {s['num_tensors']} tensors ({s['num_elements']:,} elements, hash {s['hash']})"
            )
        )
        return f"vocabulary {self.vocab_size}, EOS {self.eos_token_id}{tensors}"

    def difference(self, other: Fingerprint) -> str | None:
        """The first difference between ``self`` (the server's) and ``other`` (the
        trainer's), in words, or None when they agree."""
        if self.vocab_size != other.vocab_size:
            return f"vocabulary size {self.vocab_size} on the server, {other.vocab_size} in the trainer"
        if self.eos_token_id != other.eos_token_id:
            return f"EOS id {self.eos_token_id} on the server, {other.eos_token_id} in the trainer"
        if self.parameters is None or other.parameters is None:
            return None
        mine, theirs = dict(self.parameters), dict(other.parameters)
        for name, shape in other.parameters:
            if name not in mine:
                return f"the trainer's parameter {name} {list(shape)} is not on the server"
            if mine[name] != shape:
                return f"{name} is {list(mine[name])} on the server, {list(shape)} in the trainer"
        for name, shape in self.parameters:
            if name not in theirs:
                return f"the server's parameter {name} {list(shape)} is not in the trainer"
        return None

    def to_json(self) -> dict[str, Any]:
        """The ``/parameters`` form: everything, the list included."""
        params = None if self.parameters is None else [[n, list(s)] for n, s in self.parameters]
        return {**self.summary(), "name": self.name, "parameters": params}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fingerprint:
        params = data.get("parameters")
        return cls(
            vocab_size=int(data["vocab_size"]),
            eos_token_id=int(data["eos_token_id"]),
            parameters=None if params is None else tuple((str(n), tuple(s)) for n, s in params),
            name=str(data.get("name", "")),
        )


def base_name(name: str) -> str | None:
    """The base model's name of a parameter of a LoRA model (``.base_layer`` dropped), None
    for an adapter's own tensors; other names unchanged (what the weight pushes send)."""
    if ".lora_" in name or ".lora_embedding_" in name:
        return None
    return name.replace(".base_layer.", ".")


def of_module(model: torch.nn.Module, eos_token_id: int, name: str | None = None) -> Fingerprint:
    """The fingerprint of the policy: its config's vocabulary size and its parameters
    (global shapes under FSDP; a LoRA policy's base parameters, as they are pushed)."""
    params: list[Param] = []
    for n, p in model.named_parameters():
        base = base_name(n)
        if base is not None:
            params.append((base, tuple(int(d) for d in p.shape)))
    config = model.config
    return Fingerprint(
        vocab_size=int(text_config(config).vocab_size),
        eos_token_id=int(eos_token_id),
        parameters=tuple(params),
        name=name if name is not None else str(getattr(config, "_name_or_path", "")),
    )


def of_model_dir(path: str | os.PathLike, eos_token_id: int) -> Fingerprint:
    """The fingerprint of a model directory, from its config alone: the transformers model
    is built on the meta device (no memory, no weights read). Parameters are None when
    transformers cannot build the architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(path))
    params: tuple[Param, ...] | None
    try:
        with torch.device("meta"):
            auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
            model = auto.from_config(config)
        params = tuple((n, tuple(int(d) for d in p.shape)) for n, p in model.named_parameters())
    except (ValueError, ImportError, OSError, TypeError):
        params = None
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:  # a multimodal config keeps it in its text part
        vocab = text_config(config).vocab_size
    return Fingerprint(int(vocab), int(eos_token_id), params, name=str(path))
