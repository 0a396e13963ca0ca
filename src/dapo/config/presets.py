"""Named algorithm settings: the DAPO paper's ablation ladder (Table 1), Dr. GRPO, and the
loss variants (GSPO, CISPO, Clip-Cov, KL-Cov) on top of DAPO with their papers' values.

A preset is a set of ``section.key: value`` settings applied over the defaults and under the
YAML file and the command-line overrides. ``dapo presets`` lists them.
"""

from __future__ import annotations

from typing import Any

_GRPO: dict[str, Any] = {
    "algorithm.clip_low": 0.2,
    "algorithm.clip_high": 0.2,
    "algorithm.loss_agg": "seq-mean-token-mean",
    "algorithm.advantage_scale": "group",
    "algorithm.dynamic_sampling": False,
    "algorithm.overlong_filter": False,
    "algorithm.overlong_penalty": False,
    "algorithm.beta": 0.0,
}

# The paper's ablation ladder (Table 1): each step adds one technique to the one before.
_LADDER: list[tuple[str, str, dict[str, Any]]] = [
    ("grpo", "naive GRPO: symmetric clip 0.2, per-response loss mean, no shaping", {}),
    ("grpo+overlong_filter", "+ overlong filtering", {"algorithm.overlong_filter": True}),
    ("grpo+clip_higher", "+ clip-higher (eps_high 0.28)", {"algorithm.clip_high": 0.28}),
    ("grpo+soft_punish", "+ soft overlong punishment", {"algorithm.overlong_penalty": True}),
    ("grpo+token_loss", "+ token-level loss", {"algorithm.loss_agg": "token-mean"}),
    (
        "dapo",
        "+ dynamic sampling = DAPO (its surplus groups carried to the next step; dapo_paper "
        "discards them as the paper does)",
        {"algorithm.dynamic_sampling": True},
    ),
]

# Every value of the paper's main run (the *paper* column of the configuration reference,
# tests/test_presets.py keeps the two equal), on top of the `dapo` rung: Qwen2.5-32B's
# optimiser, batch and lengths, and the surplus of dynamic sampling discarded.
_PAPER: dict[str, Any] = {
    "algorithm.clip_low": 0.2,
    "algorithm.clip_high": 0.28,
    "algorithm.loss_agg": "token-mean",
    "algorithm.beta": 0.0,
    "algorithm.dynamic_sampling": True,
    "algorithm.keep_surplus": False,
    "algorithm.overlong_penalty": True,
    "algorithm.overlong_buffer": 4096,
    "algorithm.overlong_penalty_factor": 1.0,
    "rollout.num_generations": 16,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "rollout.max_completion_length": 20480,
    "rollout.eval_temperature": 1.0,
    "rollout.eval_top_p": 0.7,
    "rollout.eval_num_generations": 32,
    "train.prompts_per_step": 512,
    "train.mini_batch_size": 32,
    "train.lr": 1e-6,
    "train.lr_schedule": "constant",
    "train.warmup_steps": 20,
    "train.weight_decay": 0.1,
    "train.max_grad_norm": 1.0,
}


def _build_presets() -> dict[str, tuple[str, dict[str, Any]]]:
    presets: dict[str, tuple[str, dict[str, Any]]] = {}
    acc = dict(_GRPO)
    for name, text, delta in _LADDER:
        acc = {**acc, **delta}
        presets[name] = (text, dict(acc))
    presets["dr_grpo"] = (
        "Dr. GRPO: no std division, token sums over responses x max length",
        {
            **_GRPO,
            "algorithm.advantage_scale": "none",
            "algorithm.loss_agg": "seq-mean-token-sum-norm",
        },
    )
    dapo = presets["dapo"][1]
    presets["dapo_paper"] = (
        "every value of the paper's main run: 512 prompts x 16 responses, 16 updates per "
        "step, L_max 20480 with a 4096 buffer, lr 1e-6, surplus discarded, avg@32 at top-p 0.7",
        {**dapo, **_PAPER},
    )
    for name, text, delta in _VARIANTS:
        presets[name] = (text, {**dapo, **delta})
    return presets


# Each changes only what its paper changes, on top of the `dapo` preset.
_VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "gspo",
        "DAPO with GSPO's sequence-level ratio: clip 3e-4/4e-4 on it, per-response loss mean "
        "(arXiv 2507.18071, v2 section 5.1)",
        {
            "algorithm.policy_loss": "gspo",
            "algorithm.clip_low": 3e-4,
            "algorithm.clip_high": 4e-4,
            "algorithm.loss_agg": "seq-mean-token-mean",
        },
    ),
    (
        "cispo",
        "DAPO with CISPO: clipped IS weight as a stop-gradient coefficient, no lower bound, "
        "weight cap 5 (MiniMax-M1 arXiv 2506.13585; cap from ScaleRL arXiv 2510.13786)",
        {"algorithm.policy_loss": "cispo", "algorithm.clip_low": 1.0, "algorithm.clip_high": 4.0},
    ),
    (
        "clip_cov",
        "DAPO with Clip-Cov: drop the gradient of 2e-4 of the tokens with covariance in "
        "(1, 5), ratio clip range 1 (arXiv 2505.22617, the authors' scripts)",
        {
            "algorithm.entropy_control": "clip_cov",
            "algorithm.clip_low": 1.0,
            "algorithm.clip_high": 1.0,
            "algorithm.clip_cov_ratio": 2e-4,
            "algorithm.clip_cov_low": 1.0,
            "algorithm.clip_cov_high": 5.0,
        },
    ),
    (
        "kl_cov",
        "DAPO with KL-Cov: |log-ratio| penalty (coefficient 1) on the 2e-3 of the tokens "
        "with the largest covariance, unclipped ratio (arXiv 2505.22617, 7B scripts)",
        {
            "algorithm.entropy_control": "kl_cov",
            "algorithm.kl_cov_ratio": 2e-3,
            "algorithm.kl_cov_coef": 1.0,
        },
    ),
]


PRESETS: dict[str, tuple[str, dict[str, Any]]] = _build_presets()
ABLATION_LADDER: list[str] = [name for name, _, _ in _LADDER]


def describe_presets() -> list[str]:
    """One line per preset, for ``dapo presets``."""
    width = max(map(len, PRESETS))
    return [f"{name:<{width}}  {text}" for name, (text, _) in PRESETS.items()]
