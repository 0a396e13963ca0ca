"""TRL's and verl's option names, translated to dapo's keys where they mean the same.

A TRL ``GRPOConfig`` (the object, or its keyword names) and verl's nested keys
(``actor_rollout_ref.actor.clip_ratio_high``) come in as they are. Each name is translated
when dapo has the same setting (units converted: TRL counts completions where dapo counts
prompts), refused with the reason when it has none or another meaning, or ignored with the
reason when it changes nothing a dapo run does (logging to the hub, dataloader workers).
:func:`translate` returns dapo's dotted keys, the table it prints, and what it refused;
:mod:`dapo.config.loading` raises every refused and unknown name in one error. Of a
``GRPOConfig`` object, which records no "set by its user", :func:`trl_names` takes the run's
defining numbers and every switch dapo translates or checks at any value, TRL's defaults
included, and any other option where it differs from TRL's default.
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dapo.config.foreign_rules import (
    Rule,
    bool_to,
    false_only,
    ignore,
    mapped,
    positive_steps,
    refuse,
    report_to,
    same,
    true_only,
)
from dapo.config.foreign_verl import VERL, VERL_ROOTS

# --- TRL --------------------------------------------------------------------------------------


def _completions_to_prompts(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's batch sizes count completions per device; dapo's count prompts per step."""
    g = int(given.get("num_generations") or 8)  # TRL's default group size
    per_device = int(given.get("per_device_train_batch_size") or 8)
    accumulation = int(given.get("gradient_accumulation_steps") or 1)
    update = per_device * accumulation  # completions per optimizer update (one process)
    steps = given.get("steps_per_generation") or accumulation
    generation = given.get("generation_batch_size") or per_device * int(steps)
    out = {}
    for name, completions in (("mini_batch_size", update), ("prompts_per_step", generation)):
        if completions % g:
            raise ValueError(
                f"{completions} completions per {'update' if name == 'mini_batch_size' else 'generation'} "
                f"are not a whole number of groups of num_generations={g}"
            )
        out[f"train.{name}"] = completions // g
    return out


_BATCH = Rule(
    convert=_completions_to_prompts,
    note="TRL's completions per device / num_generations = dapo's prompts (one process)",
)


