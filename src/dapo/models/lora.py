"""LoRA adapters through ``peft``: train low-rank updates of chosen linear layers only.

:func:`apply_lora` injects ``peft`` LoRA layers into the loaded transformers model *in
place*: the model object stays the one the trainer forwards, shards and samples with
(its linear layers become ``peft`` LoRA layers whose frozen weight is
``<name>.base_layer.weight`` and whose adapters are ``<name>.lora_A.default.weight`` and
``<name>.lora_B.default.weight``), and every base parameter is frozen. The returned
``PeftModel`` handle gives ``disable_adapter()``, i.e. the base model, which serves as the
reference policy for ``algorithm.beta > 0`` without a copy.

A layer's merged weight is ``W + (alpha / r) B A`` (peft's ``get_delta_weight``).
:func:`merge_state` turns a (full) state dict of the LoRA model into the base model's
state dict with merged weights and the base names, without touching the model: the final
model is saved from it and a separate rollout engine (vLLM) is given it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dapo.errors import ModelError

if TYPE_CHECKING:
    from dapo.config import LoraConfig

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output layer
_BASE = ".base_layer."
# The vision encoder and connector of the supported vision-language families (a regex).
VISION_MODULES = r".*\b(vision_model|visual|connector)\b.*"
_ADAPTER = (".lora_A.", ".lora_B.")


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (``q_proj``, ``lm_head``...)."""
    return sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n
        }
    )


def check_targets(model: torch.nn.Module, targets: Sequence[str]) -> None:
    """Raise :class:`ModelError` naming the model's linear layers when a target module name
    matches none of them (peft matches a name against the end of each module's path)."""
    if list(targets) == [ALL_LINEAR]:
        return
    available = linear_layer_names(model)
    modules = dict(model.named_modules())
    missing = []
    for target in targets:
        matches = [m for n, m in modules.items() if n == target or n.endswith("." + target)]
        if not matches or not all(isinstance(m, torch.nn.Linear) for m in matches):
            missing.append(target)
    if missing:
        raise ModelError(
            f"`model.lora.target_modules` = {list(targets)}: {', '.join(map(repr, missing))} "
            f"{'is not the name' if len(missing) == 1 else 'are not names'} of a linear layer "
            f"of this model. Its linear layers are named {', '.join(available)}; list some of "
            f"them, or use [{ALL_LINEAR}] for every linear layer but the output layer."
        )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> Any:
    """Inject LoRA adapters into ``model`` in place (``cfg.rank`` > 0) and freeze the rest;
    returns the ``peft`` model that wraps it (for ``disable_adapter()``)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as exc:
        raise ModelError(
            "model.lora needs the peft package, an optional extra of dapo: "
            f"pip install 'dapo[lora]' ({exc})"
        ) from exc
    check_targets(model, cfg.target_modules)
    targets: str | list[str] = (
        ALL_LINEAR if list(cfg.target_modules) == [ALL_LINEAR] else list(cfg.target_modules)
    )
    vision = getattr(getattr(model, "config", None), "vision_config", None) is not None
    config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        # A vision-language model's adapters go on its language model only.
        exclude_modules=VISION_MODULES if vision else None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    if getattr(model, "is_gradient_checkpointing", False):
        # Checkpointed layers whose inputs need no gradient would drop the adapters' one.
        model.enable_input_require_grads()
    return peft_model


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (the model itself otherwise)."""
    if type(model).__module__.startswith("peft") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters."""
    return any(_ADAPTER[0] in n for n, _ in model.named_parameters())


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """``alpha / r`` of each LoRA layer, by the layer's path."""
    out = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and "default" in scaling and hasattr(module, "base_layer"):
            out[name] = float(scaling["default"])
    return out


def merge_state(
    state: dict[str, torch.Tensor], scaling: dict[str, float]
) -> dict[str, torch.Tensor]:
    """The base model's state dict from a LoRA model's: ``W + s * B @ A`` under the base name
    of each LoRA layer (``scaling``: :func:`scalings` of the model), other tensors renamed
    (``.base_layer.`` dropped), adapter tensors left out. New tensors; ``state`` is not
    changed. Tensors shared between names stay shared (tied embeddings)."""
    out: dict[str, torch.Tensor] = {}
    merged: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        if any(a in name for a in _ADAPTER):
            continue
        if _BASE not in name:
            out[name] = tensor
            continue
        layer, leaf = name.split(_BASE, 1)
        if leaf == "weight" and layer in scaling:
            key = id(tensor)
            if key not in merged:
                a = state[f"{layer}.lora_A.default.weight"]
                b = state[f"{layer}.lora_B.default.weight"]
                delta = (b.float() @ a.float()) * scaling[layer]
                merged[key] = (tensor.float() + delta).to(tensor.dtype)
            out[f"{layer}.{leaf}"] = merged[key]
        else:
            out[f"{layer}.{leaf}"] = tensor
    return out


def merged_parameters(
    model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(base name, merged tensor)`` of every parameter, for an engine that loads base-model
    checkpoints (vLLM's ``load_weights``); the trained model is not changed. ``named``: the
    model's ``(name, tensor)`` pairs when they must be gathered (FSDP:
    :func:`dapo.parallel.sharding.full_named_parameters`, all consumed before the first
    merged tensor comes out); default ``model.named_parameters()``."""
    with torch.no_grad():
        state = {n: p.detach() for n, p in (model.named_parameters() if named is None else named)}
        yield from merge_state(state, scalings(model)).items()


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter elements (each shared tensor once)."""
    seen: set[int] = set()
    trainable = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total
