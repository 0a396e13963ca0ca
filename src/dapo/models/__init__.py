"""Models: load a policy and tokenizer from a path, hub id or ``builtin:tiny``.

- ``loading``: transformers loading, with errors that say what to fix.
- ``tiny``: the built-in ~1M-parameter Llama and character tokenizer, warmed up on first use.
- ``inputs``: padded model inputs shared by generation and training.
"""

from dapo.errors import ModelError
from dapo.models.loading import context_length, load_policy, load_tokenizer, resolve_model_path

__all__ = ["ModelError", "context_length", "load_policy", "load_tokenizer", "resolve_model_path"]
