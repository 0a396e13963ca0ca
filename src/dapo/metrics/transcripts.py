"""Transcripts: a few rollouts of each step as a person reads them (``rollouts.jsonl``).

:func:`transcript_records` picks ``k`` samples of a step's scored groups (seeded: the same
step and seed pick the same samples) and describes each as a plain dict:

- ``step``, ``group``, ``sample`` (the group's index in the step's batch, the sample's in
  its group; the groups left out of training are numbered on after the trained ones, in
  the order they were generated), ``generated_step`` (the step that generated the group:
  carried-over groups are older), ``uid``,
  ``data_source``, ``ground_truth``;
- ``prompt``: the prompt ids decoded with their special tokens, as the model saw them
  (chat template, tool schemas and the environment's opening included), a run of one
  repeated special token (a prompt's image tokens) written once with its count
  (``<image>×64``);
- ``images``: the prompt's images, then those of an episode's environment turns, in order,
  as paths (relative to the run directory) of small PNGs saved beside the file
  (``images/<digest>-<i>.png``); ``[]`` for a text prompt;
- ``turns``: ``[{"role": "assistant" | "environment", "text": ..., "tokens": n}]`` in
  order; an assistant turn also has ``tool_calls`` (``[{"name", "arguments"}]``, read with
  the hermes parser) and, for a call that does not parse, ``tool_call_error``. A
  single-turn sample is one assistant turn. An assistant turn's text is decoded without the
  EOS token that ended it;
- ``reward`` (what was trained on), ``correct`` (the reward functions' verdict; None for
  a reward that says nothing of correctness, e.g. partial credit),
  ``penalty`` (the overlong length shaping inside ``reward``), ``score`` (``reward -
  penalty``), ``group_rewards`` (every sample's reward of the group), ``advantage``;
- ``end``: an episode's end reason (``done``, ``max_turns``, ``budget``, ``env_failure``,
  ``bad_tool_call``), or ``eos`` / ``truncated`` for a single-turn sample; ``failure``:
  what failed, when something did.

:class:`TranscriptWriter` appends them to ``output_dir/rollouts.jsonl``;
:func:`read_transcripts` reads them back and :func:`format_transcript` lays one out for a
terminal (``dapo show``).
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dapo.atomic import append_whole, atomic_write
from dapo.data.images import images_of
from dapo.environments.tools import ToolCallParseError, parse_hermes

TRANSCRIPTS_FILE = "rollouts.jsonl"
IMAGES_DIR = "images"  # the prompts' images, beside rollouts.jsonl

__all__ = [
    "TRANSCRIPTS_FILE",
    "TranscriptWriter",
    "format_transcript",
    "read_transcripts",
    "transcript_records",
]


def transcript_records(
    step: int,
    groups: Sequence[Any],
    advantages: Sequence[Sequence[float]] | None,
    tokenizer: Any,
    k: int,
    seed: int,
    parser: Callable[[str], list[Any]] = parse_hermes,
    first_group: int = 0,
) -> list[dict[str, Any]]:
    """``k`` transcripts of one rollout step's scored groups (``ScoredGroup``), as dicts
    (see the module's docstring), ordered by group and sample.

    The samples come from ``k`` different groups while there are enough (one each, then a
    second round), chosen with ``seed`` and ``step``: deterministic. ``advantages``: one
    list per group, each sample's advantage (``None``: not known, written as null).
    ``parser``: reads tool calls from assistant turns (``rollout.tool_parser``'s).
    ``first_group``: the step's index of ``groups[0]`` (the groups left out of training
    are numbered after the trained ones)."""
    if k <= 0 or not groups:
        return []
    if advantages is not None and len(advantages) != len(groups):
        raise ValueError(f"{len(advantages)} advantage lists for {len(groups)} groups")
    rng = random.Random(f"transcripts:{seed}:{step}")
    order = rng.sample(range(len(groups)), len(groups))
    samples = {
        g: rng.sample(range(len(groups[g].response_ids)), len(groups[g].response_ids))
        for g in order
    }
    picked: list[tuple[int, int]] = []
    for rank in range(max((len(s) for s in samples.values()), default=0)):
        for g in order:
            if rank < len(samples[g]) and len(picked) < k:
                picked.append((g, samples[g][rank]))
    out = []
    for g, i in sorted(picked):
        adv = None if advantages is None else float(advantages[g][i])
        out.append(_record(step, first_group + g, i, groups[g], adv, tokenizer, parser))
        shown = [x for x in (groups[g].prompt_ids, groups[g].response_ids[i]) if images_of(x)]
        if shown:  # saved as PNGs by TranscriptWriter.write
            out[-1]["_images"] = shown
    return out


def _record(
    step: int,
    g: int,
    i: int,
    group: Any,
    advantage: float | None,
    tokenizer: Any,
    parser: Callable[[str], list[Any]],
) -> dict[str, Any]:
    record = group.record
    ids = list(group.response_ids[i])
    mask = group.model_mask[i] if group.model_mask is not None else [1] * len(ids)
    stats = group.episode_stats[i] if group.episode_stats is not None else None
    reward = float(group.rewards[i])
    penalty = float(group.penalty[i]) if group.penalty else 0.0
    if stats is not None:
        end, failure = stats.get("end"), stats.get("failure")
    else:
        end, failure = ("truncated" if group.truncated[i] else "eos"), None
    return {
        "step": step,
        "group": g,
        "sample": i,
        "generated_step": getattr(group, "step", step),
        "uid": getattr(record, "uid", None),
        "data_source": getattr(record, "data_source", None),
        "ground_truth": getattr(record, "ground_truth", None),
        "prompt": summarise_repeats(
            tokenizer.decode(list(group.prompt_ids), skip_special_tokens=False)
        ),
        "images": [
            image_path(x, j)
            for x in (group.prompt_ids, group.response_ids[i])
            for j in range(len(images_of(x)))
        ],
        "turns": _turns(ids, mask, tokenizer, parser),
        "reward": reward,
        "correct": bool(group.correct[i]) if getattr(group, "claims_correct", True) else None,
        "penalty": penalty,
        "score": reward - penalty,
        "group_rewards": [float(r) for r in group.rewards],
        "advantage": advantage,
        "end": end,
        "failure": failure,
    }


def _turns(
    ids: list[int], mask: Sequence[int], tokenizer: Any, parser: Callable[[str], list[Any]]
) -> list[dict[str, Any]]:
    """The response split into runs of the model's tokens (1) and the environment's (0)."""
    eos = tokenizer.eos_token_id
    turns: list[dict[str, Any]] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and mask[end] == mask[start]:
            continue
        run = ids[start:end]
        if mask[start]:
            body = run[:-1] if run and run[-1] == eos else run
            text = tokenizer.decode(body, skip_special_tokens=False)
            turn: dict[str, Any] = {"role": "assistant", "text": text, "tokens": len(run)}
            try:
                calls = parser(text)
                turn["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in calls]
            except ToolCallParseError as exc:
                turn["tool_calls"], turn["tool_call_error"] = [], str(exc)
        else:
            text = summarise_repeats(tokenizer.decode(run, skip_special_tokens=False))
            turn = {"role": "environment", "text": text, "tokens": len(run)}
        turns.append(turn)
        start = end
    return turns


class TranscriptWriter:
    """Appends transcripts to ``output_dir/rollouts.jsonl``, one JSON line each.

    ``resume_step``: a resumed run keeps the lines of steps ``<= resume_step`` and drops
    what a crashed run wrote after it; ``None``: a new run, whose file starts empty. Each
    :meth:`write` is one ``write`` on an append-only descriptor (a crash leaves at most a
    torn last line, dropped when the file is next opened or read)."""

    def __init__(self, output_dir: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(output_dir) / TRANSCRIPTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = -1 if resume_step is None else resume_step
        kept = [
            (json.dumps(r, default=_plain) + "\n").encode("utf-8")
            for r in (_read(self.path) if keep >= 0 and self.path.exists() else ())
            if isinstance(r.get("step"), int) and r["step"] <= keep
        ]
        if kept or self.path.exists():
            atomic_write(self.path, lambda f: f.writelines(kept))
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        """Append ``records`` (from :func:`transcript_records`)."""
        if not records:
            return
        if self._fd is None:
            raise RuntimeError("TranscriptWriter.write() called after close()")
        self._save_images(records)
        data = "".join(json.dumps(r, default=_plain) + "\n" for r in records).encode("utf-8")
        append_whole(self._fd, data, self.path)  # all of this step's lines, or none

    def _save_images(self, records: Sequence[dict[str, Any]]) -> None:
        """Each record's images (``_images``: the prompt and the response that hold them,
        taken out of the record) as PNGs at its ``images`` paths, written once per image."""
        for r in records:
            for seq in r.pop("_images", ()):
                for j, image in enumerate(images_of(seq)):
                    path = self.path.parent / image_path(seq, j)
                    if not path.exists():
                        path.parent.mkdir(parents=True, exist_ok=True)
                        atomic_write(path, lambda f, image=image: image.save(f, format="PNG"))

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> TranscriptWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def image_path(prompt: Any, j: int) -> str:
    """Where the ``j``-th image of a prompt (or of an episode's later turns) is saved,
    relative to the run directory."""
    return f"{IMAGES_DIR}/{prompt.digest}-{j}.png"


def summarise_repeats(text: str) -> str:
    """A run of one special token repeated (``<image><image>...``) as ``<image>×N``."""
    return _REPEATS.sub(lambda m: f"{m.group(1)}×{len(m.group(0)) // len(m.group(1))}", text)


_REPEATS = re.compile(r"(<[^<>\s]{1,40}>)\1{2,}")


def _plain(value: Any) -> Any:
    """A value JSON cannot write as it is (a tool's argument object): its text."""
    return str(value)


def _read(path: Path) -> Iterator[dict[str, Any]]:
    for raw in path.read_bytes().split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue  # a torn line of a crash
        if isinstance(obj, dict):
            yield obj


def read_transcripts(run: str | Path) -> list[dict[str, Any]]:
    """The transcripts of a run directory (or of a ``rollouts.jsonl`` path), in order."""
    path = Path(run)
    path = path / TRANSCRIPTS_FILE if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(
            f"no transcripts at {path}: the run wrote none (logging.transcripts_per_step=0, "
            "or a run from before transcripts were written)"
        )
    return list(_read(path))


def format_transcript(record: dict[str, Any], width: int = 100) -> str:
    """One transcript laid out for a terminal: a header line, the prompt, each turn under
    its role, and the outcome."""
    rule = "=" * width
    adv = record.get("advantage")
    head = (
        ("NOT TRAINED  " if record.get("left_out") else "")
        + f"step {record.get('step')}  group {record.get('group')}  sample {record.get('sample')}"
        f"  reward {record.get('reward'):+.3f}"
        + (f"  advantage {adv:+.3f}" if isinstance(adv, int | float) else "")
        + f"  end {record.get('end')}"
    )
    lines = [rule, head, rule, "--- prompt (as the model saw it) ---", record.get("prompt", "")]
    for path in record.get("images") or []:
        lines.append(f"  [image: {path}]")
    for turn in record.get("turns", []):
        lines.append(f"--- {turn['role']} ({turn.get('tokens', 0)} tokens) ---")
        lines.append(turn.get("text", ""))
        for call in turn.get("tool_calls") or []:
            lines.append(f"  -> tool call {call['name']}({json.dumps(call['arguments'])})")
        if turn.get("tool_call_error"):
            lines.append(f"  -> tool call that does not parse: {turn['tool_call_error']}")
    lines.append("--- outcome ---")
    correct = record.get("correct")
    verdict = "not said by the reward" if correct is None and "correct" in record else correct
    lines.append(
        f"reward {record.get('reward')} = score {record.get('score')} + length penalty "
        f"{record.get('penalty')}; correct: {verdict}; "
        f"ground truth: {record.get('ground_truth')!r}"
    )
    lines.append(f"group rewards: {record.get('group_rewards')}")
    if record.get("failure"):
        lines.append(f"failure: {record['failure']}")
    if record.get("left_out"):
        lines.append(f"not trained: {record['left_out']}")
    return "\n".join(lines)
