"""The configuration schema: one dataclass per section, every field with its help text.

Each field is declared with :func:`opt`, which stores the help text (what the knob does, its
unit, and the paper that defines it) and, for enumerated fields, the allowed names in the
field's metadata. The names come from the modules that implement them
(:mod:`dapo.algorithms`, :mod:`dapo.choices`), so each list is written once.
``dapo train --help-config`` prints it all (:func:`describe_config`).

The defaults are the ``dapo`` preset on a scale that trains on a CPU in minutes; where the
paper's own run (Qwen2.5-32B) used another value, the help says which.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from dapo.choices import (
    ADVANTAGE_SCALES,
    CURRICULA,
    DATA_PARALLEL_MODES,
    DYNAMIC_SAMPLING_METRICS,
    ENGINES,
    ENTROPY_CONTROLS,
    IS_LEVELS,
    IS_MODES,
    KL_KINDS,
    LOSS_AGG_MODES,
    LR_SCHEDULES,
    POLICY_LOSSES,
    PRECISIONS,
    ROUND_CAP_ACTIONS,
)
from dapo.config.presets import PRESETS


def opt(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: tuple[str, ...] | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field with ``metadata={"help": ..., "choices": ...}``.

    ``factory`` replaces ``default`` for mutable defaults (lists, dicts, sections).
    """
    metadata: dict[str, Any] = {"help": " ".join(help.split())}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass
class LoraConfig:
    """LoRA adapters (peft, the ``lora`` extra): train low-rank updates ``(alpha/r) B A`` of
    the target layers instead of the whole model; rank 0 trains the whole model."""

    rank: int = opt(
        0,
        "LoRA rank r; 0 disables LoRA (full fine-tuning). With r > 0 checkpoints hold the "
        "adapters and their optimizer state only, and final_model the merged weights.",
    )
    alpha: float = opt(
        32.0, "LoRA alpha: the update is scaled by alpha / rank (peft's lora_alpha)."
    )
    target_modules: list[str] = opt(
        help="Names of the linear layers that get adapters (peft matches the end of each "
        "module path, e.g. q_proj, v_proj); [all-linear]: every linear layer but the output layer.",
        factory=lambda: ["all-linear"],
    )
    dropout: float = opt(0.0, "Dropout on the adapters' input (peft's lora_dropout), in [0, 1).")


@dataclass
class ModelConfig:
    """The policy to train."""

    name_or_path: str = opt(
        "builtin:tiny",
        "The policy: a local directory, a Hugging Face hub id, a .gguf file (dequantised to "
        "transformers format once, cached in the dapo cache), or a built-in ~1M-parameter "
        "Llama that trains on a CPU: builtin:tiny (warmed up on builtin:addition) or "
        "builtin:tiny-long (on builtin:long_addition). The DAPO paper trains Qwen2.5-32B base.",
    )
    tokenizer: str | None = opt(
        None, "Tokenizer directory or hub id; null: the one of model.name_or_path."
    )
    trust_remote_code: bool = opt(
        False,
        "Run the model's own Python code from its repository (transformers' "
        "trust_remote_code); only for sources you trust.",
    )
    gradient_checkpointing: bool = opt(
        False,
        "Recompute each decoder layer's activations during the backward pass instead of "
        "keeping them: activation memory of one layer instead of all, about a third more "
        "compute per update. Works with train.shared_prompt_forward.",
    )
    lora: LoraConfig = opt(help="LoRA adapters; model.lora.rank > 0 turns them on.",
                           factory=LoraConfig)


