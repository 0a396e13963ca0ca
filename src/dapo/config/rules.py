"""The rules between fields, one function per section, and :func:`validate`.

A field's own bounds and choices are declared on the field (:func:`~dapo.config.fields.opt`)
and checked first, by :func:`~dapo.config.fields.check_fields`, so a rule here may rely on
them (``train.mini_batch_size >= 1`` before it divides). A rule names the key whose value
it refuses, that value, and the fix; a warning (``UserWarning``) says what a setting risks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection

from dapo.config.fields import check_fields, require
from dapo.config.schema import Config


def _check_data(cfg: Config) -> None:
    d = cfg.data
    require(
        d.difficulty_key is None or d.curriculum != "none",
        "data.difficulty_key",
        d.difficulty_key,
        "it ranks prompts for data.curriculum, which is none; set data.curriculum=easy_first "
        "or leave it null",
    )


def _check_rollout(cfg: Config, objects: Collection[str] = ()) -> None:
    """The rollout server, vLLM's quantization and asynchronous rollouts: which engine,
    which correction. ``objects``: keys given as Python objects (``dapo.train(tools=...)``)."""
    r, a = cfg.rollout, cfg.algorithm
    if r.engine == "vllm-server":
        require(
            bool(r.server_url),
            "rollout.server_url",
            r.server_url,
            "rollout.engine=vllm-server needs the server's address, e.g. "
            "rollout.server_url=http://HOST:8000 (start the server with dapo vllm-serve MODEL)",
        )
    q = r.vllm_quantization
    if q != "none":
        fix = (
            f"start the server quantized instead (dapo vllm-serve MODEL --quantization {q})"
            if r.engine == "vllm-server"
            else "use rollout.engine=vllm, or none"
        )
        require(
            r.engine == "vllm",
            "rollout.vllm_quantization",
            q,
            f"it quantizes the in-process vLLM engine (rollout.engine=vllm), not engine="
            f"{r.engine}: {fix}",
        )
        if a.is_cap is None:
            warnings.warn(
                f"rollout.vllm_quantization={q}: vLLM samples with "
                "quantized weights while the trainer's ratio uses its own, uncorrected "
                "(algorithm.is_cap is null); set algorithm.is_cap (e.g. 2.0) to correct "
                "the gap, and watch rollout/mismatch_kl",
                UserWarning,
                stacklevel=2,
            )
    if r.agent is not None:
        require(
            r.environment is None and not r.tools,
            "rollout.agent",
            r.agent,
            "the agent is the episode's environment and runs its own tools: unset "
            "rollout.environment and rollout.tools, or unset rollout.agent",
        )
    require(
        r.max_turns == 1
        or r.environment is not None
        or bool(r.tools)
        or r.agent is not None
        or bool({"rollout.environment", "rollout.tools"} & set(objects)),
        "rollout.max_turns",
        r.max_turns,
        "more than one turn needs something to answer the model: set rollout.environment "
        "(module:Class or a built-in, e.g. calculator), rollout.tools or rollout.agent, or use "
        "max_turns=1",
    )
    require(
        not r.partial_rollouts or r.max_staleness > 0,
        "rollout.partial_rollouts",
        r.partial_rollouts,
        "partial rollouts continue responses across weight updates, which only happen during "
        "generation with streaming rollouts: set rollout.max_staleness >= 1, or leave it false",
    )
    if a.proximal_logprobs == "loglinear":
        require(
            r.max_staleness > 0
            and a.is_cap is not None
            and a.is_level == "token"
            and a.is_mode == "truncate",
            "algorithm.proximal_logprobs",
            a.proximal_logprobs,
            "the log-linear proximal policy is computed inside the update, token by token, so "
            "it needs streaming rollouts (rollout.max_staleness > 0) with a token-level, "
            "truncating correction: algorithm.is_cap=5 algorithm.is_level=token "
            "algorithm.is_mode=truncate; or use recompute",
        )
    if r.max_staleness:
        exact = r.top_p == 1.0 and r.top_k == 0
        require(
            exact or a.is_cap is not None,
            "rollout.max_staleness",
            r.max_staleness,
            "with rollout.top_p < 1 or rollout.top_k > 0 the engine's log-probs are not the "
            "sampling policy's, so stale batches go uncorrected: set algorithm.is_cap (e.g. "
            "5.0; algorithm.is_level / is_mode choose the correction), or sample with top_p=1 "
            "and top_k=0",
        )
        require(
            r.vllm_sync_every == 1,
            "rollout.vllm_sync_every",
            r.vllm_sync_every,
            "staleness is counted in rollout steps, so with rollout.max_staleness > 0 the engine "
            "gets the weights after every update: use 1",
        )


def _check_algorithm(cfg: Config) -> None:
    """The loss variant and its corrections; the overlong buffer; the prompt history key."""
    a, d = cfg.algorithm, cfg.data
    if a.policy_loss == "gspo":
        require(
            a.loss_agg == "seq-mean-token-mean",
            "algorithm.loss_agg",
            a.loss_agg,
            "policy_loss=gspo has one ratio per response and optimises 1/G sum_i of the "
            "response terms; a token-level mode would weigh each response by its length. Use "
            "algorithm.loss_agg=seq-mean-token-mean (preset=gspo sets it)",
        )
    if a.clip_c is not None:
        require(
            a.policy_loss == "ppo",
            "algorithm.clip_c",
            a.clip_c,
            f"dual clip bounds PPO's per-token surrogate; policy_loss={a.policy_loss} has none. "
            "Set algorithm.clip_c=null or algorithm.policy_loss=ppo",
        )
        require(
            a.entropy_control != "kl_cov",
            "algorithm.clip_c",
            a.clip_c,
            "dual clip bounds PPO's clipped surrogate; entropy_control=kl_cov replaces it with "
            "the unclipped -r*A plus its penalty. Set algorithm.clip_c=null, or use "
            "entropy_control=clip_cov (which keeps the clip and the dual clip)",
        )
    if a.entropy_control != "none":
        require(
            a.policy_loss == "ppo",
            "algorithm.entropy_control",
            a.entropy_control,
            f"Clip-Cov and KL-Cov act on PPO's per-token ratio; policy_loss={a.policy_loss} "
            "has another objective. Use algorithm.policy_loss=ppo, or entropy_control=none",
        )
    require(
        a.clip_cov_low < a.clip_cov_high,
        "algorithm.clip_cov_high",
        a.clip_cov_high,
        f"the covariance window (clip_cov_low, clip_cov_high) is empty: use a value above "
        f"algorithm.clip_cov_low ({a.clip_cov_low}), e.g. 5",
    )
    max_len = cfg.rollout.max_completion_length
    require(
        a.overlong_buffer is None or a.overlong_buffer < max_len,
        "algorithm.overlong_buffer",
        a.overlong_buffer,
        f"the overlong buffer must be shorter than rollout.max_completion_length ({max_len}); "
        "lower it or raise the maximum length",
    )
    measured = d.curriculum != "none" and d.difficulty_key is None
    require(
        a.skip_key is None or a.skip_uniform_prompts or measured,
        "algorithm.skip_key",
        a.skip_key,
        "it keys the history of algorithm.skip_uniform_prompts (or of data.curriculum by pass "
        "rate), which is off; set algorithm.skip_uniform_prompts=true or leave it null",
    )
    _check_distill(cfg)


def _check_distill(cfg: Config) -> None:
    """On-policy distillation: a teacher for the distillation switches; what a teacher
    signal alone cannot drive (the outcome history of skipping and the measured curriculum)."""
    a, d = cfg.algorithm, cfg.data
    require(
        not a.distill_only or a.teacher is not None,
        "algorithm.distill_only",
        a.distill_only,
        "distillation needs a teacher: set algorithm.teacher (e.g. builtin:tiny-long or "
        "server:http://HOST:PORT), or distill_only=false",
    )
    if a.teacher is None:
        return
    if a.teacher.startswith("server:"):
        require(
            cfg.rollout.temperature == 1.0,
            "rollout.temperature",
            cfg.rollout.temperature,
            "a teacher served at algorithm.teacher=server:URL scores at temperature 1 (vLLM's "
            "prompt log-probs), so the student must sample at 1 for the two log-probs to be of "
            "the same distribution: set rollout.temperature=1.0, or load the teacher in the "
            "trainer (algorithm.teacher=PATH), which scores at the sampling temperature",
        )
    if a.distill_only:
        require(
            not a.skip_uniform_prompts,
            "algorithm.skip_uniform_prompts",
            a.skip_uniform_prompts,
            "with algorithm.distill_only=true the training responses are not scored, so there "
            "is no outcome history to skip by; set it false",
        )
        require(
            d.curriculum == "none" or d.difficulty_key is not None,
            "data.curriculum",
            d.curriculum,
            "with algorithm.distill_only=true the training responses are not scored, so there "
            "is no pass rate to order by; set data.difficulty_key, or data.curriculum=none",
        )


def _check_train(cfg: Config) -> None:
    t = cfg.train
    require(
        t.mini_batch_size <= t.prompts_per_step and t.prompts_per_step % t.mini_batch_size == 0,
        "train.mini_batch_size",
        t.mini_batch_size,
        f"use a divisor of train.prompts_per_step ({t.prompts_per_step}); "
        f"{t.prompts_per_step} // mini_batch_size is the number of updates per rollout step",
    )


# Each section's rules between fields (sections without any have none here).
SECTION_RULES: dict[str, Callable[..., None]] = {
    "data": _check_data,
    "rollout": _check_rollout,
    "algorithm": _check_algorithm,
    "train": _check_train,
}


def validate(cfg: Config, objects: Collection[str] = ()) -> None:
    """Raise :class:`~dapo.errors.ConfigError` for a value out of its choices or bounds, or
    values that cannot work together. ``objects``: the keys given as Python objects instead
    of config values (``rollout.environment``, ``rollout.tools``), which count as set."""
    check_fields(cfg)
    for rule in SECTION_RULES.values():
        if rule is _check_rollout:
            rule(cfg, objects)
        else:
            rule(cfg)
