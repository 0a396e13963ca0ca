"""verl's option names and their rules (:mod:`dapo.config.foreign` applies them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dapo.config.foreign_rules import (
    Rule,
    bool_to,
    false_only,
    ignore,
    mapped,
    never_is_zero,
    refuse,
    report_to,
    same,
)

_A, _R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."


def _custom_reward(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    path = given.get("custom_reward_function.path")
    name = given.get("custom_reward_function.name") or "compute_score"
    return {"reward.functions": [{"name": f"{path}:{name}"}]} if path else {}


def _kl_loss(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """verl's KL loss: on with use_kl_loss (default off), its coefficient kl_loss_coef."""
    if not given.get(_A + "use_kl_loss", False):
        return {"algorithm.beta": 0.0}
    return {"algorithm.beta": float(given.get(_A + "kl_loss_coef", 0.001))}  # verl's default


_KL_LOSS = Rule(
    convert=_kl_loss, note="kl_loss_coef (verl's default 0.001) when use_kl_loss, else 0"
)


def _grpo_advantage(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """verl's GRPO advantage: divided by the group's std unless norm_adv_by_std_in_grpo is
    false (Dr. GRPO)."""
    estimator = given.get("algorithm.adv_estimator", "grpo")
    if estimator != "grpo":
        raise ValueError(
            f"algorithm.adv_estimator = {estimator!r} has no equivalent here (dapo takes 'grpo')"
        )
    if given.get("algorithm.norm_adv_by_std_in_grpo", True):
        return {"algorithm.advantage_scale": "group"}
    return {"algorithm.advantage_scale": "none"}


_GRPO_ADVANTAGE = Rule(convert=_grpo_advantage, note="norm_adv_by_std_in_grpo false -> none")


def _engine_name(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value in ("vllm", "hf"):
        return {"rollout.engine": value}
    raise ValueError(f"its value {value!r} has no equivalent here (dapo takes 'vllm', 'hf')")


VERL: dict[str, Rule] = {
    "data.train_files": same("data.train"),
    "data.val_files": same("data.eval"),
    "data.train_batch_size": same("train.prompts_per_step"),
    "data.max_prompt_length": same("data.max_prompt_length"),
    "data.max_response_length": same("rollout.max_completion_length"),
    "data.prompt_key": same("data.prompt_key"),
    "data.shuffle": same("data.shuffle"),
    "data.gen_batch_size": ignore("dynamic sampling sizes its rounds itself"),
    "data.filter_overlong_prompts": ignore("dapo always drops prompts over data.max_prompt_length"),
    "data.truncation": ignore("over-long prompts are dropped, never truncated"),
    "actor_rollout_ref.model.path": same("model.name_or_path"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": same("model.gradient_checkpointing"),
    "actor_rollout_ref.model.use_remove_padding": bool_to("train.packing", True, False),
    "actor_rollout_ref.model.lora_rank": same("model.lora.rank"),
    "actor_rollout_ref.model.lora_alpha": same("model.lora.alpha"),
    _A + "optim.lr": same("train.lr"),
    _A + "optim.lr_warmup_steps": same("train.warmup_steps"),
    _A + "optim.weight_decay": same("train.weight_decay"),
    _A + "ppo_mini_batch_size": same("train.mini_batch_size"),
    _A + "ppo_epochs": same("train.epochs"),
    _A + "ppo_micro_batch_size_per_gpu": ignore(
        "dapo packs micro-batches by train.micro_batch_tokens"
    ),
    _A + "ppo_max_token_len_per_gpu": same("train.micro_batch_tokens"),
    _A + "use_dynamic_bsz": ignore("dapo always packs micro-batches by tokens"),
    _A + "clip_ratio_low": same("algorithm.clip_low"),
    _A + "clip_ratio_high": same("algorithm.clip_high"),
    _A + "clip_ratio": same("algorithm.clip_low"),
    _A + "clip_ratio_c": same("algorithm.clip_c"),
    _A + "loss_agg_mode": mapped(
        "algorithm.loss_agg",
        {
            "token-mean": "token-mean",
            "seq-mean-token-mean": "seq-mean-token-mean",
            "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",
        },
    ),
    _A + "policy_loss.loss_mode": mapped(
        "algorithm.policy_loss", {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo"}
    ),
    _A + "entropy_coeff": same("algorithm.entropy_coef"),
    _A + "use_kl_loss": _KL_LOSS,
    _A + "kl_loss_coef": _KL_LOSS,
    _A + "kl_loss_type": mapped(
        "algorithm.kl_estimator", {"low_var_kl": "k3", "k3": "k3", "kl": "k1", "k1": "k1"}
    ),
    _A + "grad_clip": same("train.max_grad_norm"),
    _A + "strategy": ignore("dapo shards with FSDP2 under torchrun (train.data_parallel)"),
    _R + "n": same("rollout.num_generations"),
    _R + "temperature": same("rollout.temperature"),
    _R + "top_p": same("rollout.top_p"),
    _R + "top_k": Rule(
        convert=lambda v, _: {"rollout.top_k": max(int(v), 0)}, note="-1 -> 0 (off)"
    ),
    _R + "name": Rule(convert=_engine_name, note="vllm / hf"),
    _R + "gpu_memory_utilization": same("rollout.vllm_gpu_memory_utilization"),
    _R + "tensor_model_parallel_size": refuse("one engine per rank here; no tensor parallelism"),
    _R + "log_prob_micro_batch_size_per_gpu": ignore("log-probs are packed by tokens"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ignore("packed by tokens"),
    "algorithm.adv_estimator": _GRPO_ADVANTAGE,
    "algorithm.norm_adv_by_std_in_grpo": _GRPO_ADVANTAGE,
    "algorithm.use_kl_in_reward": false_only(
        "a KL penalty in the reward has no equivalent: dapo's KL is a loss term (algorithm.beta)"
    ),
    "algorithm.filter_groups.enable": same("algorithm.dynamic_sampling"),
    "algorithm.filter_groups.metric": mapped(
        "algorithm.dynamic_sampling_metric",
        {"acc": "acc", "score": "reward", "seq_reward": "reward"},
    ),
    "algorithm.filter_groups.max_num_gen_batches": same("algorithm.max_gen_rounds"),
    "reward_model.reward_manager": ignore("dapo's scorer runs reward functions in workers"),
    "reward_model.overlong_buffer.enable": same("algorithm.overlong_penalty"),
    "reward_model.overlong_buffer.len": same("algorithm.overlong_buffer"),
    "reward_model.overlong_buffer.penalty_factor": same("algorithm.overlong_penalty_factor"),
    "reward_model.enable": false_only(
        "a learned reward model is not supported: give reward functions"
    ),
    "custom_reward_function.path": Rule(
        convert=_custom_reward, note="reward.functions=[path:name]"
    ),
    "custom_reward_function.name": ignore("read with custom_reward_function.path"),
    "trainer.total_training_steps": same("train.steps"),
    "trainer.total_epochs": refuse(
        "dapo counts rollout steps: set train.steps (an epoch is len(data) / "
        "train.prompts_per_step steps)"
    ),
    "trainer.save_freq": never_is_zero("checkpoint.save_every"),
    "trainer.test_freq": never_is_zero("logging.eval_every"),
    "trainer.default_local_dir": same("output_dir"),
    "trainer.experiment_name": same("logging.run_name"),
    "trainer.project_name": same("logging.wandb_project"),
    "trainer.val_before_train": same("evaluate"),
    "trainer.resume_mode": mapped("resume", {"auto": True, "disable": False}),
    "trainer.logger": Rule(convert=report_to, note="wandb / tensorboard"),
    "trainer.n_gpus_per_node": refuse("launch one process per GPU with torchrun --nproc-per-node"),
    "trainer.nnodes": refuse("launch with torchrun --nnodes"),
    "trainer.critic_warmup": ignore("no critic in GRPO-family runs"),
}

# The first part of a key that only verl uses (dapo has data. and algorithm. too).
VERL_ROOTS = frozenset(
    {"actor_rollout_ref", "critic", "reward_model", "custom_reward_function", "trainer"}
)