@dataclass
class DataConfig:
    """Training and held-out prompts (reference parquet format, JSONL, datasets, or builtin)."""

    train: str = opt(
        "builtin:addition",
        "Training prompts: a .parquet file in the DAPO-Math format (columns data_source, "
        "prompt, reward_model.ground_truth), a .jsonl/.json file, a directory of parquet "
        "files or from datasets' save_to_disk, a locally cached datasets name, or a built-in "
        "task: builtin:addition (1-2 digit sums) or builtin:long_addition (1-4 digits, made for "
        "the ablation ladder). Repeated prompts are dropped.",
    )
    eval: str | None = opt(
        "builtin:addition",
        "Held-out prompts for the accuracy before and after training (and every "
        "logging.eval_every steps), in the same forms as data.train; null disables evaluation.",
    )
    train_split: str = opt(
        "train", "Split of data.train to read when it is a datasets directory or name."
    )
    eval_split: str = opt(
        "test", "Split of data.eval to read when it is a datasets directory or name."
    )
    prompt_key: str = opt(
        "prompt", "Column holding the prompt: a string or a list of chat messages {role, content}."
    )
    answer_key: str = opt(
        "reward_model.ground_truth",
        "Column holding the reference answer; dots reach into nested fields "
        "(reward_model.ground_truth in the DAPO-Math data).",
    )
    data_source_key: str = opt(
        "data_source",
        "Column naming the data source of each row (e.g. math_dapo); it picks the scorer "
        "(reward.source_scorers) and splits the evaluation report.",
    )
    max_prompt_length: int = opt(
        128,
        "Prompts longer than this many tokens (after the chat template) are dropped, never "
        "truncated. Plus rollout.max_completion_length, it must fit the model's context.",
    )
    max_eval_prompts: int = opt(
        500, "Evaluate on at most this many held-out prompts (the first ones)."
    )
    shuffle: bool = opt(
        True, "Visit the training prompts in a random order drawn from `seed`; false: file order."
    )
    curriculum: str = opt(
        "none",
        "Order of the training prompts. none: a shuffled pass per epoch. easy_first: "
        "competence-paced (Platanios et al. 2019): at rollout step s prompts are drawn from "
        "the easiest share c(s) of the data, c growing like a square root from "
        "data.curriculum_start to 1 over data.curriculum_steps; difficulty from "
        "data.difficulty_key, else the pass rate measured so far.",
        choices=CURRICULA,
    )
    difficulty_key: str | None = opt(
        None,
        "data.curriculum=easy_first: field holding each prompt's difficulty as a number, "
        "higher = harder (dots reach nested fields; builtin:addition has `carries`); null: "
        "1 - the pass rate measured during training (prompts not generated yet count as average).",
    )
    curriculum_steps: int = opt(
        0,
        "data.curriculum=easy_first: rollout steps until every prompt is in the pool; 0: half "
        "of train.steps.",
    )
    curriculum_start: float = opt(
        0.2,
        "data.curriculum=easy_first: the share of the prompts (the easiest) in the pool at "
        "step 0, in (0, 1].",
    )


@dataclass
class RolloutConfig:
    """Sampling of responses (names as in TRL where the meaning is the same)."""

    engine: str = opt(
        "hf",
        "Generation backend: hf (dapo's sampling loop on the transformers policy itself), vllm "
        "(the vllm extra: an engine in the training process, one per rank under torchrun, that "
        "receives the policy's weights, see rollout.vllm_sync_every) or vllm-server (a `dapo "
        "vllm-serve` process at rollout.server_url, on its own GPUs; weights pushed to it from "
        "rank 0 over a process group).",
        choices=ENGINES,
    )
    server_url: str | None = opt(
        None,
        "engine=vllm-server: the rollout server's address, http://HOST:PORT (what `dapo "
        "vllm-serve` prints). Every rank sends its prompts there; the server must reach the "
        "trainer's rank 0 back for the weight pushes.",
    )
    server_timeout_s: float = opt(
        600.0,
        "engine=vllm-server: seconds to wait for the server to come up, and for each of its "
        "answers (a whole generation call), before stopping with an error that names it.",
    )
    async_steps: int = opt(
        0,
        "1: one-step-asynchronous rollouts: the engine generates the next step's batch while "
        "the trainer trains on this one (sampled by the policy one update older; "
        "rollout/staleness). Needs engine=vllm or vllm-server. 0: generate, then train.",
    )
    num_generations: int = opt(
        8,
        "G, the responses sampled per prompt (the group whose rewards are normalised "
        "together in GRPO and DAPO); at least 2. The DAPO paper uses 16.",
    )
    temperature: float = opt(
        1.0,
        "Sampling temperature of the training rollouts; the loss's log-probs use the same "
        "temperature. The DAPO paper uses 1.0.",
    )
    top_p: float = opt(
        1.0,
        "Nucleus sampling of the training rollouts, in (0, 1]; 1.0 disables it (the DAPO "
        "paper's value).",
    )
    top_k: int = opt(0, "Sample only from the k most likely tokens; 0 disables it.")
    max_completion_length: int = opt(
        64,
        "L_max, the cap on a response in tokens (TRL: max_completion_length); a response "
        "without an end-of-sequence token by then is truncated. The DAPO paper uses 20480 "
        "(16384 expected tokens + the 4096-token overlong buffer).",
    )
    generation_batch_size: int = opt(
        256,
        "Sequences (prompts x responses) generated together; bounds the generation memory, "
        "not the training batch.",
    )
    eval_temperature: float = opt(
        1.0,
        "Sampling temperature of the held-out evaluation; 0 is greedy. The DAPO paper "
        "evaluates at 1.0.",
    )
    eval_top_p: float = opt(
        1.0,
        "Nucleus sampling of the held-out evaluation, in (0, 1]. The DAPO paper evaluates "
        "with 0.7 (the default of `dapo eval`).",
    )
    eval_num_generations: int = opt(
        1,
        "Responses per held-out prompt; the reported accuracy is avg@k over them (the DAPO "
        "paper reports avg@32 on AIME 2024).",
    )
    vllm_sync_every: int = opt(
        1,
        "engine=vllm: push the policy's weights to vLLM every k optimizer updates; 1 keeps "
        "it current, a larger k samples from a slightly older policy.",
    )
    vllm_gpu_memory_utilization: float = opt(
        0.3,
        "engine=vllm on a GPU: the share of the GPU's memory vLLM may take (weights and KV "
        "cache), in (0, 1]; the trainer needs the rest.",
    )
    vllm_sleep: bool = opt(
        True,
        "engine=vllm on a GPU: release vLLM's memory while the trainer trains and take it "
        "back to generate.",
    )


