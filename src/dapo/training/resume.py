"""What a resumed run must agree on with the checkpoint it continues, checked before any
model, tokenizer or data loads.

A checkpoint's ``trainer_state.pt`` (a small pickle) holds the run's resolved config, its step,
world size, data position and the groups it holds back (dynamic sampling's carry-over, the
batches a streaming producer filled ahead). :func:`check_before_loading` reads it and compares
every configuration key with the run being started, by the rules of :data:`RULES`, in which
every key of the schema is classified:

- free: the key may change; a changed one is listed in one warning, so that a different run
  is not mistaken for a continuation (more steps, a lower learning rate, another logger);
- free, dropping held groups: the key may change, but the carry-over and the batches filled
  ahead were sampled under the old value (another group size, temperature or nucleus), so
  they are dropped (:func:`continue_state`), said in one line with their count;
- refused: the checkpoint means something else under the new value (its weights are another
  model's, its data position counts other prompts, its epoch order comes from the seed): one
  line names the key, both values, the reason and the fix.

It also says when the run resumes at another world size (:func:`world_size_note`), and stops
with :class:`~dapo.errors.NothingToTrain` when the checkpoint is already at ``train.steps``.
``docs/guides/checkpoints.md`` holds :func:`rules_table`, the same rules as a table.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dapo.config import Config
from dapo.errors import NothingToTrain, TrainingError
from dapo.training.checkpoint import read_trainer_state

# What a free key's change drops of the groups a checkpoint holds back.
Held = Literal["carry-over", "batches filled ahead"]
CARRY: Held = "carry-over"
QUEUE: Held = "batches filled ahead"


@dataclass(frozen=True)
class Rule:
    """How one configuration key may change on resume: ``refused`` or not, why, and which
    held groups a change drops. A refusal that matters only in some runs has ``when`` (said
    in the docs) and ``applies``, true of a flattened config where it matters: the key is
    refused when it holds of the checkpoint's config or of the new one."""

    why: str
    refused: bool = False
    drops: tuple[Held, ...] = ()
    when: str = ""
    applies: Callable[[dict[str, Any]], bool] | None = None

    @property
    def verdict(self) -> str:
        """The rule in a few words, as the table in the docs says it."""
        if self.refused:
            return f"refused {self.when}" if self.when else "refused"
        if self.drops:
            return "free, drops the " + " and the ".join(self.drops)
        return "free"


def _free(why: str, *drops: Held) -> Rule:
    return Rule(why, drops=drops)


def _refused(
    why: str, when: str = "", applies: Callable[[dict[str, Any]], bool] | None = None
) -> Rule:
    return Rule(why, refused=True, when=when, applies=applies)


def _lora(why: str) -> Rule:
    return _refused(why, "with LoRA", lambda c: bool(c.get("model.lora.rank")))


_LOG = _free("what is logged and where")
_SAVE = _free("when and what is saved from here on")
_HEALTH = _free("what the run-health monitor warns of, or stops on")
_COMPUTE = _free("how the same update is computed (memory, speed), not what it computes")
_LOSS = _free("the loss of the updates from here on")
_EVAL = _free("the held-out evaluation only")
_SCORE = _free("the rewards of the groups generated from here on (held groups keep theirs)")
_SCHEDULE = _free("a schedule computed from the step; nothing of it is saved")
_LIMIT = _free("a limit or time-out applied from here on")
_HOW = _free("how responses are generated (or episodes hosted), not their distribution")
_SECRET = _free("never saved (a secret): give it again when resuming")
_SAMPLED = (
    "the held groups were sampled under the old value (their size or log-probs would be "
    "misread): they are dropped, their prompts not trained on"
)
_ADAM = _refused(
    "AdamW's hyperparameters are restored with its state from the checkpoint: a new value "
    "would be silently ignored"
)
_EPOCH = "another would repeat some prompts of the epoch under way and skip others"

