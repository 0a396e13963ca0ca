"""The metrics of what the producer generated: rewards, accuracy, lengths, episodes."""

from __future__ import annotations

import re

import torch

from dapo.handover import ScoredGroup
from dapo.rollout.episodes import END_REASONS


def group_metrics(groups: list[ScoredGroup], scored: bool = True) -> dict[str, float]:
    """Rewards, accuracy, length shaping and lengths over every response of ``groups``;
    ``scored=False`` (distillation alone: no reward function ran) leaves out the rewards and
    accuracy, which would read 0."""
    lengths = [float(len(x)) for g in groups for x in g.response_ids]
    return {
        **(reward_metrics(groups) if scored else {}),
        "response_length/mean": mean(lengths),
        "response_length/max": max(lengths, default=0.0),
        "response_length/clip_ratio": mean([float(x) for g in groups for x in g.truncated]),
        **episode_metrics([e for g in groups for e in g.episode_stats or []]),
    }


def reward_metrics(groups: list[ScoredGroup]) -> dict[str, float]:
    """Rewards, accuracy and the length shaping over every response of ``groups``; the
    accuracy only over groups whose reward says what correct is, and the numeric fields
    reward functions returned beside their scores as ``reward/extra_<field>``."""
    rewards = [x for g in groups for x in g.rewards]
    scores = [x for g in groups for x in g.scores()]
    claimed = [float(x) for g in groups if g.claims_correct for x in g.correct]
    extra: dict[str, list[float]] = {}
    for g in groups:
        for info in g.info or []:
            for key, value in info.items():
                extra.setdefault(key, []).append(value)
    return {
        "reward/mean": mean(rewards),
        "reward/std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
        # The reward functions' own scores, before the length shaping: a constant shows here.
        "reward/score_min": min(scores, default=0.0),
        "reward/score_max": max(scores, default=0.0),
        **({"reward/acc": mean(claimed)} if claimed or not groups else {}),
        # The shaping actually added to the rewards: 0 when it is off.
        "reward/overlong_penalty_mean": mean([x for g in groups for x in g.penalty]),
        **{f"reward/extra_{_metric_name(k)}": mean(v) for k, v in sorted(extra.items())},
    }


def _metric_name(key: str) -> str:
    """A returned field's name as a metric name: lowercase, other characters as ``_``."""
    return re.sub(r"[^a-z0-9_]+", "_", key.lower()).strip("_") or "field"


def episode_metrics(episodes: list[dict]) -> dict[str, float]:
    """Turns, tool calls and errors, environment time and token share, and how episodes
    ended, over multi-turn episodes (nothing for single-turn groups)."""
    if not episodes:
        return {}
    turns = [float(e["turns"]) for e in episodes]
    out = {
        "env/turns_mean": mean(turns),
        "env/turns_max": max(turns),
        "env/tool_calls": mean([float(e["tool_calls"]) for e in episodes]),
        "env/tool_errors": mean([float(e["tool_errors"]) for e in episodes]),
        "perf/env_s": sum(float(e["env_seconds"]) for e in episodes),
        "env/token_share": sum(e["env_tokens"] for e in episodes)
        / max(1, sum(e["tokens"] for e in episodes)),
        "env/failures": float(sum(e["end"] == "env_failure" for e in episodes)),
    }
    agents = [e for e in episodes if "requests" in e]
    if agents:
        out["agent/requests_mean"] = mean([float(e["requests"]) for e in agents])
        out["agent/segments_mean"] = mean([float(e["segments"]) for e in agents])
        out["agent/tool_calls"] = mean([float(e["tool_calls"]) for e in agents])
        out["perf/agent_s"] = sum(float(e["agent_seconds"]) for e in agents)
    for end in END_REASONS:
        out[f"env/ended_{end}"] = mean([float(e["end"] == end) for e in episodes])
    return out


def mean(xs: list[float]) -> float:
    """The mean of ``xs``; 0.0 for none (a metric of an empty step)."""
    return sum(xs) / len(xs) if xs else 0.0