@dataclass
class RewardFunctionConfig:
    """A reward function: a built-in scorer name or ``module:function``, and its weight."""

    name: str = opt(
        "dapo_math",
        "A built-in scorer (dapo_math, math_verify) or module:function, called as "
        "fn(response, ground_truth[, data_source=...]) and returning a number.",
    )
    weight: float = opt(1.0, "Multiplier of this function's score in the summed reward.")


@dataclass
class RewardConfig:
    """How responses are scored."""

    functions: list[RewardFunctionConfig] = opt(
        help="Reward functions whose weighted scores are summed, each {name, weight}; "
        "empty: one built-in scorer per row, picked by its data source "
        "(reward.source_scorers, else reward.default_scorer).",
        factory=list,
    )
    default_scorer: str = opt(
        "dapo_math",
        "Built-in scorer for data sources not in reward.source_scorers. dapo_math is the "
        "DAPO reference: +1 if the last `Answer:` line matches the ground truth after "
        "normalisation, -1 otherwise.",
    )
    source_scorers: dict[str, str] = opt(
        help="data_source -> built-in scorer name, e.g. {math_dapo: dapo_math}.", factory=dict
    )
    timeout_s: float = opt(
        5.0,
        "Seconds one reward call may take before its worker is killed and the response "
        "scores -1 (symbolic checkers can hang on adversarial answers).",
    )
    num_workers: int = opt(
        1,
        "Reward worker processes; 0 scores in the trainer's process without a timeout "
        "(for debugging only).",
    )