# Every key of the schema (a test checks that none is missing).
RULES: dict[str, Rule] = {
    "output_dir": _free("a copied or moved run directory resumes from its own checkpoints"),
    "seed": _refused(f"the prompt order of each epoch is drawn from it: {_EPOCH}"),
    "preset": _free("it sets other keys, each checked on its own"),
    "resume": _free("the switch that resumes (never listed as a change)"),
    "evaluate": _EVAL,
    "model.name_or_path": _refused("the checkpoint holds that model's weights"),
    "model.tokenizer": _refused(
        "the checkpoint's prompts and responses are that tokenizer's token ids"
    ),
    "model.trust_remote_code": _free("a permission to load the same model"),
    "model.gradient_checkpointing": _COMPUTE,
    "model.lora.rank": _refused("the checkpoint holds adapters of that rank"),
    "model.lora.alpha": _lora(
        "it scales the saved adapters (alpha / rank): another value is another policy"
    ),
    "model.lora.target_modules": _lora("the checkpoint holds adapters on those layers"),
    "model.lora.dropout": _free("a regularisation of the updates from here on"),
    "model.train_vision": _refused(
        "the optimizer state holds the parameters it trains (the vision encoder's or not)"
    ),
    "data.train": _refused("the data position counts prompts of that data set"),
    "data.eval": _EVAL,
    "data.train_split": _refused("the data position counts prompts of that split"),
    "data.eval_split": _EVAL,
    "data.prompt_key": _refused("the data position counts prompts read from that column"),
    "data.answer_key": _SCORE,
    "data.data_source_key": _SCORE,
    "data.max_prompt_length": _refused(
        "longer prompts are left out before the data position counts them: another limit "
        "can shift it"
    ),
    "data.max_eval_prompts": _EVAL,
    "data.shuffle": _refused(f"it orders each epoch: {_EPOCH}"),
    "data.curriculum": _refused(
        "the data position counts draws of that scheme (shuffled epochs or the curriculum's "
        "pool): another one reads it differently"
    ),
    "data.difficulty_key": _free(
        "the curriculum's order from here on (the pool of a step is computed afresh)"
    ),
    "data.curriculum_steps": _SCHEDULE,
    "data.curriculum_start": _SCHEDULE,
    "rollout.engine": _HOW,
    "rollout.server_url": _HOW,
    "rollout.server_timeout_s": _LIMIT,
    "rollout.server_api_key": _SECRET,
    "rollout.max_staleness": _free(
        "the batches filled ahead were filled under the old bound: they are dropped, their "
        "prompts not trained on",
        QUEUE,
    ),
    "rollout.partial_rollouts": _HOW,
    "rollout.partial_chunk_tokens": _HOW,
    "rollout.num_generations": _free(_SAMPLED, CARRY, QUEUE),
    "rollout.temperature": _free(_SAMPLED, CARRY, QUEUE),
    "rollout.top_p": _free(_SAMPLED, CARRY, QUEUE),
    "rollout.top_k": _free(_SAMPLED, CARRY, QUEUE),
    "rollout.max_completion_length": _LIMIT,
    "rollout.environment": _refused(
        "prompts are rendered and measured with it: the prompts kept, and so the data "
        "position, can change"
    ),
    "rollout.tools": _refused(
        "their schemas are part of every rendered prompt: the prompts kept, and so the data "
        "position, can change"
    ),
    "rollout.tool_parser": _HOW,
    "rollout.agent": _free("the episode program from here on (held groups keep their episodes)"),
    "rollout.agent_timeout_s": _LIMIT,
    "rollout.max_turns": _LIMIT,
    "rollout.env_timeout_s": _LIMIT,
    "rollout.env_workers": _HOW,
    "rollout.generation_batch_size": _HOW,
    "rollout.cuda_graphs": _HOW,
    "rollout.eval_temperature": _EVAL,
    "rollout.eval_top_p": _EVAL,
    "rollout.eval_num_generations": _EVAL,
    "rollout.vllm_sync_every": _HOW,
    "rollout.vllm_gpu_memory_utilization": _HOW,
    "rollout.vllm_sleep": _HOW,
    "rollout.vllm_quantization": _HOW,
    "reward.functions": _SCORE,
    "reward.default_scorer": _SCORE,
    "reward.source_scorers": _SCORE,
    "reward.timeout_s": _LIMIT,
    "reward.num_workers": _HOW,
    "reward.code.sandbox": _HOW,
    "reward.code.partial_credit": _SCORE,
    "reward.code.require_block": _SCORE,
    "reward.code.float_tolerance": _SCORE,
    "reward.code.parallel": _HOW,
    **{
        f"reward.code.{name}": _LIMIT
        for name in (
            "test_timeout_s",
            "program_timeout_s",
            "memory_mb",
            "max_processes",
            "max_file_mb",
            "max_open_files",
            "max_output_bytes",
        )
    },
    "algorithm.policy_loss": _LOSS,
    "algorithm.clip_low": _LOSS,
    "algorithm.clip_high": _LOSS,
    "algorithm.clip_c": _LOSS,
    "algorithm.loss_agg": _LOSS,
    "algorithm.advantage_scale": _LOSS,
    "algorithm.beta": _free("the KL term from here on (the reference is the starting model)"),
    "algorithm.kl_estimator": _LOSS,
    "algorithm.dynamic_sampling": _free(
        "the carry-over is dynamic sampling's surplus: it is dropped, its prompts not trained on",
        CARRY,
    ),
    "algorithm.keep_surplus": _free(
        "whether surplus groups are carried over from here on; the carry-over is dropped, its "
        "prompts not trained on",
        CARRY,
    ),
    "algorithm.dynamic_sampling_metric": _free("which groups dynamic sampling keeps from here on"),
    "algorithm.max_gen_rounds": _LIMIT,
    "algorithm.round_cap": _LIMIT,
    "algorithm.max_empty_steps": _LIMIT,
    "algorithm.skip_uniform_prompts": _free(
        "which drawn prompts are generated from here on (every draw counts in the position "
        "either way)"
    ),
    "algorithm.skip_max_prob": _free("which drawn prompts are generated from here on"),
    "algorithm.skip_key": _refused(
        "it keys the prompts' outcome history the checkpoint holds: under another key that "
        "history would be lost or misread",
        "with a history (skip_uniform_prompts, or a curriculum)",
        lambda c: (
            bool(c.get("algorithm.skip_uniform_prompts"))
            or c.get("data.curriculum", "none") != "none"
        ),
    ),
    "algorithm.overlong_filter": _LOSS,
    "algorithm.overlong_penalty": _SCORE,
    "algorithm.overlong_buffer": _SCORE,
    "algorithm.overlong_penalty_factor": _SCORE,
    "algorithm.is_cap": _LOSS,
    "algorithm.proximal_logprobs": _LOSS,
    "algorithm.is_level": _LOSS,
    "algorithm.is_mode": _LOSS,
    "algorithm.entropy_coef": _LOSS,
    "algorithm.entropy_control": _LOSS,
    "algorithm.clip_cov_ratio": _LOSS,
    "algorithm.clip_cov_low": _LOSS,
    "algorithm.clip_cov_high": _LOSS,
    "algorithm.kl_cov_ratio": _LOSS,
    "algorithm.kl_cov_coef": _LOSS,
    "algorithm.teacher": _free("the distillation signal from here on (the teacher holds no state)"),
    "algorithm.distill_coef": _LOSS,
    "algorithm.distill_only": _free(
        "it turns dynamic sampling's filter on or off: the carry-over is dropped, its "
        "prompts not trained on",
        CARRY,
    ),
    "algorithm.teacher_offload": _COMPUTE,
    "algorithm.teacher_api_key": _SECRET,
    "train.steps": _free(
        "where the run ends (lr_schedule=cosine and a curriculum of curriculum_steps=0 stretch "
        "to the new end); at or below the step reached there is nothing to train"
    ),
    "train.prompts_per_step": _free("the batch from here on (held groups fill the next ones)"),
    "train.mini_batch_size": _free("the updates per rollout step from here on"),
    "train.epochs": _free("the passes over each batch from here on"),
    "train.micro_batch_tokens": _COMPUTE,
    "train.packing": _COMPUTE,
    "train.shared_prompt_forward": _COMPUTE,
    "train.lr": _free("the learning rate is set at every update from the schedule"),
    "train.lr_schedule": _SCHEDULE,
    "train.warmup_steps": _SCHEDULE,
    "train.min_lr_ratio": _SCHEDULE,
    "train.weight_decay": _ADAM,
    "train.adam_beta1": _ADAM,
    "train.adam_beta2": _ADAM,
    "train.max_grad_norm": _LOSS,
    "train.precision": _free(
        "the numeric precision from here on (the weights and AdamW state are cast on loading)"
    ),
    "train.logits_chunk_size": _COMPUTE,
    "train.max_failed_steps": _LIMIT,
    "train.max_nonfinite_updates": _LIMIT,
    "train.sample_budget": _free(
        "where the run ends; a budget already spent leaves nothing to train"
    ),
    "train.data_parallel": _free(
        "how ranks share the model; either checkpoint format loads into either mode"
    ),
    "logging.console": _LOG,
    "logging.user_output_kb": _LOG,
    "logging.verbose": _LOG,
    "logging.tensorboard": _LOG,
    "logging.dashboard": _LOG,
    "logging.wandb": _LOG,
    "logging.wandb_project": _LOG,
    "logging.run_name": _LOG,
    "logging.eval_every": _EVAL,
    "logging.transcripts_per_step": _LOG,
    "checkpoint.save_every": _SAVE,
    "checkpoint.keep_last": _SAVE,
    "checkpoint.save_final_model": _SAVE,
    "checkpoint.on_signal": _SAVE,
    "checkpoint.signal_grace_s": _SAVE,
    "checkpoint.stop_signals": _SAVE,
    "health.enabled": _HEALTH,
    "health.fatal": _HEALTH,
    "health.max_truncated": _HEALTH,
    "health.uniform_steps": _HEALTH,
    "health.max_uniform": _HEALTH,
    "health.greedy_temperature": _HEALTH,
    "health.baseline_steps": _HEALTH,
    "health.flat_acc": _HEALTH,
    "health.entropy_floor": _HEALTH,
    "health.entropy_ceiling": _HEALTH,
    "health.length_share": _HEALTH,
    "health.length_growth": _HEALTH,
    "health.zero_grad_steps": _HEALTH,
    "health.max_mismatch_share": _HEALTH,
}
# Keys whose change is the act of resuming itself, not a different run.
IGNORED = ("resume",)


