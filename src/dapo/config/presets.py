"""Named algorithm settings: the DAPO paper's ablation ladder (Table 1) and Dr. GRPO.

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
        "+ dynamic sampling = DAPO (the paper's settings)",
        {"algorithm.dynamic_sampling": True},
    ),
]


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
    return presets


PRESETS: dict[str, tuple[str, dict[str, Any]]] = _build_presets()
ABLATION_LADDER: list[str] = [name for name, _, _ in _LADDER]


def describe_presets() -> list[str]:
    """One line per preset, for ``dapo presets``."""
    width = max(map(len, PRESETS))
    return [f"{name:<{width}}  {text}" for name, (text, _) in PRESETS.items()]
