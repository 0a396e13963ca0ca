"""Run health: a run that cannot learn says so within a few rollout steps.

:class:`HealthMonitor` reads each rollout step's metrics (the trainer calls
:meth:`~HealthMonitor.observe` and does nothing else with it) and warns once per kind of
symptom, naming the metric, its value, the threshold, the likely cause and the fix, with the
section of docs/guides/run-health.md that explains it. ``health.fatal`` makes a kind stop the
run instead. The thresholds are the ``health`` config section. :func:`diagnose_groups` names
why a step's groups carry no learning signal, for dynamic sampling's messages.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dapo.errors import HealthError, HealthWarning
from dapo.handover import ScoredGroup

GUIDE = "docs/guides/run-health.md"
GREEDY_HINT = "1.0 is DAPO's"


@dataclass
class Finding:
    """One symptom seen at one step: the metric that shows it, its value against the
    threshold, and what to do (``advice``: the likely cause and the fix)."""

    kind: str
    metric: str
    value: float
    threshold: float
    advice: str

    def text(self, step: int) -> str:
        return (
            f"run health ({self.kind}, rollout step {step}): {self.metric} = {_num(self.value)} "
            f"(threshold {_num(self.threshold)}). {self.advice} See {GUIDE}#{self.kind}."
        )


def _num(x: float) -> str:
    return f"{x:.4g}"


class HealthMonitor:
    """Watches a run's metrics step by step; see the module docstring.

    ``cfg``: the run's :class:`~dapo.config.Config` (its ``health`` section, and the settings
    the advice names). ``warn``: whether this process warns (rank 0 only under torchrun;
    every rank checks alike, so that a fatal finding stops every rank).
    """

    def __init__(self, cfg: Any, warn: bool = True) -> None:
        self.cfg, self.h, self.warn = cfg, cfg.health, warn
        self.history: list[dict[str, float]] = []  # the WATCHED metrics of each step
        self.raised: dict[str, dict[str, Any]] = {}  # kind -> its first warning
        self.fatal: HealthError | None = None  # a new finding of a kind in health.fatal

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Check rollout step ``step``'s metrics (1-based, as the console counts); the
        ``health/*`` metrics to log with them. A new finding of a kind in ``health.fatal`` is
        kept in :attr:`fatal` (the caller logs the step, then raises it) instead of warned."""
        if not self.h.enabled:
            return {}
        self.history.append({k: float(metrics[k]) for k in WATCHED if _is_number(metrics.get(k))})
        found = [f for check in CHECKS if (f := check(self)) is not None]
        out = {f"health/{f.kind}": 1.0 for f in found}
        for f in found:
            if f.kind in self.raised:
                continue
            text = f.text(step)
            self.raised[f.kind] = {"step": step, **asdict(f), "message": text}
            if f.kind in self.h.fatal or "all" in self.h.fatal:
                message = f"{text} (health.fatal includes {f.kind!r}: the run stops)"
                self.fatal = self.fatal or HealthError(message)
            elif self.warn:
                warnings.warn(text, HealthWarning, stacklevel=2)
        out["health/warnings"] = float(len(self.raised))
        return out

    @property
    def findings(self) -> list[dict[str, Any]]:
        """Every kind warned so far, with its first step, for ``summary.json``."""
        return list(self.raised.values())

    # --- what the checks read -----------------------------------------------------------

    def last(self, key: str, n: int = 1) -> list[float] | None:
        """``key`` at the last ``n`` steps that logged it (None: fewer than ``n`` did)."""
        values = [m[key] for m in self.history if key in m][-n:]
        return values if len(values) == n else None

    def baseline(self, key: str) -> float | None:
        """The mean of ``key`` over the first ``health.baseline_steps`` steps that logged it,
        once a later step has logged it too (None before)."""
        values = [m[key] for m in self.history if key in m]
        k = self.h.baseline_steps
        return sum(values[:k]) / k if len(values) > k else None

    def flat_accuracy(self) -> bool:
        """The accuracy of the latest step is within ``health.flat_acc`` of the first steps'."""
        base, now = self.baseline("reward/acc"), self.last("reward/acc")
        return base is not None and now is not None and abs(now[0] - base) < self.h.flat_acc

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "raised": self.raised}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.history, self.raised = list(state["history"]), dict(state["raised"])


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# --- the checks: each returns a Finding for the latest step, or None ----------------------


def truncation(m: HealthMonitor) -> Finding | None:
    share = m.last("response_length/clip_ratio")
    if share is None or share[0] < m.h.max_truncated:
        return None
    limit = m.cfg.rollout.max_completion_length
    mean = (m.last("response_length/mean") or [0.0])[0]
    return Finding(
        "truncation",
        "response_length/clip_ratio",
        share[0],
        m.h.max_truncated,
        f"{share[0]:.0%} of this step's responses were cut off at "
        f"rollout.max_completion_length={limit} tokens (mean length {mean:.0f}): a cut-off "
        "answer is scored as wrong, so the reward measures the limit, not the model. Raise "
        f"rollout.max_completion_length (e.g. to {4 * limit}), or ask for shorter answers "
        "in the prompt.",
    )


