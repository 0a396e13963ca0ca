"""Models: load a policy and tokenizer from a path, hub id or ``builtin:tiny``.

- ``loading``: transformers loading, with errors that say what to fix.
- ``cache``: the model cache directory and the names of the built-in models.
- ``tiny``: the built-in ~1M-parameter Llama and character tokenizer, warmed up on first use.
- ``gguf``: GGUF files, dequantised once into a cached transformers directory.
- ``inputs``: padded model inputs shared by generation and training.
- ``head``, ``precision``, ``lora``, ``activation_checkpointing``: what is applied to the
  policy (the output layer's replacement, train.precision, peft adapters, recomputed layers).
- ``data_parallel``: FSDP2 sharding or DDP for the policy (on top of :mod:`dapo.parallel`).

:mod:`dapo.parallel` is the layer below: modules here import it, never the reverse.
"""

from dapo.errors import ModelError
from dapo.models.loading import (
    context_length,
    hidden_size,
    load_policy,
    load_tokenizer,
    resolve_model_path,
)

__all__ = [
    "ModelError",
    "context_length",
    "hidden_size",
    "load_policy",
    "load_tokenizer",
    "resolve_model_path",
]