def config_keys() -> list[str]:
    """Every leaf key of the configuration schema, dotted, in schema order."""

    def walk(section: Any, prefix: str) -> list[str]:
        keys = []
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value):
                keys.extend(walk(value, f"{prefix}{f.name}."))
            else:
                keys.append(f"{prefix}{f.name}")
        return keys

    return walk(Config(), "")


def rule_of(key: str) -> Rule | None:
    """The rule of a flattened key: its own, or its mapping's (``reward.source_scorers.X``);
    None for a key the schema no longer has (a checkpoint of an older release)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        rule = RULES.get(".".join(parts[:n]))
        if rule is not None:
            return rule
    return None


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` of every key that differs (sorted by key)."""
    a, b = flatten(saved), flatten(current)
    return [
        (k, a.get(k), b.get(k))
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k) and k not in IGNORED
    ]


def compared_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The changes the rules act on: of the keys the checkpoint's config (``saved``) has. A
    key added to the schema since the checkpoint's release has no old value to compare."""
    known = flatten(saved)
    return [c for c in config_changes(saved, current) if c[0] in known]


def _as_override(value: Any) -> str:
    """``value`` as a ``key=value`` override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_as_override(v) for v in value) + "]"
    return str(value)


def refusal(saved: dict[str, Any], current: dict[str, Any], checkpoint: Path) -> str | None:
    """The one-line refusal of the refused keys that differ between ``saved`` (the
    checkpoint's config) and ``current`` (None: none; :func:`compared_changes`)."""
    a, b = flatten(saved), flatten(current)
    refused = []
    for key, old, new in compared_changes(saved, current):
        rule = rule_of(key)
        if rule is None or not rule.refused:
            continue
        if rule.applies is None or rule.applies(a) or rule.applies(b):
            refused.append((key, old, new, rule.why))
    if not refused:
        return None
    what = "; ".join(f"{k} {old!r} there, {new!r} now ({why})" for k, old, new, why in refused)
    back = ", ".join(f"{k}={_as_override(old)}" for k, old, _, _ in refused)
    return (
        f"cannot resume from {checkpoint}: {what}. Resume with {back}, or choose a new "
        "output_dir to start a new run."
    )


def changed_keys_warning(changes: list[tuple[str, Any, Any]]) -> str | None:
    """The warning that lists every changed key (None: nothing changed)."""
    if not changes:
        return None
    listed = ", ".join(f"{k} {old} -> {new}" for k, old, new in changes)
    n = len(changes)
    return f"resuming with {n} changed key{'s' if n != 1 else ''}: {listed}"


def _dropped(changes: list[tuple[str, Any, Any]]) -> dict[Held, list[str]]:
    """Which held groups the changed keys drop, with the keys that drop each."""
    out: dict[Held, list[str]] = {}
    for key, _, _ in changes:
        rule = rule_of(key)
        for held in rule.drops if rule is not None else ():
            out.setdefault(held, []).append(key)
    return out


def _held(state: dict[str, Any]) -> dict[Held, int]:
    """How many carried-over groups and batches filled ahead a trainer state holds."""
    return {
        CARRY: len((state.get("sampler") or {}).get("carry") or []),
        QUEUE: len(state.get("rollout_queue") or {}),
    }


def drop_note(state: dict[str, Any], changes: list[tuple[str, Any, Any]]) -> str | None:
    """The line that says which held groups of ``state`` the changed keys drop (None: none)."""
    held, dropped = _held(state), _dropped(changes)
    nouns = {
        CARRY: ("carried-over group", "carried-over groups"),
        QUEUE: ("batch filled ahead", "batches filled ahead"),
    }
    parts, keys = [], set()
    for what, (one, many) in nouns.items():
        if what in dropped and held[what]:
            parts.append(f"{held[what]} {one if held[what] == 1 else many}")
            keys.update(dropped[what])
    if not parts:
        return None
    named = ", ".join(f"{k} {old} -> {new}" for k, old, new in changes if k in keys)
    return (
        f"{named}: dropping the checkpoint's {' and '.join(parts)} (made under the old "
        "setting; not trained on)"
    )


def continue_state(state: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a loaded trainer state) without the held groups that the config changes
    since (``current``: the config as plain data) make unusable; what :func:`drop_note` says."""
    saved = state.get("config")
    dropped = _dropped(compared_changes(saved, current)) if saved else {}
    out = dict(state)
    if CARRY in dropped and out.get("sampler") is not None:
        out["sampler"] = {**out["sampler"], "carry": []}
    if QUEUE in dropped:
        out["rollout_queue"] = None
    return out


def world_size_note(saved: int | None, current: int, step: int) -> str | None:
    """The line that says a run resumes at another world size (None: the same, or a
    checkpoint that does not record it).

    It resumes exactly at any world size but for its sampling: every rank draws the same
    prompts from the one data position and gathers every group (the carry-over, the prompts'
    history and the batches filled ahead are the whole run's), the update's gradient is the
    sum over ranks of the whole batch's; only each rank's sampling seed depends on its rank.
    """
    if saved is None or saved == current:
        return None

    def ranks(n: int) -> str:
        return f"{n} rank{'s' if n != 1 else ''}"

    return (
        f"resuming a run of {ranks(saved)} on {current}: weights, optimizer state and data "
        f"position carry over; sampling seeds are per rank, so from step {step} the run "
        f"follows a {current}-rank trajectory, not the {saved}-rank one it would have"
    )


def nothing_to_train(state: dict[str, Any], cfg: Config) -> str | None:
    """The line that says the checkpoint already reached ``train.steps`` (or spent
    ``train.sample_budget``); None when there is something to do.

    ``train.steps=0`` (evaluate only) evaluates the checkpoint. A checkpoint at exactly
    ``train.steps`` (or the budget) of a run that did not finish (no ``summary.json`` of that
    step without an error or an interruption: stopped during its final evaluation or export)
    still finishes it."""
    step, t = int(state["step"]), cfg.train
    finished = _summary_file(Path(cfg.output_dir))
    stopped = finished is not None and finished.get("steps") == step
    interrupted = stopped and "interrupted" in finished  # by a signal, before its final save
    budget = t.sample_budget
    if budget and int(state.get("samples_generated", 0)) >= budget and not interrupted:
        n = int(state["samples_generated"])
        return (
            f"already generated {n} responses at step {step} (train.sample_budget={budget}): "
            "nothing to train; raise train.sample_budget to continue"
        )
    if t.steps == 0 or step < t.steps:
        return None
    if step == t.steps and (not stopped or "error" in finished or interrupted):
        return None
    return (
        f"already at step {step} (train.steps={t.steps}): nothing to train; raise train.steps "
        "to continue"
    )


def _summary_file(out: Path) -> dict[str, Any] | None:
    """``out/summary.json``, None when there is none (or it cannot be read)."""
    try:
        return dict(json.loads((out / "summary.json").read_text()))
    except (OSError, ValueError):
        return None


def saved_summary(state: dict[str, Any], out: Path) -> dict[str, Any]:
    """The run's summary as it was saved: ``summary.json``, else the checkpoint's."""
    found = _summary_file(out)
    return found if found is not None else {**state.get("summary", {}), "steps": state["step"]}


def check_before_loading(
    cfg: Config, checkpoint: Path, world_size: int, log: Callable[[str], None]
) -> None:
    """Check, from its trainer state alone, that ``cfg`` can resume from ``checkpoint``.

    Raises :class:`TrainingError` for a refused change (:data:`RULES`) and
    :class:`NothingToTrain` when the checkpoint already reached ``train.steps``; else warns
    of the changed keys and logs what is dropped (:func:`drop_note`) and a changed world
    size (:func:`world_size_note`).
    """
    state = read_trainer_state(checkpoint)
    saved = state.get("config")
    current = cfg.to_dict()
    changes = config_changes(saved, current) if saved else []
    refused = refusal(saved, current, checkpoint) if saved else None
    if refused:
        raise TrainingError(refused)
    done = nothing_to_train(state, cfg)
    if done:
        log(done)
        raise NothingToTrain(
            done, step=int(state["step"]), summary=saved_summary(state, Path(cfg.output_dir))
        )
    warning = changed_keys_warning(changes)
    if warning:
        warnings.warn(warning, UserWarning, stacklevel=3)
    for line in (
        drop_note(state, compared_changes(saved, current) if saved else []),
        world_size_note(state.get("world_size"), world_size, int(state["step"])),
    ):
        if line:
            log(line)


def rules_table() -> str:
    """:data:`RULES` as the Markdown table of ``docs/guides/checkpoints.md``."""
    rows = ["| Key | On resume | Why |", "|---|---|---|"]
    for key in config_keys():
        rule = RULES[key]
        verdict = f"**{rule.verdict}**" if rule.refused else rule.verdict
        rows.append(f"| `{key}` | {verdict} | {rule.why} |")
    return "\n".join(rows) + "\n"