@dataclass
class AlgorithmConfig:
    """The DAPO knobs; presets set these (``dapo presets`` lists them)."""

    policy_loss: str = opt(
        "ppo",
        "The policy-gradient loss (verl: policy_loss.loss_mode). ppo: PPO's clipped "
        "per-token ratio, with DAPO's decoupled bounds; gspo: GSPO's one ratio per response, "
        "the length-normalised sequence likelihood ratio, clipped as a whole (arXiv "
        "2507.18071; needs loss_agg=seq-mean-token-mean, preset=gspo); cispo: CISPO's "
        "clipped importance weight as a stop-gradient coefficient of log pi, every token "
        "keeps its gradient (MiniMax-M1, arXiv 2506.13585; preset=cispo).",
        choices=POLICY_LOSSES,
    )
    clip_low: float = opt(
        0.2,
        "Lower clip range eps_low: the probability ratio is clipped below at 1 - eps_low "
        "(TRL: epsilon). The DAPO paper keeps it at 0.2; a large one pushes probabilities to 0. "
        "1 removes the lower bound (CISPO). GSPO's paper uses 3e-4 on its sequence ratio.",
    )
    clip_high: float = opt(
        0.28,
        "Upper clip range eps_high (Clip-Higher): the ratio is clipped above at 1 + eps_high "
        "(TRL: epsilon_high); the DAPO paper uses 0.28, GRPO a symmetric 0.2, GSPO 4e-4, "
        "CISPO (as ScaleRL) 4 (a weight cap of 5). Clipping acts only with several "
        "optimizer updates per rollout step.",
    )
    clip_c: float | None = opt(
        None,
        "Dual-clip constant c > 1 (Ye et al. 2020, dual-clip PPO): for negative advantages "
        "the loss is also bounded by c * A; null disables it (as in DAPO). policy_loss=ppo only.",
    )
    loss_agg: str = opt(
        "token-mean",
        "How per-token losses become one loss (TRL: loss_type). token-mean is DAPO's "
        "token-level loss (sum over every token of the batch / their count); "
        "seq-mean-token-mean is GRPO's (mean per response, then over responses); "
        "seq-mean-token-sum-norm is Dr. GRPO's (token sum / (responses x L_max)).",
        choices=LOSS_AGG_MODES,
    )
    advantage_scale: str = opt(
        "group",
        "Advantage normalisation: group is GRPO's and DAPO's ((R - group mean) / group "
        "std); batch subtracts the group mean and divides by the std over the whole batch; "
        "none is Dr. GRPO's (R - group mean, no std division).",
        choices=ADVANTAGE_SCALES,
    )
    beta: float = opt(
        0.0,
        "KL penalty coefficient against the initial policy. DAPO uses 0 (no KL term, the "
        "long-CoT policy is meant to move away); 0 loads no reference model.",
    )
    kl_estimator: str = opt(
        "k3",
        "Per-token KL estimator when beta > 0: k1 = log-ratio, k2 = half the squared "
        "log-ratio, k3 = pi_ref/pi - log(pi_ref/pi) - 1 (GRPO's; unbiased, non-negative).",
        choices=KL_KINDS,
    )
    dynamic_sampling: bool = opt(
        True,
        "Dynamic Sampling (DAPO): over-sample, drop the groups whose G responses are all "
        "right or all wrong (zero advantage, no gradient) and keep generating until "
        "train.prompts_per_step groups remain.",
    )
    dynamic_sampling_metric: str = opt(
        "acc",
        "What must differ within a group to keep it: acc (correctness, the paper's "
        "0 < correct < G) or reward (the shaped reward, overlong penalty included).",
        choices=DYNAMIC_SAMPLING_METRICS,
    )
    max_gen_rounds: int = opt(
        8,
        "Generation rounds dynamic sampling may take in one rollout step to fill the batch; "
        "algorithm.round_cap says what happens when they do not fill it.",
    )
    round_cap: str = opt(
        "train",
        "When algorithm.max_gen_rounds rounds leave the batch short: train on the groups "
        "with a learning signal found so far (fewer updates, see train.mini_batch_size; no "
        "update when there are none) with a warning, or stop the run with an error (the "
        "groups found are kept for resume=true; the reference recipe stops).",
        choices=ROUND_CAP_ACTIONS,
    )
    max_empty_steps: int = opt(
        3,
        "With algorithm.round_cap=train: this many rollout steps in a row without any group "
        "with a learning signal (their updates skipped) stop the run.",
    )
    skip_uniform_prompts: bool = opt(
        False,
        "Before generation, skip a prompt whose latest n groups were all uniform (all "
        "correct or all wrong) with probability skip_max_prob * (1 - 2^-n), so that "
        "generation goes where dynamic sampling keeps it. Pays off where a prompt's "
        "difficulty persists (data the model always or never solves, over several epochs); "
        "changes which prompts are generated, never the loss.",
    )
    skip_max_prob: float = opt(
        0.9,
        "skip_uniform_prompts: the cap on a prompt's skip probability, in [0, 1): every "
        "prompt is still generated now and then (exploration).",
    )
    skip_key: str | None = opt(
        None,
        "Field whose value keys the prompts' outcome history (of skip_uniform_prompts and of "
        "data.curriculum by measured pass rate), so that rows sharing it share a history "
        "(e.g. a problem id shared by paraphrases; dots reach nested fields); null: each "
        "distinct prompt has its own.",
    )
    overlong_filter: bool = opt(
        True,
        "Overlong filtering (DAPO): mask out the loss of truncated responses (no "
        "end-of-sequence token within rollout.max_completion_length).",
    )
    overlong_penalty: bool = opt(
        True,
        "Soft overlong punishment (DAPO): add a length penalty to the reward, 0 up to "
        "L_max - L_cache tokens, then a linear ramp down to -1 at L_max.",
    )
    overlong_buffer: int = opt(
        16,
        "L_cache, the soft overlong punishment ramp in tokens (the buffer before L_max = "
        "rollout.max_completion_length); DAPO uses 4096 with L_max 20480. Must be below L_max.",
    )
    overlong_penalty_factor: float = opt(
        1.0,
        "Multiplier of the soft overlong penalty; 1.0 (DAPO) lets it reach -1 at L_max.",
    )
    is_cap: float | None = opt(
        None,
        "Correct the gap between the rollout engine's sampling distribution and the "
        "trainer's (vLLM kernels, bf16, weights synced every k updates) with the importance "
        "ratio rho = pi_trainer_old / pi_engine of the sampled tokens, bounded by this cap "
        "C >= 1 (algorithm.is_level, algorithm.is_mode); null disables it. TIS (Yao et al. "
        "2025) uses token truncate with C = 2; TRL defaults to sequence mask with C = 3.",
    )
    is_level: str = opt(
        "token",
        "is_cap: token weighs each token by its own rho_t; sequence weighs every token of a "
        "response by the response's rho = prod_t rho_t (its likelihood ratio).",
        choices=IS_LEVELS,
    )
    is_mode: str = opt(
        "truncate",
        "is_cap: truncate weighs by min(rho, C) (TIS); mask weighs by rho and drops the "
        "tokens (is_level=token) or responses (sequence) with rho > C from the loss and "
        "from its denominator, as overlong filtering does.",
        choices=IS_MODES,
    )
    entropy_coef: float = opt(
        0.0,
        "Entropy bonus: subtract entropy_coef x the policy entropy (aggregated like the "
        "policy loss) from the loss, to keep exploring (verl: entropy_coeff; 0 in DAPO). "
        "Sensitive: the entropy paper (arXiv 2505.22617) saw 1e-4..1e-3 do little and 1e-2 "
        "blow the entropy up.",
    )
    entropy_control: str = opt(
        "none",
        "Covariance-based entropy control (arXiv 2505.22617), on the few tokens whose "
        "log-prob and advantage covary most: clip_cov drops the gradient of a random "
        "algorithm.clip_cov_ratio share of the tokens with covariance in (clip_cov_low, "
        "clip_cov_high); kl_cov adds kl_cov_coef x |log pi - log pi_old| to the top "
        "algorithm.kl_cov_ratio share and uses the unclipped ratio (clip_low/high unused). "
        "Selected over the whole mini-batch from the old policy's log-probs. policy_loss=ppo only.",
        choices=ENTROPY_CONTROLS,
    )
    clip_cov_ratio: float = opt(
        2e-4, "entropy_control=clip_cov: share of the loss tokens whose gradient is dropped (paper: 2e-4)."
    )
    clip_cov_low: float = opt(
        1.0, "entropy_control=clip_cov: lower covariance bound of the candidates (paper: 1)."
    )
    clip_cov_high: float = opt(
        5.0, "entropy_control=clip_cov: upper covariance bound of the candidates (paper: 5)."
    )
    kl_cov_ratio: float = opt(
        2e-3,
        "entropy_control=kl_cov: share of the loss tokens (largest covariance) that get the "
        "KL penalty (paper: 2e-3 for Qwen2.5-7B, 2e-4 for 32B).",
    )
    kl_cov_coef: float = opt(
        1.0, "entropy_control=kl_cov: coefficient of the |log-ratio| penalty (paper: 1)."
    )