def constant_reward(m: HealthMonitor) -> Finding | None:
    n = m.h.uniform_steps
    low, high = m.last("reward/score_min", n), m.last("reward/score_max", n)
    if low is None or high is None or len({*low, *high}) != 1:
        return None
    value = low[0]
    return Finding(
        "constant_reward",
        "reward/score_max - reward/score_min",
        0.0,
        0.0,
        f"the reward was {value:g} for every response of the last {n} rollout steps (before "
        "the length shaping), so the responses' advantages say nothing about their answers. "
        "Either the reward function returns a constant (check what it reads: the response, "
        "the ground-truth column), or the model never solves a prompt (then use easier "
        "prompts or a stronger model).",
    )


def uniform_groups(m: HealthMonitor) -> Finding | None:
    n = m.h.uniform_steps
    uniform = m.last("sampling/uniform_groups", n)
    if uniform is None or min(uniform) < m.h.max_uniform or constant_reward(m) is not None:
        return None
    if near_greedy(m) is not None:
        return None
    correct = (m.last("sampling/all_correct_frac") or [0.0])[0]
    wrong = (m.last("sampling/all_wrong_frac") or [0.0])[0]
    low = (m.last("reward/score_min") or [0.0])[0]
    high = (m.last("reward/score_max") or [0.0])[0]
    metric = m.cfg.algorithm.dynamic_sampling_metric
    scale = ""
    if metric == "acc" and (correct >= m.h.max_uniform or wrong >= m.h.max_uniform):
        scale = (
            f" The rewards ranged from {low:g} to {high:g}; a response counts as correct "
            "when its reward is > 0: with a reward on another scale (all above 0, or all at "
            "or below it), set algorithm.dynamic_sampling_metric=reward."
        )
    return Finding(
        "uniform_groups",
        "sampling/uniform_groups",
        uniform[-1],
        m.h.max_uniform,
        f"for {n} rollout steps nearly every group's responses scored alike ({correct:.0%} "
        f"all correct, {wrong:.0%} all wrong), so they carry no learning signal.{scale} "
        "Use harder prompts if most groups are all correct, easier ones (or a stronger "
        "model) if most are all wrong, or raise rollout.num_generations.",
    )


def near_greedy(m: HealthMonitor) -> Finding | None:
    temperature = m.cfg.rollout.temperature
    uniform = m.last("sampling/uniform_groups")
    if temperature > m.h.greedy_temperature or uniform is None or uniform[0] < 0.5:
        return None
    return Finding(
        "near_greedy",
        "sampling/uniform_groups",
        uniform[0],
        0.5,
        f"rollout.temperature={temperature:g} samples nearly greedily (at or below "
        f"health.greedy_temperature={m.h.greedy_temperature:g}): the responses to one prompt "
        f"are nearly identical, so {uniform[0]:.0%} of groups scored alike and carry no "
        f"learning signal. Raise rollout.temperature ({GREEDY_HINT}).",
    )


def entropy_collapse(m: HealthMonitor) -> Finding | None:
    base, now = m.baseline("actor/entropy"), m.last("actor/entropy")
    if base is None or now is None or base <= 0 or not m.flat_accuracy():
        return None
    floor = m.h.entropy_floor * base
    if now[0] >= floor:
        return None
    a = m.cfg.algorithm
    return Finding(
        "entropy_collapse",
        "actor/entropy",
        now[0],
        floor,
        f"the policy's entropy fell below {m.h.entropy_floor:g} x its first steps' "
        f"({base:.4g}) while the accuracy stayed flat: the policy stops exploring before it "
        f"learns (entropy collapse). Raise algorithm.clip_high (now {a.clip_high:g}; DAPO's "
        f"Clip-Higher is 0.28) or rollout.temperature (now {m.cfg.rollout.temperature:g}), "
        "or lower train.lr.",
    )


def entropy_blowup(m: HealthMonitor) -> Finding | None:
    base, now = m.baseline("actor/entropy"), m.last("actor/entropy")
    acc_base, acc = m.baseline("reward/acc"), m.last("reward/acc")
    if base is None or now is None or acc_base is None or acc is None or base <= 0:
        return None
    ceiling = m.h.entropy_ceiling * base
    if now[0] <= ceiling or acc[0] > acc_base - m.h.flat_acc:
        return None
    return Finding(
        "entropy_blowup",
        "actor/entropy",
        now[0],
        ceiling,
        f"the policy's entropy rose above {m.h.entropy_ceiling:g} x its first steps' "
        f"({base:.4g}) while the accuracy fell from {acc_base:.1%} to {acc[0]:.1%}: the "
        f"updates are destroying the policy. Lower train.lr (now {m.cfg.train.lr:g}) or "
        f"algorithm.clip_high (now {m.cfg.algorithm.clip_high:g}).",
    )


