"""GGUF files (llama.cpp's format) as policies: dequantised once into a transformers directory.

transformers reads a GGUF file (``from_pretrained(dir, gguf_file=name)``, with the ``gguf``
package) and unpacks its quantised blocks into an ordinary float model. dapo does this once
per file and machine: the model and its tokenizer are saved with ``save_pretrained`` under
the dapo cache, in a directory keyed by the file's path, size and modification time and
written atomically, and that directory is what the trainer and ``dapo eval`` load. The
policy is then an ordinary trainable model, and a run's ``final_model`` is in transformers
format like any other.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dapo.atomic import staged_dir
from dapo.errors import ModelError
from dapo.models.cache import cache_root

INSTALL = "pip install 'dapo[gguf]'"  # the extra with the gguf package
# The tokenizer's special tokens as the file's metadata names them (by id).
SPECIAL_TOKEN_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
}
INFO_FILE = "gguf.json"  # written into the converted directory: what it came from
_VERSION = "v2"  # bump when the conversion changes


def convert_gguf(path: Path, name: str, log: Callable[[str], None] = print) -> Path:
    """The transformers directory of the GGUF file ``path`` (``name`` as the user gave it),
    converting it on first use; logs one line saying what was done."""
    if not path.is_file():
        raise ModelError(
            f"`model.name_or_path` = {name!r}: no such file (resolved to {path.absolute()}). "
            "Fix: give the path of a .gguf file, or a model directory."
        )
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(
                f"`model.name_or_path` = {name!r} is named .gguf but is not a GGUF file (it does "
                "not start with the bytes 'GGUF'); the file may be damaged or half downloaded. "
                "Fix: download it again, or give a model directory."
            )
    out = cache_dir_for(path)
    info_path = out / INFO_FILE
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        log(f"{_describe(path, info)}; using the conversion cached in {out}")
        return out
    header = read_header(path, name)
    _check_architecture(header["architecture"], name)
    start = time.time()
    tokenizer, model = _dequantise(path, name)
    _set_special_tokens(tokenizer, header["special_token_ids"])
    info = {
        **header,
        "source": str(path.resolve()),
        "size": path.stat().st_size,
        "dtype": str(model.dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "model_class": type(model).__name__,
        "version": _VERSION,
    }
    with staged_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
    log(
        f"{_describe(path, info)}; saved in transformers format in {out} "
        f"({time.time() - start:.0f} s, once: later runs load it from there)"
    )
    return out


def cache_dir_for(path: Path) -> Path:
    """Where the conversion of ``path`` lives: a new file (or a changed one) gets a new key."""
    st = path.stat()
    key = f"{_VERSION}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return cache_root() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def read_header(path: Path, name: str) -> dict[str, Any]:
    """Architecture and quantisation of a GGUF file (``gguf`` package; no tensor is read)."""
    if not gguf_available():
        raise ModelError(
            f"`model.name_or_path` = {name!r} is a GGUF file; reading it needs the `gguf` "
            f"package, an optional extra of dapo: {INSTALL}"
        )
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, KeyError, struct errors...
        raise ModelError(
            f"`model.name_or_path` = {name!r}: could not read the GGUF file "
            f"({type(exc).__name__}: {exc}); it may be damaged or half downloaded"
        ) from exc

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    specials = {role: field(f"tokenizer.ggml.{key}") for role, key in SPECIAL_TOKEN_KEYS.items()}
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    file_type = field("general.file_type")
    try:
        quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        quant = None
    if quant is None:  # no or an unknown file type: the commonest tensor type
        quant = types.most_common(1)[0][0] if types else "none"
    return {
        "architecture": str(field("general.architecture")),
        "quant_type": quant,
        "tensor_types": dict(types),
        "special_token_ids": {role: int(i) for role, i in specials.items() if i is not None},
    }


def gguf_available() -> bool:
    """Whether the ``gguf`` package (the ``gguf`` extra) is installed."""
    return importlib.util.find_spec("gguf") is not None


def _check_architecture(arch: str, name: str) -> None:
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # not models
    if arch not in known:
        raise ModelError(
            f"`model.name_or_path` = {name!r}: the GGUF architecture {arch!r} cannot be read by "
            f"transformers {transformers.__version__} (it reads {', '.join(known)}). "
            "Fix: use the model's "
            "transformers checkpoint (a directory with config.json and safetensors) instead."
        )


def _dequantise(path: Path, name: str) -> tuple[Any, torch.nn.Module]:
    """The tokenizer and the float32 model transformers makes of the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        raise ModelError(
            f"`model.name_or_path` = {name!r}: transformers could not load the GGUF file as a "
            f"causal language model ({type(exc).__name__}: {exc})"
        ) from exc
    # The weights are plain floats now; a GGUF quantization config left on the model would
    # make save_pretrained refuse (and a reload look for the .gguf file again).
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    return tokenizer, model


def _set_special_tokens(tokenizer: Any, ids: dict[str, int]) -> None:
    """The file's BOS, EOS, UNK and PAD tokens on ``tokenizer``. transformers 5.17 made EOS
    the BOS token and left PAD unset for a file that names both (SmolLM2's ``<|im_end|>``):
    a policy that stops on the wrong token and a run with no pad token."""
    vocab = len(tokenizer)
    for role, token_id in ids.items():
        if 0 <= token_id < vocab:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))


def _describe(path: Path, info: dict[str, Any]) -> str:
    """One line: file, quantisation, dtype and size of the conversion."""
    return (
        f"{path.name}: GGUF ({info['architecture']}, {info['quant_type']}) dequantised to "
        f"{info['dtype']}, a {info['model_class']} of {info['parameters'] / 1e6:.1f}M parameters"
    )