@dataclass
class TrainConfig:
    """Optimisation. Batch sizes count prompts (each with G responses) unless noted."""

    steps: int = opt(
        150,
        "Rollout steps (each: generate, score, filter, then optimizer updates); 0 only evaluates.",
    )
    prompts_per_step: int = opt(
        16,
        "Prompts with a learning signal per rollout step (the training batch, each with G "
        "responses). The DAPO paper uses 512.",
    )
    mini_batch_size: int = opt(
        16,
        "Prompts per optimizer update; must divide train.prompts_per_step, and "
        "prompts_per_step / mini_batch_size is the number of updates per rollout step. "
        "The DAPO paper: 512 / 32 prompts (512 responses) = 16 updates. A short batch of "
        "n prompts (algorithm.round_cap=train) gets ceil(n / mini_batch_size) updates of "
        "near-equal size.",
    )
    epochs: int = opt(1, "Passes over each rollout batch (PPO epochs).")
    micro_batch_tokens: int = opt(
        16384,
        "Token budget of one forward/backward pass; gradients accumulate over the "
        "micro-batches of an update. Bounds memory; the loss is normalised over the whole "
        "update, so it does not change the gradient.",
    )
    shared_prompt_forward: bool = opt(
        True,
        "Forward each prompt once per micro-batch and its responses on top of it (exact, "
        "by causal attention), instead of prompt + response for every response.",
    )
    lr: float = opt(
        1.5e-4,
        "AdamW learning rate after warm-up. The DAPO paper uses 1e-6 for Qwen2.5-32B; the "
        "default suits builtin:tiny.",
    )
    lr_schedule: str = opt(
        "constant",
        "Learning rate after warm-up: constant (the DAPO paper's) or cosine down to "
        "train.min_lr_ratio x lr at the last step.",
        choices=LR_SCHEDULES,
    )
    warmup_steps: int = opt(
        5, "Linear learning-rate warm-up, in rollout steps. The DAPO paper uses 20."
    )
    min_lr_ratio: float = opt(0.1, "lr_schedule=cosine: the final learning rate as a share of lr.")
    weight_decay: float = opt(
        0.1,
        "AdamW weight decay, on matrices only (not biases or norms); the DAPO reference "
        "scripts use 0.1.",
    )
    adam_beta1: float = opt(0.9, "AdamW beta1, the decay of the gradient's running mean.")
    adam_beta2: float = opt(0.999, "AdamW beta2, the decay of the squared gradient's running mean.")
    max_grad_norm: float = opt(
        1.0,
        "Clip the global gradient norm of each update to this; 0 disables it. The DAPO "
        "reference scripts use 1.0.",
    )
    precision: str = opt(
        "auto",
        "Numeric precision of the policy. fp32: weights, gradients and AdamW state in float32 "
        "(16 bytes per parameter). bf16-mixed: the same float32 states, forward and backward "
        "in bfloat16 (torch autocast; FSDP: bf16 parameters, float32 gradient reduction), "
        "about half the activation memory and much faster on GPUs. bf16: weights and AdamW "
        "state in bfloat16 (~8 bytes per parameter); updates smaller than ~1/256 of a "
        "weight round away, so small learning rates (the paper's 1e-6) barely train. auto: "
        "bf16-mixed on CUDA, fp32 on CPU. Log-probs, ratios, loss and entropy are float32 "
        "in every mode; generation runs in the forward's precision.",
        choices=PRECISIONS,
    )
    logits_chunk_size: int = opt(
        1024,
        "Response positions per chunk when the output layer, log-softmax and entropy are "
        "computed (and recomputed in backward): the float32 logits exist for one chunk of "
        "positions x vocabulary at a time, never for the whole micro-batch.",
    )
    max_nonfinite_updates: int = opt(
        3,
        "Updates with a NaN or inf loss or gradient are skipped; this many in a row stop the run.",
    )
    sample_budget: int = opt(
        0,
        "Stop once this many responses have been generated (every dynamic sampling round "
        "counts), for comparisons at equal generation cost; 0 disables it.",
    )
    data_parallel: str = opt(
        "auto",
        "Under torchrun: fsdp shards the parameters (FSDP2), ddp replicates them; auto is "
        "fsdp on GPUs (where fully_shard works) and ddp on CPU (faster there for models "
        "that fit).",
        choices=DATA_PARALLEL_MODES,
    )


