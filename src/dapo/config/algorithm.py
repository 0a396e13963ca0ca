"""The ``algorithm`` section: the DAPO knobs that presets set and the loss reads.

:class:`~dapo.algorithms.objective.LossSettings` takes its defaults from here, so each
default is written once. Bounds are on the fields; the rules between them are in
:mod:`dapo.config.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo.choices import (
    AdvantageScale,
    DynamicSamplingMetric,
    EntropyControl,
    ISLevel,
    ISMode,
    KLKind,
    LossAgg,
    PolicyLoss,
    ProximalLogprobs,
    RoundCap,
)
from dapo.config.fields import opt

PAPER_BUFFER_SHARE = 0.2  # the paper's L_cache / L_max: 4096 / 20480


def overlong_buffer_for(max_len: int) -> int:
    """The overlong buffer the paper's ratio ties to ``max_len`` (L_max): 20%, rounded."""
    return round(PAPER_BUFFER_SHARE * max_len)


def overlong_buffer(buffer: int | None, max_len: int) -> int:
    """``algorithm.overlong_buffer`` as set, or (null) the paper's share of ``max_len``."""
    return overlong_buffer_for(max_len) if buffer is None else buffer


@dataclass
class AlgorithmConfig:
    """The DAPO knobs; presets set these (``dapo presets`` lists them)."""

    policy_loss: PolicyLoss = opt(
        "ppo",
        "The policy-gradient loss (verl: policy_loss.loss_mode). ppo: PPO's clipped "
        "per-token ratio, with DAPO's decoupled bounds; gspo: GSPO's one ratio per response, "
        "the length-normalised sequence likelihood ratio, clipped as a whole (arXiv "
        "2507.18071; needs loss_agg=seq-mean-token-mean, preset=gspo); cispo: CISPO's "
        "clipped importance weight as a stop-gradient coefficient of log pi, every token "
        "keeps its gradient (MiniMax-M1, arXiv 2506.13585; preset=cispo).",
    )
    clip_low: float = opt(
        0.2,
        "Lower clip range eps_low: the probability ratio is clipped below at 1 - eps_low "
        "(TRL: epsilon). The DAPO paper keeps it at 0.2; a large one pushes probabilities to 0. "
        "1 removes the lower bound (CISPO). GSPO's paper uses 3e-4 on its sequence ratio.",
        ge=0,
        le=1,
        hint="e.g. 0.2; 1: no lower bound",
        paper="0.2",
    )
    clip_high: float = opt(
        0.28,
        "Upper clip range eps_high (Clip-Higher): the ratio is clipped above at 1 + eps_high "
        "(TRL: epsilon_high); the DAPO paper uses 0.28, GRPO a symmetric 0.2, GSPO 4e-4, "
        "CISPO (as ScaleRL) 4 (a weight cap of 5). Clipping acts only with several "
        "optimizer updates per rollout step.",
        ge=0,
        hint="e.g. 0.28",
        paper="0.28",
    )
    clip_c: float | None = opt(
        None,
        "Dual-clip constant c > 1 (Ye et al. 2020, dual-clip PPO): for negative advantages "
        "the loss is also bounded by c * A; null disables it (as in DAPO). policy_loss=ppo only.",
        gt=1,
        hint="e.g. 3.0",
    )
    loss_agg: LossAgg = opt(
        "token-mean",
        "How per-token losses become one loss (TRL: loss_type). token-mean is DAPO's "
        "token-level loss (sum over every token of the batch / their count); "
        "seq-mean-token-mean is GRPO's (mean per response, then over responses); "
        "seq-mean-token-sum-norm is Dr. GRPO's (token sum / (responses x L_max)).",
        paper="token-mean",
    )
    advantage_scale: AdvantageScale = opt(
        "group",
        "Advantage normalisation: group is GRPO's and DAPO's ((R - group mean) / group "
        "std); batch subtracts the group mean and divides by the std over the whole batch; "
        "none is Dr. GRPO's (R - group mean, no std division).",
    )
    beta: float = opt(
        0.0,
        "KL penalty coefficient against the initial policy. DAPO uses 0 (no KL term, the "
        "long-CoT policy is meant to move away); 0 loads no reference model.",
        ge=0,
        hint="0: no KL term, as in DAPO",
        paper="0",
    )
    kl_estimator: KLKind = opt(
        "k3",
        "Per-token KL estimator when beta > 0: k1 = log-ratio, k2 = half the squared "
        "log-ratio, k3 = pi_ref/pi - log(pi_ref/pi) - 1 (GRPO's; unbiased, non-negative).",
    )
    dynamic_sampling: bool = opt(
        True,
        "Dynamic Sampling (DAPO): over-sample, drop the groups whose G responses are all "
        "right or all wrong (zero advantage, no gradient) and keep generating until "
        "train.prompts_per_step groups remain.",
        paper="true",
    )
    dynamic_sampling_metric: DynamicSamplingMetric = opt(
        "auto",
        "What must differ within a group to keep it: acc (correctness, the paper's "
        "0 < correct < G), reward (the shaped reward, overlong penalty included), or auto: "
        "acc where the reward says what correct is (a built-in scorer, a reward that "
        "returns only -1, 0 and 1, or a dict with an acc field), else the reward functions' "
        "score before the length shaping.",
    )
    keep_surplus: bool = opt(
        True,
        "Dynamic sampling: carry the groups with a learning signal beyond the batch over to "
        "the next rollout step (no qualifying rollout wasted; they were sampled by the "
        "policy one step older). false discards them, as the paper and its reference recipe "
        "do (preset dapo_paper).",
        paper="false",
    )
    max_gen_rounds: int = opt(
        8,
        "Generation rounds dynamic sampling may take in one rollout step to fill the batch; "
        "algorithm.round_cap says what happens when they do not fill it.",
        ge=1,
    )
    round_cap: RoundCap = opt(
        "train",
        "When algorithm.max_gen_rounds rounds leave the batch short: train on the groups "
        "with a learning signal found so far (fewer updates, see train.mini_batch_size; no "
        "update when there are none) with a warning, or stop the run with an error (the "
        "groups found are kept for resume=true; the reference recipe stops).",
    )
    max_empty_steps: int = opt(
        3,
        "With algorithm.round_cap=train: this many rollout steps in a row without any group "
        "with a learning signal (their updates skipped) stop the run.",
        ge=1,
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
        ge=0,
        lt=1,
        hint="e.g. 0.9; below 1 so that every prompt is still generated now and then",
    )
    skip_key: str | None = opt(
        None,
        "Field whose value keys the prompts' outcome history (of skip_uniform_prompts and of "
        "data.curriculum by measured pass rate), so that rows sharing it share a history "
        "(e.g. a problem id shared by paraphrases; dots reach nested fields); null: each "
        "distinct prompt has its own.",
        nonempty=True,
        hint="a data field; null: the prompt itself",
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
        paper="true",
    )
    overlong_buffer: int | None = opt(
        None,
        "L_cache, the soft overlong punishment ramp in tokens (the buffer before L_max = "
        "rollout.max_completion_length); DAPO uses 4096 with L_max 20480. Must be below L_max. "
        "null: 20% of L_max, the paper's ratio (13 at the default 64, 4096 at 20480).",
        ge=0,
        hint="e.g. 4096; null: 20% of rollout.max_completion_length",
        paper="4096",
    )
    overlong_penalty_factor: float = opt(
        1.0,
        "Multiplier of the soft overlong penalty; 1.0 (DAPO) lets it reach -1 at L_max.",
        paper="1.0",
    )
    is_cap: float | None = opt(
        None,
        "Correct the gap between the rollout engine's sampling distribution and the "
        "trainer's (vLLM kernels, bf16, weights synced every k updates) with the importance "
        "ratio rho = pi_trainer_old / pi_engine of the sampled tokens, bounded by this cap "
        "C >= 1 (algorithm.is_level, algorithm.is_mode); null disables it. TIS (Yao et al. "
        "2025) uses token truncate with C = 2; TRL defaults to sequence mask with C = 3.",
        ge=1,
        hint="e.g. 2.0 to truncate, 3.0 to mask",
    )
    proximal_logprobs: ProximalLogprobs = opt(
        "recompute",
        "Streaming rollouts (rollout.max_staleness > 0) with algorithm.is_cap: how the "
        "proximal policy's log-probs (the ratio's denominator, the weights at the start of "
        "the update) are had. recompute: a forward pass before the update (exact). loglinear: "
        "AReaL's approximation from the behaviour log-probs and the version gap, no extra "
        "pass (exact at the first update of a step; needs is_level=token, is_mode=truncate).",
    )
    is_level: ISLevel = opt(
        "token",
        "is_cap: token weighs each token by its own rho_t; sequence weighs every token of a "
        "response by the response's rho = prod_t rho_t (its likelihood ratio, which grows "
        "with the length); geometric by the geometric mean exp(mean_t log rho_t) (verl's and "
        "SkyRL's geo: the same cap for short and long responses).",
    )
    is_mode: ISMode = opt(
        "truncate",
        "is_cap: truncate weighs by min(rho, C) (TIS); mask weighs by rho and drops the "
        "tokens (is_level=token) or responses (sequence, geometric) with rho > C from the loss and "
        "from its denominator, as overlong filtering does.",
    )
    entropy_coef: float = opt(
        0.0,
        "Entropy bonus: subtract entropy_coef x the policy entropy (aggregated like the "
        "policy loss) from the loss, to keep exploring (verl: entropy_coeff; 0 in DAPO). "
        "Sensitive: the entropy paper (arXiv 2505.22617) saw 1e-4..1e-3 do little and 1e-2 "
        "blow the entropy up.",
        ge=0,
        hint="0: off; else a small positive coefficient, e.g. 1e-3",
    )
    entropy_control: EntropyControl = opt(
        "none",
        "Covariance-based entropy control (arXiv 2505.22617), on the few tokens whose "
        "log-prob and advantage covary most: clip_cov drops the gradient of a random "
        "algorithm.clip_cov_ratio share of the tokens with covariance in (clip_cov_low, "
        "clip_cov_high); kl_cov adds kl_cov_coef x |log pi - log pi_old| to the top "
        "algorithm.kl_cov_ratio share and uses the unclipped ratio (clip_low/high unused). "
        "Selected over the whole mini-batch from the old policy's log-probs. policy_loss=ppo only.",
    )
    clip_cov_ratio: float = opt(
        2e-4,
        "entropy_control=clip_cov: share of the loss tokens whose gradient is dropped "
        "(paper: 2e-4).",
        gt=0,
        le=1,
        hint="e.g. 2e-4",
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
        gt=0,
        le=1,
        hint="e.g. 2e-3",
    )
    kl_cov_coef: float = opt(
        1.0,
        "entropy_control=kl_cov: coefficient of the |log-ratio| penalty (paper: 1).",
        ge=0,
        hint="e.g. 1",
    )
    teacher: str | None = opt(
        None,
        "On-policy distillation: the teacher that scores every token the student samples, "
        "named as model.name_or_path is (a directory, hub id, .gguf file or built-in model) "
        "or server:http://HOST:PORT (a dapo vllm-serve of the teacher, scored with prompt "
        "log-probs). It must share the student's tokenizer. null: no teacher.",
        nonempty=True,
        hint="e.g. builtin:tiny-long or server:http://localhost:8001",
    )
    distill_coef: float = opt(
        1.0,
        "algorithm.teacher: lambda in the per-token advantage A_task + lambda * (log "
        "pi_teacher(o_t) - log pi_student(o_t)), the negative per-token reverse KL (k1) to the "
        "teacher (slime, tinker-cookbook).",
        gt=0,
        hint="e.g. 1.0",
    )
    distill_only: bool = opt(
        False,
        "algorithm.teacher: train on the teacher's signal alone (A_task = 0): training "
        "responses are not scored by the reward functions (evaluation still is) and dynamic "
        "sampling keeps every group.",
    )
    teacher_offload: bool = opt(
        False,
        "algorithm.teacher on a GPU: keep the teacher in CPU memory between scorings and move "
        "it to the GPU only to score (frees its memory for the update and generation).",
    )
    teacher_api_key: str | None = opt(
        None,
        "algorithm.teacher=server:URL: the API key that server was started with (`dapo "
        "vllm-serve --api-key`); null: the DAPO_SERVER_API_KEY environment variable, else "
        "none. Never written out (config.yaml, checkpoints and logs hold null).",
        secret=True,
    )