def _engine(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if not value:
        return {"rollout.engine": "hf"}
    if given.get("vllm_mode", "colocate") == "server":
        return {"rollout.engine": "vllm-server"}
    return {"rollout.engine": "vllm"}


def _server_url(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    return {"rollout.server_url": value} if value else {}


_IS_MODES = {
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
}


def _vllm_is(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's correction of vLLM's samples (its five names read together, at TRL's defaults
    where not given): on only with ``use_vllm``, as in TRL, else ``algorithm.is_cap`` null."""
    if not given.get("vllm_importance_sampling_correction", True) or not given.get("use_vllm"):
        return {"algorithm.is_cap": None}
    if given.get("vllm_importance_sampling_clip_min") is not None:
        raise ValueError(
            "a lower bound on the ratio has no equivalent here (dapo bounds it from above, "
            "algorithm.is_cap): leave vllm_importance_sampling_clip_min unset"
        )
    mode = given.get("vllm_importance_sampling_mode", "sequence_mask")
    if mode not in _IS_MODES:
        known = ", ".join(_IS_MODES)
        raise ValueError(f"vllm_importance_sampling_mode = {mode!r} is none of {known}")
    cap = given.get("vllm_importance_sampling_clip_max")
    if cap is None:
        cap = given.get("vllm_importance_sampling_cap")
    level, how = _IS_MODES[mode]
    return {
        "algorithm.is_cap": float(3.0 if cap is None else cap),  # TRL's default cap
        "algorithm.is_level": level,
        "algorithm.is_mode": how,
    }


_VLLM_IS = Rule(
    convert=_vllm_is,
    note="with use_vllm only, as TRL; sequence_mask -> is_level=sequence, is_mode=mask",
)


def _kl_weighting(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    beta = float(given.get("beta") or 0.0)
    if value and beta > 0:
        raise ValueError(
            f"with beta = {beta:g}, TRL weighs each token's KL by its importance ratio (its "
            "default), which changes the KL gradient; dapo's KL term is not weighed: set "
            "use_bias_correction_kl=False to train with the unweighted estimator "
            "(algorithm.kl_estimator=k3)"
        )
    return {}


TRL: dict[str, Rule] = {
    # GRPOConfig's own names
    "num_generations": same("rollout.num_generations"),
    "max_completion_length": same("rollout.max_completion_length"),
    "max_prompt_length": same("data.max_prompt_length"),
    "temperature": same("rollout.temperature"),
    "top_p": same("rollout.top_p"),
    "top_k": Rule(convert=lambda v, _: {"rollout.top_k": int(v or 0)}, note="None -> 0 (off)"),
    "epsilon": same("algorithm.clip_low"),
    "epsilon_high": same("algorithm.clip_high"),
    "beta": same("algorithm.beta"),
    "num_iterations": same("train.epochs"),
    "loss_type": mapped(
        "algorithm.loss_agg",
        {
            "dapo": "token-mean",
            "bnpo": "token-mean",
            "grpo": "seq-mean-token-mean",
            "dr_grpo": "seq-mean-token-sum-norm",
        },
    ),
    "scale_rewards": mapped(
        "algorithm.advantage_scale",
        {"group": "group", "batch": "batch", "none": "none", True: "group", False: "none"},
    ),
    "mask_truncated_completions": same("algorithm.overlong_filter"),
    "entropy_coef": same("algorithm.entropy_coef"),
    "importance_sampling_level": mapped(
        "algorithm.policy_loss",
        {"token": "ppo", "sequence": "gspo"},
        "token -> ppo, sequence -> gspo",
    ),
    "use_vllm": Rule(convert=_engine, note="True -> vllm (vllm_mode=server: vllm-server)"),
    "vllm_mode": ignore("read with use_vllm"),
    "vllm_server_base_url": Rule(convert=_server_url, note="the server dapo's engine talks to"),
    "vllm_gpu_memory_utilization": same("rollout.vllm_gpu_memory_utilization"),
    "vllm_enable_sleep_mode": same("rollout.vllm_sleep"),
    "per_device_train_batch_size": _BATCH,
    "gradient_accumulation_steps": _BATCH,
    "generation_batch_size": _BATCH,
    "steps_per_generation": _BATCH,
    "reward_weights": ignore("applied to the reward functions' weights by dapo.train"),
    "trust_remote_code": same("model.trust_remote_code"),
    "log_completions": ignore("dapo writes transcripts every step (logging.transcripts_per_step)"),
    "num_completions_to_print": ignore("dapo show RUN prints transcripts"),
    "shuffle_dataset": same("data.shuffle"),
    "disable_dropout": false_only(
        "dapo trains with the model's own dropout (0 in most LLM checkpoints, where this "
        "changes nothing): leave it false, and for a checkpoint with dropout set its config's "
        "dropout probabilities to 0"
    ),
    "ds3_gather_for_generation": ignore("no DeepSpeed here (FSDP2: train.data_parallel)"),
    "multi_objective_aggregation": mapped(
        "algorithm.advantage_scale",
        {"sum_then_normalize": "group"},
        "sum_then_normalize is dapo's (the weighted sum is normalised per group)",
    ),
    "delta": refuse(
        "TRL's two-sided ratio bound has no equivalent; dapo's dual clip is "
        "algorithm.clip_c (another bound)"
    ),
    "top_entropy_quantile": refuse("no entropy-quantile token masking here"),
    "sync_ref_model": false_only("dapo's reference (algorithm.beta > 0) is the initial policy"),
    "vllm_importance_sampling_correction": _VLLM_IS,
    "vllm_importance_sampling_mode": _VLLM_IS,
    "vllm_importance_sampling_clip_max": _VLLM_IS,
    "vllm_importance_sampling_cap": _VLLM_IS,
    "vllm_importance_sampling_clip_min": _VLLM_IS,
    "use_bias_correction_kl": Rule(convert=_kl_weighting, note="false, or any with beta = 0"),
    "use_adaptive_entropy": false_only(
        "no adaptive entropy coefficient here: algorithm.entropy_coef is fixed"
    ),
    "cast_lm_head_to_fp32": ignore(
        "dapo's output layer sums in float32 in every precision (its logits are never "
        "rounded to bf16)"
    ),
    "use_transformers_continuous_batching": ignore(
        "dapo's hf engine decodes with its own static KV cache (rollout.engine=hf)"
    ),
    "use_transformers_paged": ignore(
        "dapo's hf engine decodes with its own static KV cache (rollout.engine=hf)"
    ),
    "log_multimodal": ignore("dapo writes transcripts every step (logging.transcripts_per_step)"),
    "log_unique_prompts": ignore(
        "dapo writes transcripts every step (logging.transcripts_per_step)"
    ),
    "max_tool_calling_iterations": same("rollout.max_turns"),
    # TrainingArguments' names
    "output_dir": same("output_dir"),
    "seed": same("seed"),
    "learning_rate": same("train.lr"),
    "max_steps": Rule(convert=positive_steps, note="rollout steps (-1: not set)"),
    "num_train_epochs": refuse(
        "dapo counts rollout steps, not passes over the data: set train.steps (an epoch is "
        "len(dataset) / train.prompts_per_step steps)"
    ),
    "warmup_steps": same("train.warmup_steps"),
    "warmup_ratio": refuse("give the warm-up in steps: train.warmup_steps"),
    "lr_scheduler_type": mapped("train.lr_schedule", {"constant": "constant", "cosine": "cosine"}),
    "weight_decay": same("train.weight_decay"),
    "adam_beta1": same("train.adam_beta1"),
    "adam_beta2": same("train.adam_beta2"),
    "max_grad_norm": same("train.max_grad_norm"),
    "bf16": bool_to("train.precision", "bf16-mixed", "fp32"),
    "fp16": false_only("fp16 is not supported: train.precision=bf16-mixed or fp32"),
    "tf32": ignore(
        "dapo leaves TF32 at PyTorch's default; train.precision=bf16-mixed is its fast mode"
    ),
    "gradient_checkpointing": same("model.gradient_checkpointing"),
    "torch_compile": ignore(
        "dapo compiles no training forward; its hf engine replays decoding from CUDA graphs "
        "(rollout.cuda_graphs)"
    ),
    "use_liger_kernel": ignore(
        "dapo computes log-probs chunk by chunk (train.logits_chunk_size): the memory "
        "Liger's fused loss saves"
    ),
    "use_cache": ignore("the rollout engine keeps its own KV cache; the training forward none"),
    "auto_find_batch_size": ignore(
        "dapo packs micro-batches by tokens (train.micro_batch_tokens); it does not retry "
        "with smaller ones on out-of-memory"
    ),
    "average_tokens_across_devices": true_only(
        "dapo's token-mean loss divides by the tokens of every rank, as true does"
    ),
    "full_determinism": false_only(
        "dapo seeds every draw (seed) but does not switch PyTorch to deterministic "
        "kernels: leave it false"
    ),
    "load_best_model_at_end": false_only(
        "dapo keeps the last checkpoints (checkpoint.keep_last) and exports the final "
        "model; it picks no best one"
    ),
    "greater_is_better": ignore("read with load_best_model_at_end"),
    "ignore_data_skip": false_only(
        "a resumed dapo run goes on with the prompts where its checkpoint stopped"
    ),
    "save_only_model": ignore(
        "dapo's checkpoints keep the optimizer state for an exact resume; the final model "
        "is exported alone (checkpoint.save_final_model)"
    ),
    "enable_jit_checkpoint": ignore(
        "dapo saves a checkpoint on SIGTERM and Ctrl-C (checkpoint.on_signal)"
    ),
    "restore_callback_states_from_checkpoint": ignore(
        "dapo's callbacks are the Python objects given to dapo.train; they keep their own state"
    ),
    "eval_on_start": ignore(
        "dapo measures held-out accuracy before and after training (evaluate=false: neither)"
    ),
    "save_steps": same("checkpoint.save_every"),
    "save_total_limit": same("checkpoint.keep_last"),
    "eval_steps": same("logging.eval_every"),
    "report_to": Rule(convert=report_to, note="wandb / tensorboard"),
    "run_name": same("logging.run_name"),
    "resume_from_checkpoint": bool_to("resume", True, False),
}

# TrainingArguments' names that change nothing a dapo run does, by why.
_TRL_HARMLESS: dict[str, tuple[str, ...]] = {
    "dapo's logging is its own (logging.*)": (
        "logging_steps",
        "logging_dir",
        "logging_strategy",
        "logging_first_step",
        "log_on_each_node",
        "logging_nan_inf_filter",
        "include_num_input_tokens_seen",
        "skip_memory_metrics",
        "disable_tqdm",
        "log_level",
    ),
    "dapo does not push to the Hugging Face Hub": (
        "push_to_hub",
        "hub_model_id",
        "hub_private_repo",
        "hub_always_push",
    ),
    "dapo reads its prompts without a torch DataLoader": (
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_drop_last",
        "dataloader_persistent_workers",
        "dataloader_in_order",
        "remove_unused_columns",
    ),
    "dapo shards with FSDP2 (train.data_parallel), not DDP": (
        "ddp_find_unused_parameters",
        "ddp_broadcast_buffers",
        "ddp_static_graph",
    ),
    "dapo's evaluation samples answers and scores them (evaluate, logging.eval_every) in the "
    "training precision; the Trainer's eval loop is not used": (
        "eval_strategy",
        "per_device_eval_batch_size",
        "prediction_loss_only",
        "eval_do_concat_batches",
        "eval_use_gather_object",
        "batch_eval_metrics",
        "bf16_full_eval",
        "fp16_full_eval",
    ),
    "no effect in a dapo run": (
        "save_strategy",
        "save_on_each_node",
        "overwrite_output_dir",
        "do_train",
        "do_eval",
        "do_predict",
    ),
    "dapo trains on CUDA when there is a GPU (CUDA_VISIBLE_DEVICES= hides it), on the CPU "
    "otherwise": ("use_cpu",),
}
for _why, _names in _TRL_HARMLESS.items():
    for _name in _names:
        TRL.setdefault(_name, ignore(_why))


def split_foreign(
    node: Mapping[str, Any], ours: frozenset[str], prefix: str = ""
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``node`` (a config mapping: sections and dotted keys) split into what stays (dapo's
    keys ``ours`` and anything unknown, for the usual checks) and the TRL and verl names,
    dotted, with their values."""
    kept: dict[str, Any] = {}
    foreign: dict[str, Any] = {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        root = path.split(".", 1)[0]
        nested_verl = isinstance(value, Mapping) and any(k.startswith(path + ".") for k in VERL)
        if path in ours and not nested_verl:
            kept[key] = value
        elif path in TRL or path in VERL:
            foreign[path] = value
        elif isinstance(value, Mapping) and (root in VERL_ROOTS or nested_verl):
            inner, more = split_foreign(value, ours, path + ".")
            foreign.update(more)
            if inner:
                kept[key] = inner
        elif root in VERL_ROOTS:
            foreign[path] = value
        else:
            kept[key] = value
    return kept, foreign


@dataclass
class Translation:
    """What :func:`translate` made of the foreign names."""

    keys: dict[str, Any] = field(default_factory=dict)  # dapo's dotted keys and values
    rows: list[tuple[str, str, Any, str]] = field(default_factory=list)  # theirs, ours, value, note
    refused: list[str] = field(default_factory=list)  # one line per name
    # read and accepted with nothing to set (a switch at the value dapo has): "name=value"
    unchanged: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None

    def table(self) -> str:
        """The translation as lines: their name, our key, the value, the note; then the
        names read that change nothing, on one wrapped line."""
        if not self.rows and not self.unchanged:
            return ""
        width = max((len(r[0]) for r in self.rows), default=0)
        lines = ["translated from TRL / verl names:"]
        for theirs, ours, value, note in self.rows:
            tail = f"  ({note})" if note else ""
            lines.append(f"  {theirs:<{width}} -> {ours} = {value!r}{tail}")
        if self.unchanged:
            text = "read, nothing to change: " + ", ".join(self.unchanged)
            lines += textwrap.wrap(text, 96, initial_indent="  ", subsequent_indent="    ")
        return "\n".join(lines)


def translate(names: Mapping[str, Any]) -> Translation:
    """Translate ``names`` (foreign dotted names and their values) into dapo's keys; the
    refused ones (no same meaning, or a value with no equivalent) are listed, not raised."""
    out = Translation()
    converted: set[int] = set()  # a conversion reading several names runs once
    for name, value in names.items():
        rule = TRL.get(name) or VERL.get(name)
        if rule is None:
            out.refused.append(
                f"`{name}`: a verl key dapo has no equivalent for (see the migration guide, "
                "docs/guides/migrating.md)"
            )
            continue
        if name == "reward_weights":
            out.reward_weights = [float(w) for w in value] if value is not None else None
        if rule.why:
            out.refused.append(f"`{name}`: {rule.why}")
            continue
        if rule.ignore:
            out.rows.append((name, "-", value, f"ignored: {rule.ignore}"))
            continue
        # A TRL name at TRL's default says so (a GRPOConfig's defaults are taken too), unless
        # its rule reads several names (the batch sizes), whose result no one name decides.
        alone = sum(r is rule for r in TRL.values()) == 1
        at_default = name in TRL and alone and _is_trl_default(name, value)
        default = "TRL's default" if at_default else ""
        note = "; ".join(n for n in (rule.note, default) if n)
        if rule.key is not None:
            out.keys[rule.key] = value
            out.rows.append((name, rule.key, value, note))
            continue
        assert rule.convert is not None
        if id(rule) in converted:
            continue
        converted.add(id(rule))
        try:
            keys = rule.convert(value, names)
        except (ValueError, TypeError) as e:
            out.refused.append(f"`{name}` = {value!r}: {e}")
            continue
        if not keys:  # a value dapo's behaviour is: said, not dropped unseen
            out.unchanged.append(f"{name}={value!r}")
        for key, v in keys.items():
            out.keys[key] = v
            out.rows.append((name, key, v, note))
    return out


@functools.cache
def trl_defaults() -> dict[str, Any]:
    """Every ``GRPOConfig`` option's default as its dataclass declares it (``{}`` without
    TRL); ``bf16``'s is None, TRL's "bf16 unless fp16"."""
    try:
        from trl import GRPOConfig
    except Exception:
        return {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(GRPOConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _is_trl_default(name: str, value: Any) -> bool:
    defaults = trl_defaults()
    return name in defaults and defaults[name] is not None and not _differs(value, defaults[name])


# The GRPOConfig names whose TRL defaults a translated config keeps (where dapo's differ):
# the numbers that define a GRPO run. Every switch with a dapo equivalent is kept too
# (:func:`taken_at_default`).
TRL_RUN_DEFAULTS = frozenset(
    {
        "learning_rate",
        "num_generations",
        "max_completion_length",
        "per_device_train_batch_size",
        "epsilon",
        "epsilon_high",
        "beta",
        "loss_type",
        "scale_rewards",
        "temperature",
        "num_iterations",
        "max_steps",
        "output_dir",
    }
)


def taken_at_default(name: str, value: Any) -> bool:
    """Whether a GRPOConfig's ``name`` is taken at ``value`` even when that is TRL's default:
    a setting that defines a GRPO run (:data:`TRL_RUN_DEFAULTS`), or a switch (true/false)
    that the rule table translates or checks. Its default is part of TRL's algorithm as much
    as a number is: ``mask_truncated_completions=False`` turns the preset's overlong filter
    off. ``bf16`` is the exception (:func:`trl_names`)."""
    if name in TRL_RUN_DEFAULTS:
        return True
    rule = TRL.get(name)
    return (
        isinstance(value, bool)
        and name != "bf16"
        and rule is not None
        and (rule.key is not None or rule.convert is not None)
    )


def trl_names(args: Any) -> dict[str, Any]:
    """The names of a TRL ``GRPOConfig`` (or any ``TrainingArguments``) that are taken: those
    :func:`taken_at_default` names at any value, and any other whose value differs from a
    fresh config's (what its user set); None values (TRL's "not set") are left out.

    ``bf16`` is taken only when set away from TRL's default (true unless ``fp16``): that
    default is a choice for the machine, which ``train.precision=auto`` makes too (bf16-mixed
    on CUDA), where bf16=True would force it onto a CPU without native bf16 (~100x slower)."""
    same_machine = {
        k: getattr(args, k) for k in ("output_dir", "bf16", "fp16", "use_cpu") if hasattr(args, k)
    }
    fresh = None  # built as the user's was: fields its __post_init__ derives agree
    # bf16 is compared apart (below), so a machine that refuses it may build one without
    for machine in (same_machine, {**same_machine, "bf16": False}):
        try:
            fresh = type(args)(**machine)
            break
        except Exception:  # a subclass that needs more: compare with the field defaults
            continue
    out = {}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.name == "bf16":
            declared = f.default if f.default is not dataclasses.MISSING else None
            default = (not getattr(args, "fp16", False)) if declared is None else declared
        elif fresh is not None:
            default = getattr(fresh, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = object()
        if taken_at_default(f.name, value) or _differs(value, default):
            out[f.name] = value
    if out.get("epsilon_high") is None and "epsilon" in out:  # TRL: symmetric clipping
        out["epsilon_high"] = out["epsilon"]
    return {k: v for k, v in out.items() if v is not None}


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except Exception:
        return True


def is_trl_config(obj: Any) -> bool:
    """Whether ``obj`` is a TRL config object (``GRPOConfig`` or another TrainingArguments)."""
    return dataclasses.is_dataclass(obj) and any(
        c.__module__.split(".")[0] in ("trl", "transformers")
        and c.__name__.endswith(("Config", "Arguments"))
        for c in type(obj).__mro__
    )


def trl_field_names() -> frozenset[str]:
    """Every option name of TRL's ``GRPOConfig`` (its own and ``TrainingArguments``'), when
    TRL is installed: such a name is never answered with a look-alike dapo key."""
    try:
        from trl import GRPOConfig
    except Exception:
        return frozenset(TRL)
    return frozenset(f.name for f in dataclasses.fields(GRPOConfig)) | frozenset(TRL)