@dataclass
class LoggingConfig:
    """Where metrics go."""

    console: bool = opt(
        True,
        "Show a progress bar and periodic metric summaries on the terminal "
        "(output_dir/metrics.jsonl is always written).",
    )
    tensorboard: bool = opt(True, "Write TensorBoard event files under output_dir/tensorboard.")
    wandb: bool = opt(False, "Log to Weights & Biases (needs the wandb package).")
    wandb_project: str = opt("dapo", "Weights & Biases project.")
    run_name: str | None = opt(None, "Weights & Biases run name; null lets wandb pick one.")
    eval_every: int = opt(
        0,
        "Held-out evaluation every N rollout steps; 0: only before and after training.",
    )


@dataclass
class CheckpointConfig:
    """Periodic and final checkpoints."""

    save_every: int = opt(
        20,
        "Save a resumable checkpoint (policy, optimizer, prompt position, dynamic sampling "
        "carry-over, prompt outcome history, random state) every N rollout steps; 0 saves "
        "only at the end.",
    )
    keep_last: int = opt(2, "Step checkpoints to keep; older ones are deleted.")
    save_final_model: bool = opt(
        True,
        "Save the final policy with save_pretrained to output_dir/final_model (loadable by "
        "transformers, vLLM and `dapo eval`).",
    )


