"""Held-out evaluation: sample responses, score them, report accuracy."""

from __future__ import annotations

from typing import Any

from dapo.data import PromptRecord
from dapo.rewards import RewardScorer, ScoreRequest
from dapo.rollout import RolloutEngine, SamplingParams


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    records: list[PromptRecord],
    prompt_ids: list[list[int]],
    scorer: RewardScorer,
    params: SamplingParams,
) -> dict[str, float]:
    """avg@n accuracy (mean correctness over ``params.n`` samples per prompt)."""
    if not records:
        return {"acc": float("nan"), "n": 0}
    groups = engine.generate(prompt_ids, params)
    requests = [
        ScoreRequest(
            response=tokenizer.decode(resp, skip_special_tokens=True),
            ground_truth=rec.ground_truth,
            data_source=rec.data_source,
        )
        for g, rec in zip(groups, records, strict=True)
        for resp in g.response_ids
    ]
    result = scorer.score(requests)
    lengths = [len(r) for g in groups for r in g.response_ids]
    return {
        "acc": sum(result.correct) / len(result.correct),
        "n": len(result.correct),
        "response_length": sum(lengths) / len(lengths),
        "truncated": sum(t for g in groups for t in g.truncated) / len(lengths),
    }