def length_to_limit(m: HealthMonitor) -> Finding | None:
    base, now = m.baseline("response_length/mean"), m.last("response_length/mean")
    limit = m.cfg.rollout.max_completion_length
    if base is None or now is None or not m.flat_accuracy():
        return None
    threshold = m.h.length_share * limit
    if now[0] < threshold or now[0] < m.h.length_growth * base:
        return None
    return Finding(
        "length_to_limit",
        "response_length/mean",
        now[0],
        threshold,
        f"the mean response length grew from {base:.0f} to {now[0]:.0f} tokens, near "
        f"rollout.max_completion_length={limit}, while the accuracy stayed flat: the policy "
        "is learning to be long, not right (rambling into the limit). Check the overlong "
        "shaping (algorithm.overlong_buffer, algorithm.overlong_filter) and the reward's "
        "length terms; raise rollout.max_completion_length if answers need the room.",
    )


def zero_gradients(m: HealthMonitor) -> Finding | None:
    n = m.h.zero_grad_steps
    norms, updates = m.last("actor/grad_norm", n), m.last("actor/updates", n)
    if norms is None or updates is None or min(updates) <= 0 or max(norms) != 0.0:
        return None
    return Finding(
        "zero_gradients",
        "actor/grad_norm",
        0.0,
        0.0,
        f"the gradient norm was exactly 0 for {n} rollout steps of updates: every trained "
        "token's advantage is 0 (groups whose responses all got the same reward: see the "
        "reward) or no token is trained (every response masked, e.g. "
        "algorithm.overlong_filter with every response cut off).",
    )


def engine_mismatch(m: HealthMonitor) -> Finding | None:
    share = m.last("rollout/logprob_ratio_outside")
    if share is None or share[0] <= m.h.max_mismatch_share:
        return None
    return Finding(
        "engine_mismatch",
        "rollout/logprob_ratio_outside",
        share[0],
        m.h.max_mismatch_share,
        f"{share[0]:.2%} of the sampled tokens have a probability under the trainer that "
        "differs from the engine's by more than [0.8, 1.25] (the mean can look fine while "
        "these tokens skew the update): the engine and the trainer do not compute the same "
        "policy. Causes: a lower precision in the engine (bf16 or fp8 against fp32), weights "
        "pushed late (rollout.vllm_sync_every), a tokenizer or chat template that differs. "
        "Correct for it with algorithm.is_cap (e.g. 2), or make the precisions match.",
    )


CHECKS: tuple[Callable[[HealthMonitor], Finding | None], ...] = (
    truncation,
    constant_reward,
    near_greedy,
    uniform_groups,
    entropy_collapse,
    entropy_blowup,
    length_to_limit,
    zero_gradients,
    engine_mismatch,
)
KINDS: tuple[str, ...] = tuple(c.__name__ for c in CHECKS)
# The metrics the checks read: the monitor keeps (and checkpoints) only these of each step.
WATCHED: tuple[str, ...] = (
    "response_length/clip_ratio",
    "response_length/mean",
    "reward/score_min",
    "reward/score_max",
    "reward/acc",
    "sampling/uniform_groups",
    "sampling/all_correct_frac",
    "sampling/all_wrong_frac",
    "actor/entropy",
    "actor/grad_norm",
    "actor/updates",
    "rollout/logprob_ratio_outside",
)


def diagnose_groups(
    groups: Sequence[ScoredGroup],
    *,
    max_completion_length: int,
    temperature: float,
    metric: str = "acc",
    max_truncated: float = 0.5,
    greedy_temperature: float = 0.3,
) -> str:
    """Why ``groups`` (a step's generated groups) carry no learning signal, as far as their
    scores say: cut-off responses, a reward with one value, a reward whose values never
    cross "correct", near-greedy sampling. ``""`` when none of these."""
    cut = [t for g in groups for t in g.truncated]
    rewards = [r for g in groups for r in g.scores()]
    correct = [c for g in groups for c in g.correct]
    if not rewards:
        return ""
    causes = []
    share = sum(cut) / max(len(cut), 1)
    if share >= max_truncated:
        causes.append(
            f"{share:.0%} of the responses were cut off at rollout.max_completion_length="
            f"{max_completion_length} (a cut-off answer scores as wrong): raise it"
        )
    if len(set(rewards)) == 1:
        causes.append(
            f"the reward was {rewards[0]:g} for every one of the {len(rewards)} responses: a "
            "reward function that returns a constant (check that it reads the response and "
            "the right ground truth), or prompts the model never solves"
        )
    elif metric == "acc" and (all(correct) or not any(correct)):
        causes.append(
            f"the rewards ranged from {min(rewards):g} to {max(rewards):g} but "
            f"{'every' if all(correct) else 'no'} response counts as correct (reward > 0): "
            "for a reward on another scale set algorithm.dynamic_sampling_metric=reward"
        )
    if temperature <= greedy_temperature:
        causes.append(
            f"rollout.temperature={temperature:g} samples nearly greedily, so the responses "
            f"to a prompt are alike: raise it ({GREEDY_HINT})"
        )
    return ("Likely cause: " + "; ".join(causes) + ".") if causes else ""
