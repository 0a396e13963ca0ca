"""Every metric key a run can log, with its meaning: the one list the logger checks keys
against and the docs' metrics reference is generated from.

A key is a literal name (``reward/acc``) or a pattern with one ``{placeholder}`` standing for
a lowercase name or number (``env/ended_{reason}``, ``stream/staleness_{age}``). ``step``
and ``time`` are the record's own fields.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """One metric key (or pattern), what it means, and when a run logs it."""

    key: str
    meaning: str
    when: str = "every rollout step"


METRICS: tuple[Metric, ...] = (
    # reward
    Metric(
        "reward/mean",
        "Mean reward over every response generated this step (not only the trained ones).",
    ),
    Metric(
        "reward/acc",
        "Share of this step's generated responses scored correct: a built-in scorer's "
        "+1, a reward's acc field, or reward > 0 for a reward that returns only -1, 0 and 1. "
        "Not logged while a reward says nothing of correctness (partial credit, a penalty).",
    ),
    Metric(
        "reward/extra_{field}",
        "Mean of a numeric field reward functions returned beside their score (a dict "
        "return's other keys, what a TRL-form function passed to log_metric), over the "
        "responses that had it.",
    ),
    Metric("reward/std", "Standard deviation of the rewards of this step's generated responses."),
    Metric(
        "reward/score_min",
        "Lowest score the reward functions gave this step's generated responses (before the "
        "overlong shaping).",
    ),
    Metric(
        "reward/score_max",
        "Highest score the reward functions gave this step's generated responses (before the "
        "overlong shaping); equal to reward/score_min: a reward that never varies.",
    ),
    Metric(
        "reward/failures",
        "Reward calls this step that raised, returned a non-number or timed out (each scores -1).",
    ),
    Metric(
        "reward/unscorable",
        "Responses this step for which every reward function returned None (a TRL-form "
        "'not applicable'): they score 0, as TRL's nansum gives, in their group's baseline.",
    ),
    Metric(
        "reward/failures_total",
        "Reward calls that failed since the run started (resumed runs included).",
    ),
    Metric(
        "reward/output_dropped_bytes",
        "Bytes the reward workers printed this step (stdout and stderr) over "
        "logging.user_output_kb per worker, dropped; the rest is in output_dir/user_output.log.",
    ),
    Metric(
        "reward/overlong_penalty_mean",
        "Mean soft overlong punishment added to the rewards, with its factor.",
        "every rollout step; 0 when algorithm.overlong_penalty is off",
    ),
    # response length
    Metric("response_length/mean", "Mean response length in tokens."),
    Metric("response_length/max", "Longest response in tokens."),
    Metric(
        "response_length/clip_ratio",
        "Share of responses truncated at rollout.max_completion_length.",
    ),
    # actor (the update)
    Metric("actor/loss", "The loss of the step's optimizer updates (mean over updates)."),
    Metric(
        "actor/pg_loss",
        "The aggregated policy-gradient term; about 0 with one update per step and beta = 0 "
        "(ratio 1, zero-mean advantages), while its gradient is not.",
    ),
    Metric("actor/entropy", "Mean token entropy of the policy over the loss tokens (nats)."),
    Metric("actor/gen_prob", "Mean probability of the sampled tokens under the trained policy."),
    Metric("actor/clip_frac_low", "Share of loss tokens where the lower clip bound is active."),
    Metric(
        "actor/clip_frac_high",
        "Share of loss tokens where the upper clip bound (clip-higher) is active.",
    ),
    Metric(
        "actor/clip_frac_dual",
        "Share of loss tokens where dual-clip bounds a negative-advantage ratio.",
        "algorithm.clip_c set",
    ),
    Metric("actor/ratio_mean", "Mean importance ratio pi / pi_old over the loss tokens."),
    Metric("actor/ppo_kl", "Approximate KL between the sampling (old) policy and the trained one."),
    Metric("actor/kl_ref", "Mean per-token KL to the reference policy.", "algorithm.beta > 0"),
    Metric(
        "actor/entropy_bonus",
        "The entropy term subtracted from the loss: entropy_coef x the aggregated entropy.",
        "algorithm.entropy_coef > 0",
    ),
    Metric(
        "actor/cov_selected_frac",
        "Share of the mini-batch's loss tokens selected by Clip-Cov (gradient dropped) or "
        "KL-Cov (KL-penalised).",
        "algorithm.entropy_control = clip_cov or kl_cov",
    ),
    Metric("actor/grad_norm", "Gradient norm before clipping (mean over the step's updates)."),
    Metric("actor/lr", "Learning rate."),
    Metric("actor/updates", "Optimizer updates applied this rollout step."),
    Metric("actor/skipped_updates", "Updates skipped because the loss or gradient was not finite."),
    Metric("train/loss_tokens", "Tokens in the loss this step (response tokens not masked out)."),
    Metric(
        "train/stale_groups",
        "Trained groups sampled by an older policy: generated ahead, or carried over by dynamic sampling.",
    ),
    # dynamic sampling and prompt choice
    Metric(
        "sampling/all_correct_frac", "Share of generated groups whose responses were all correct."
    ),
    Metric("sampling/all_wrong_frac", "Share of generated groups whose responses were all wrong."),
    Metric(
        "sampling/uniform_groups",
        "Share of generated groups with no learning signal (all correct or all wrong).",
    ),
    Metric("sampling/gen_rounds", "Generation rounds this step took to fill the batch."),
    Metric("sampling/generated_groups", "Groups generated this step."),
    Metric("sampling/generated_samples_total", "Responses generated since the run started."),
    Metric(
        "sampling/carried_in",
        "Groups carried over from the previous step's surplus and used now. A step whose batch "
        "comes whole from it generates nothing and logs no reward, length or group-share metrics.",
    ),
    Metric("sampling/carried_over", "Surplus groups kept for the next step."),
    Metric(
        "sampling/surplus_discarded",
        "Groups with a learning signal beyond the batch thrown away "
        "(algorithm.keep_surplus=false, as the paper does).",
    ),
    Metric(
        "sampling/wasted_frac",
        "Share of generated groups dropped (neither trained nor carried over: uniform, or a "
        "discarded surplus); 0 with dynamic sampling off, where uniform groups train with zero "
        "advantage.",
    ),
    Metric(
        "sampling/short_batch",
        "1 when the round cap left the batch short (algorithm.round_cap=train), else 0.",
    ),
    Metric("sampling/trained_groups", "Groups trained this step (0: the update was skipped)."),
    Metric(
        "sampling/skipped_prompts",
        "Prompts the skip rule passed over this step.",
        "algorithm.skip_uniform_prompts = true",
    ),
    Metric(
        "sampling/skip_rate",
        "Share of the prompts drawn that the skip rule passed over.",
        "algorithm.skip_uniform_prompts = true",
    ),
    # rollout engine
    Metric(
        "rollout/staleness",
        "Rollout steps between the oldest policy the engine held at the start of one of this "
        "step's generation rounds and the policy trained: 0 synchronous, up to "
        "rollout.max_staleness when streaming.",
    ),
    Metric(
        "rollout/logprob_mismatch",
        "Mean absolute difference of the engine's and the trainer's log-probs over response tokens.",
        "rollout.engine = vllm or vllm-server; the hf engine when train.precision is not fp32 "
        "or algorithm.is_cap is set (streaming rollouts set it)",
    ),
    Metric(
        "rollout/mismatch_kl",
        "The k3 estimate of KL(engine || trainer) over the same tokens.",
        "as rollout/logprob_mismatch",
    ),
    Metric(
        "rollout/logprob_ratio_p001",
        "The 0.1th percentile of the per-token ratio pi_trainer / pi_engine over the same "
        "tokens (1 when they agree; a mean can hide the tails).",
        "as rollout/logprob_mismatch",
    ),
    Metric(
        "rollout/logprob_ratio_p999",
        "The 99.9th percentile of the per-token ratio pi_trainer / pi_engine.",
        "as rollout/logprob_mismatch",
    ),
    Metric(
        "rollout/logprob_ratio_outside",
        "Share of the same tokens whose ratio pi_trainer / pi_engine is outside [0.8, 1.25] "
        "(the health check engine_mismatch warns above health.max_mismatch_share).",
        "as rollout/logprob_mismatch",
    ),
    Metric(
        "rollout/is_weight_mean",
        "Mean engine-vs-trainer importance weight over the loss tokens kept.",
        "algorithm.is_cap set",
    ),
    Metric(
        "rollout/is_truncated_frac",
        "Share of loss tokens (is_level=token) or responses whose ratio exceeded the cap and was truncated.",
        "algorithm.is_cap set, is_mode = truncate",
    ),
    Metric(
        "rollout/is_masked_frac",
        "Share of loss tokens (is_level=token) or responses whose ratio exceeded the cap and was dropped.",
        "algorithm.is_cap set, is_mode = mask",
    ),
    # multi-turn episodes
    Metric(
        "env/turns_mean",
        "Mean model turns per episode.",
        "multi-turn (rollout.environment or rollout.tools)",
    ),
    Metric("env/turns_max", "Most model turns in one episode.", "multi-turn"),
    Metric("env/tool_calls", "Tool calls per episode.", "multi-turn"),
    Metric("env/tool_errors", "Tool calls that raised, per episode.", "multi-turn"),
    Metric("env/token_share", "Environment tokens / all response tokens.", "multi-turn"),
    Metric(
        "env/failures", "Episodes ended by an environment that raised, hung or died.", "multi-turn"
    ),
    Metric(
        "env/failures_total",
        "Episodes ended by a failed environment or agent since the run started.",
        "multi-turn and agents",
    ),
    Metric(
        "env/output_dropped_bytes",
        "Bytes the environment and agent workers (environments, tools, agents) printed this "
        "step over logging.user_output_kb per worker, dropped; the rest is in "
        "output_dir/user_output.log.",
        "multi-turn and agents",
    ),
    Metric(
        "env/ended_{reason}",
        "Share of episodes that ended this way: done, max_turns, budget, env_failure, "
        "bad_tool_call or engine_refused (vLLM cannot take an image placeholder the policy "
        "wrote as text before a later image).",
        "multi-turn",
    ),
    # agents (rollout.agent)
    Metric(
        "agent/requests_mean",
        "Mean chat-completion requests an agent made per episode.",
        "rollout.agent set",
    ),
    Metric(
        "agent/segments_mean",
        "Mean token sequences per episode: 1, plus one for every request that does not extend "
        "the conversation so far (a rewritten history); each is trained as a sample.",
        "rollout.agent set",
    ),
    Metric(
        "agent/tool_calls",
        "Mean tool calls per episode found in the model's replies to the agent.",
        "rollout.agent set",
    ),
    # streaming rollouts (rollout.max_staleness)
    Metric(
        "stream/staleness_mean",
        "Mean staleness of the trained tokens: rollout steps between the policy version that "
        "sampled each token and the version being updated (at most rollout.max_staleness).",
        "rollout.max_staleness >= 1",
    ),
    Metric(
        "stream/staleness_max",
        "Largest staleness of a trained token this step.",
        "rollout.max_staleness >= 1",
    ),
    Metric(
        "stream/staleness_{age}",
        "Share of the trained tokens sampled {age} versions before the weights updated (one "
        "key per age 0..N; together they sum to 1).",
        "rollout.max_staleness >= 1",
    ),
    Metric(
        "stream/versions_per_response",
        "Mean number of policy versions that sampled one response: 1 unless partial rollouts "
        "continued it under newer weights.",
        "rollout.max_staleness >= 1",
    ),
    Metric(
        "stream/dropped_groups",
        "Dynamic sampling's carried-over groups dropped for being more than "
        "rollout.max_staleness versions old.",
        "rollout.max_staleness >= 1",
    ),
    Metric(
        "stream/partial_responses",
        "Responses of this batch continued under newer weights than they began with.",
        "rollout.max_staleness >= 1 (0 without rollout.partial_rollouts)",
    ),
    Metric(
        "stream/queued_batches",
        "Batches filled ahead and waiting when the trainer took this one.",
        "rollout.max_staleness >= 1",
    ),
    # on-policy distillation (algorithm.teacher)
    Metric(
        "distill/reverse_kl",
        "Per-token reverse KL estimate log pi_student - log pi_teacher of the sampled tokens, "
        "mean over the loss tokens; falls as the student learns the teacher.",
        "algorithm.teacher set",
    ),
    Metric(
        "distill/teacher_share",
        "The teacher's share of the summed advantage magnitude: sum|lambda x gap| / "
        "(sum|lambda x gap| + sum|A_task|); 1 with algorithm.distill_only.",
        "algorithm.teacher set",
    ),
    Metric(
        "distill/teacher_logprob",
        "Mean teacher log-prob of the sampled tokens over the loss tokens.",
        "algorithm.teacher set",
    ),
    # timings and throughput
    Metric("perf/step_s", "Wall time of the rollout step (seconds)."),
    Metric("perf/gen_s", "Time spent generating."),
    Metric("perf/score_s", "Time spent scoring (reward functions)."),
    Metric("perf/train_s", "Time spent in the optimizer updates."),
    Metric("perf/env_s", "Time spent in the environments' reset and step.", "multi-turn"),
    Metric(
        "perf/agent_s",
        "Agent time summed over the step's episodes (seconds; episodes run concurrently).",
        "rollout.agent set",
    ),
    Metric(
        "perf/teacher_s",
        "Time the teacher took to score the step's samples (the slowest rank).",
        "algorithm.teacher set",
    ),
    Metric("perf/rollout_tokens_per_s", "Generated tokens per second of generation."),
    Metric("perf/train_tokens_per_s", "Trained tokens per second of training."),
    Metric(
        "perf/weight_sync_s",
        "Time to push the weights to the engine (vLLM, the rollout server, or the hf "
        "engine's copy of the policy when streaming).",
        "rollout.engine = vllm or vllm-server, or rollout.max_staleness >= 1",
    ),
    Metric(
        "perf/data_wait_s",
        "How long the trainer waited for this step's batch to be filled (generation not hidden "
        "behind training).",
        "rollout.max_staleness >= 1",
    ),
    Metric(
        "perf/capacity_wait_s",
        "How long the producer waited for newer weights before it could start a batch (it "
        "was rollout.max_staleness batches ahead), since the last batch taken.",
        "rollout.max_staleness >= 1",
    ),
    # evaluation
    Metric(
        "val/acc",
        "Held-out accuracy (data.eval). Step 0 holds the accuracy before training; the "
        "accuracy after training is a second line of the last step.",
        "before and after training, every logging.eval_every steps",
    ),
    # run health (dapo.health, the health config section)
    Metric(
        "health/warnings",
        "Kinds of health warning raised since the run started.",
        "health.enabled",
    ),
    Metric(
        "health/{kind}",
        "1 at a step whose metrics show the symptom {kind} (truncation, constant_reward, "
        "near_greedy, uniform_groups, entropy_collapse, entropy_blowup, length_to_limit, "
        "zero_gradients, engine_mismatch); the first such step also warns on the console "
        "(docs/guides/run-health.md).",
        "health.enabled, at the steps that show the symptom",
    ),
)

_PLACEHOLDER = re.compile(r"\\\{[a-z_]+\\\}")


@functools.cache
def _patterns() -> tuple[re.Pattern[str], ...]:
    return tuple(
        re.compile(_PLACEHOLDER.sub("[a-z0-9_]+", re.escape(m.key)) + r"\Z") for m in METRICS
    )


def lookup(key: str) -> Metric | None:
    """The registered metric a logged key is (or matches), else None."""
    for metric, pattern in zip(METRICS, _patterns(), strict=True):
        if pattern.match(key):
            return metric
    return None


def is_registered(key: str) -> bool:
    """Whether ``key`` is a registered metric (or matches a registered pattern)."""
    return lookup(key) is not None