def _doc(cls: type) -> str:
    """A section's help: its docstring, with reST literals as Markdown ones."""
    return (cls.__doc__ or "").replace("``", "`")


@dataclass
class Config:
    """A whole run."""

    output_dir: str = opt(
        "runs/default",
        "Run directory: config.yaml, metrics.jsonl, dashboard.png, checkpoints/, final_model/.",
    )
    seed: int = opt(0, "Random seed of the prompt order, the sampling and every other random draw.")
    preset: str = opt(
        "dapo",
        "Named settings applied before the YAML file and the overrides; one of "
        f"{', '.join(PRESETS)} (`dapo presets` describes them).",
    )
    resume: bool = opt(
        False,
        "Continue from the newest checkpoint in output_dir (without it, a directory that "
        "holds checkpoints is refused).",
    )
    evaluate: bool = opt(True, "Measure the held-out accuracy before and after training.")
    model: ModelConfig = opt(help=_doc(ModelConfig), factory=ModelConfig)
    data: DataConfig = opt(help=_doc(DataConfig), factory=DataConfig)
    rollout: RolloutConfig = opt(help=_doc(RolloutConfig), factory=RolloutConfig)
    reward: RewardConfig = opt(help=_doc(RewardConfig), factory=RewardConfig)
    algorithm: AlgorithmConfig = opt(help=_doc(AlgorithmConfig), factory=AlgorithmConfig)
    train: TrainConfig = opt(help=_doc(TrainConfig), factory=TrainConfig)
    logging: LoggingConfig = opt(help=_doc(LoggingConfig), factory=LoggingConfig)
    checkpoint: CheckpointConfig = opt(help=_doc(CheckpointConfig), factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --- help text ------------------------------------------------------------------------------


def _show(value: Any) -> str:
    """A default as it would be written in YAML or in a ``key=value`` override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict) and not value:
        return "[]" if isinstance(value, list) else "{}"
    return str(value)


def _entry(path: str, f: dataclasses.Field, width: int) -> list[str]:
    choices = f.metadata.get("choices")
    kind = " | ".join(choices) if choices else str(f.type)
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:  # pragma: no cover - every field has a default
        default = "(required)"
    kind = kind.replace(" | None", " | null")
    lines = [f"  {path} = {_show(default)}    [{kind}]"]
    lines += textwrap.wrap(
        f.metadata.get("help", ""),
        width,
        initial_indent="      ",
        subsequent_indent="      ",
        break_on_hyphens=False,
    )
    return lines


def describe_config(width: int = 92) -> str:
    """Every key as ``section.key = default  [type or choices]`` with its help, by section."""
    intro = (
        "Config keys, set in a YAML file (sections as mappings) or as key.path=value "
        "overrides; the file beats the preset, the overrides beat the file. The defaults shown "
        "are the built-in ones, i.e. preset=dapo; the other presets change algorithm.* keys "
        "(`dapo presets`)."
    )
    out = [*textwrap.wrap(intro, width), "", "top level"]
    hints = typing.get_type_hints(Config)
    sections = []
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            sections.append(f)
        else:
            out += _entry(f.name, f, width)
    for sec in sections:
        out += ["", f"{sec.name}: {sec.metadata['help']}"]
        section_hints = typing.get_type_hints(hints[sec.name])
        subsections = []
        for f in dataclasses.fields(hints[sec.name]):
            if dataclasses.is_dataclass(section_hints[f.name]):  # listed after the section
                subsections.append(f)
                continue
            out += _entry(f"{sec.name}.{f.name}", f, width)
            if f.name == "functions":  # the fields of each item of the list
                for item in dataclasses.fields(RewardFunctionConfig):
                    path = f"{sec.name}.functions[i].{item.name}"
                    out += ["    " + line for line in _entry(path, item, width - 4)]
        for sub in subsections:  # e.g. model.lora
            out += ["", f"{sec.name}.{sub.name}: {sub.metadata['help']}"]
            for f in dataclasses.fields(section_hints[sub.name]):
                out += _entry(f"{sec.name}.{sub.name}.{f.name}", f, width)
    return "\n".join(out)
