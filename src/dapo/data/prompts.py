"""Prompts for the policy: the configured prompt sets, rendering (chat template), tokenizing,
the length filter, and the seeded endless stream of training prompts."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from dapo.config import DataConfig
from dapo.data.curriculum import draw
from dapo.data.images import PixelCache, encode_with_images, render_with_images
from dapo.data.records import NAMED_ROWS, LoadStats, PromptRecord, Row, record_field
from dapo.data.sources import PromptSource, load_records
from dapo.data.tasks import is_builtin, load_task
from dapo.errors import DataError

_TOKENIZE_BATCH = 1024
# The token ids of the last few prompt sets, by tokenizer and texts: a process that builds
# several trainers on the same data (a sweep, a notebook, the test suite) tokenizes it once.
# 20,000 built-in prompts took 1.4 s with the character tokenizer (AMD EPYC).
_RECENT: OrderedDict[tuple[str, str], list[tuple[int, ...]]] = OrderedDict()
_RECENT_SIZE = 4


def render_prompt(record: PromptRecord, tokenizer: Any) -> str:
    """Prompt text: chat messages through the tokenizer's chat template, else joined with
    their roles (:func:`join_messages`)."""
    prompt = record.prompt
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                [dict(m) for m in prompt], tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            raise DataError(
                f"prompt uid={record.uid}: the tokenizer's chat template failed "
                f"({type(exc).__name__}: {exc}). Fix: check the message roles/order suit this "
                "model's template, or use plain-text prompts."
            ) from exc
        if not isinstance(text, str):
            raise DataError(
                f"prompt uid={record.uid}: apply_chat_template returned a "
                f"{type(text).__name__}, not text. Fix: use a tokenizer whose chat template "
                "renders to a string."
            )
        return text
    return join_messages(prompt)


NO_TEMPLATE_PREFIX = "assistant:"  # the turn the model is asked to take, as a template would


def join_messages(messages: list[dict[str, str]]) -> str:
    """Chat messages for a tokenizer without a chat template: one ``role: content`` line
    each and the assistant's turn to start, so that the roles are not lost."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, NO_TEMPLATE_PREFIX])


def no_template_line(records: list[PromptRecord], tokenizer: Any) -> str | None:
    """The start-up line saying chat prompts are joined without a chat template, or None."""
    if getattr(tokenizer, "chat_template", None):
        return None
    chat = sum(not isinstance(r.prompt, str) for r in records)
    if not chat:
        return None
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return (
        f"{chat} of {len(records)} prompts are chat messages and the tokenizer {name!r} has no chat "
        "template: each is joined as 'role: content' lines ending with 'assistant:' (a "
        "tokenizer with a chat template, model.tokenizer=PATH, renders them as the model "
        "was trained to read them)"
    )


def encode_prompts(
    records: list[PromptRecord],
    tokenizer: Any,
    max_prompt_length: int,
    *,
    stats: LoadStats | None = None,
    text_of: Callable[[PromptRecord], str] | None = None,
    vision: tuple[Any, PixelCache] | None = None,
) -> tuple[list[PromptRecord], list[list[int]], int]:
    """Render and tokenize prompts; drop (never truncate) those over ``max_prompt_length``.

    ``text_of`` renders one record as the model will see it when that is more than its chat
    template (a multi-turn run's opening, with the tools' schemas); the length limit applies
    to its tokens. The texts are tokenized in batches, without special tokens (one call per
    prompt took most of a small run's start). Returns the kept records, their token ids and
    the number dropped. If ``stats`` is given, its ``too_long``, ``too_long_rows`` (the first
    few dropped) and ``kept`` are updated. ``vision``: a vision-language model's
    ``(processor, pixel cache)``, through which prompts with images are rendered and
    tokenized (their ids are :class:`~dapo.data.images.ImagePrompt`); without it a record
    with images is refused.
    """
    if max_prompt_length <= 0:
        raise DataError(
            f"data.max_prompt_length must be positive, got {max_prompt_length}. "
            "Fix: set data.max_prompt_length to the prompt token budget."
        )
    render = text_of or (lambda r: render_prompt(r, tokenizer))
    visual = [i for i, r in enumerate(records) if r.images]
    if visual and vision is None:
        raise DataError(
            f"prompt uid={records[visual[0]].uid} has {len(records[visual[0]].images)} "
            f"image(s) ({len(visual)} of {len(records)} prompts have images), but the model is "
            "a text model. Fix: train a vision-language model (model.name_or_path), or drop "
            "the images column"
        )
    texts = [render(r) if not r.images else "" for r in records]
    all_ids = tokenize_texts(texts, tokenizer)
    if visual:
        processor, pixels = vision
        rendered = [render_with_images(records[i].prompt, processor) for i in visual]
        encoded = encode_with_images(rendered, [records[i].images for i in visual], *vision)
        for i, ids in zip(visual, encoded, strict=True):
            all_ids[i] = ids

    kept: list[PromptRecord] = []
    kept_ids: list[list[int]] = []
    too_long: list[tuple[int, int]] = []  # the first few: position, length
    for i, (record, ids) in enumerate(zip(records, all_ids, strict=True)):
        if len(ids) <= max_prompt_length:
            kept.append(record)
            kept_ids.append(ids)
        elif len(too_long) < NAMED_ROWS:
            too_long.append((i, len(ids)))
    dropped = len(records) - len(kept)
    if records and not kept:
        lengths = [len(ids) for ids in all_ids]
        seen, fix = "", ""
        if text_of is not None:  # a multi-turn opening: its tools' schemas count too
            seen = " as the model sees them (chat template, the tools' schemas)"
            fix = (
                "; data.max_prompt_length + rollout.max_completion_length must fit the "
                "model's context), shorten the tools' docstrings"
            )
        raise DataError(
            f"all {len(records)} prompts are longer than data.max_prompt_length="
            f"{max_prompt_length} tokens{seen} (shortest {min(lengths)}, longest "
            f"{max(lengths)}). Fix: raise data.max_prompt_length to at least {min(lengths)} "
            f"({max(lengths)} keeps every prompt{fix or ')'}, or check the tokenizer/chat "
            "template."
        )
    if stats is not None:
        stats.too_long = dropped
        stats.too_long_rows = too_long
        stats.kept = len(kept)
    return kept, kept_ids, dropped


def dropped_lines(stats: LoadStats, which: str, max_prompt_length: int) -> list[str]:
    """Start-up lines for the prompts dropped while loading (duplicates) and encoding (over
    ``max_prompt_length``), each naming its first rows; ``which`` is ``training`` or
    ``held-out``."""
    lines = []
    if stats.duplicates:
        named: list[tuple[Row | str, str]] = [
            (row, f"repeats {_row_name(first, row)}") for row, first in stats.duplicate_rows
        ]
        lines.append(
            f"dropped {_prompts(stats.duplicates, 'duplicate ' + which)} (the first row of "
            f"each prompt is kept): {_rows_text(named, stats.duplicates)}"
        )
    if stats.too_long:
        named = [(stats.origin(i) or f"prompt {i}", f"{n} tokens") for i, n in stats.too_long_rows]
        lines.append(
            f"dropped {_prompts(stats.too_long, which)} longer than data.max_prompt_length="
            f"{max_prompt_length} tokens: {_rows_text(named, stats.too_long)}"
        )
    return lines


def _prompts(n: int, which: str) -> str:
    return f"{n} {which} prompt{'' if n == 1 else 's'}"


def _row_name(row: Row, beside: Row | None = None) -> str:
    """``train.jsonl row 12``; ``row 12`` where ``beside`` is of the same file."""
    where, index = row
    return f"row {index}" if beside is not None and beside[0] == where else f"{where} row {index}"


def _rows_text(named: list[tuple[Row | str, str]], total: int) -> str:
    """``train.jsonl: row 3 (D), row 9 (D) and 4 more``; a record of unknown origin (a
    built-in task's) is named by a text of its own (``prompt 3``)."""
    wheres = {row[0] for row, _ in named if not isinstance(row, str)}
    one = len(wheres) == 1 and not any(isinstance(row, str) for row, _ in named)
    parts = [
        f"{row if isinstance(row, str) else f'row {row[1]}' if one else _row_name(row)} ({d})"
        for row, d in named
    ]
    text = (f"{wheres.pop()}: " if one else "") + ", ".join(parts)
    return text + (f" and {total - len(named)} more" if total > len(named) else "")


def tokenize_texts(texts: list[str], tokenizer: Any) -> list[list[int]]:
    """Each text's token ids without special tokens, tokenized in batches, each distinct
    text once (the built-in tasks repeat problems: 20,000 training prompts are 6,840 texts,
    tokenized in 0.6 s instead of 3.6 s); remembered for the last few sets when
    ``tokenizer`` is a fast (Rust) one, whose whole definition is part of the key."""
    key = _texts_key(texts, tokenizer)
    if key is not None and key in _RECENT:
        _RECENT.move_to_end(key)
        return [list(ids) for ids in _RECENT[key]]
    distinct = list(dict.fromkeys(texts))
    ids_of: dict[str, list[int]] = {}
    for start in range(0, len(distinct), _TOKENIZE_BATCH):
        batch = distinct[start : start + _TOKENIZE_BATCH]
        enc = tokenizer(batch, add_special_tokens=False)
        ids_of.update(zip(batch, enc["input_ids"], strict=True))
    all_ids = [list(ids_of[text]) for text in texts]
    if key is not None:
        _RECENT[key] = [tuple(ids) for ids in all_ids]
        while len(_RECENT) > _RECENT_SIZE:
            _RECENT.popitem(last=False)
    return all_ids


def _texts_key(texts: list[str], tokenizer: Any) -> tuple[str, str] | None:
    """(the tokenizer's definition, the texts) as digests; None for a tokenizer that is
    not a transformers fast tokenizer (its behaviour may live in Python code)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    to_str = getattr(backend, "to_str", None)
    if to_str is None or type(tokenizer).__call__ is not _fast_call():
        return None
    definition = hashlib.blake2b(to_str().encode(), digest_size=16)
    definition.update(type(tokenizer).__qualname__.encode())
    data = hashlib.blake2b(digest_size=16)
    for text in texts:
        data.update(text.encode())
        data.update(b"\0")
    return definition.hexdigest(), data.hexdigest()


def _fast_call() -> Any:
    """``__call__`` of transformers' fast tokenizers (a subclass that overrides it is not
    remembered)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.__call__


def group_repeats(records: list[PromptRecord]) -> dict[str, list[int]]:
    """Map each uid to the indices of its records, in first-appearance order."""
    groups: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        groups.setdefault(record.uid, []).append(i)
    return groups


def history_keys(records: list[PromptRecord], field: str | None) -> list[str]:
    """Each record's key in the prompt-outcome history: its uid (identical prompts share
    it), or the value of ``field`` (``algorithm.skip_key``) so that rows sharing it share a history."""
    if field is None:
        return [r.uid for r in records]
    return [str(record_field(r, field, "algorithm.skip_key")) for r in records]


def load_prompt_set(
    data: DataConfig,
    which: str,
    source: PromptSource | None = None,
    answers: str = "text",
    stats: LoadStats | None = None,
) -> list[PromptRecord]:
    """The training (``which="train"``) or held-out (``"eval"``) prompts: ``source`` if
    given (in-memory data such as a ``datasets.Dataset`` or a list of row dicts, or anything
    data.train takes), else ``data.train`` / ``data.eval``. Either way the rows go through
    the same column rules (data.prompt_key, data.answer_key, data.data_source_key, the split
    of a DatasetDict), errors and dedup; the length filter is :func:`encode_prompts`'.
    ``answers`` says what an answer may be (:class:`~dapo.data.records.RecordOptions`).
    ``stats``, if given, gets the loading's counts and rows (:class:`LoadStats`; a built-in
    task gives none)."""
    if which not in ("train", "eval"):
        raise ValueError(f"which must be 'train' or 'eval', got {which!r}")
    if source is None:
        source = data.train if which == "train" else data.eval
    if source is None:
        return []
    if isinstance(source, str) and is_builtin(source):
        n = 20000 if which == "train" else data.max_eval_prompts
        return load_task(source, "train" if which == "train" else "test", n=n)
    records, loaded = load_records(
        source,
        split=data.train_split if which == "train" else data.eval_split,
        split_setting=f"data.{which}_split",
        name=f"{which}_dataset",
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        data_source_key=data.data_source_key,
        dedupe=True,
        setting_prefix="data.",
        answers=answers,
    )
    if stats is not None:
        for f in dataclasses.fields(LoadStats):
            setattr(stats, f.name, getattr(loaded, f.name))
    return records[: data.max_eval_prompts] if which == "eval" else records


class PromptStream:
    """Endless, seeded, reshuffled-per-epoch stream over the training prompts; or, with a
    curriculum's pool (:meth:`use_pool`), seeded draws from that pool."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()
        self._pool: tuple[list[int], int] | None = None

    def use_pool(self, order: list[int], size: int) -> None:
        """Draw from here on from ``order[:size]`` (each draw a pure function of the seed and
        the stream position), not from the shuffled epochs."""
        self._pool = (order, size)

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    @property
    def position(self) -> int:
        """Draws made so far, over all epochs: the stream position of the next draw."""
        return self.epoch * self.n + self.pos

    def _next(self) -> int:
        if self.pos == self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._make_order()
        if self._pool is None:
            index = self._order[self.pos]
        else:
            index = draw(*self._pool, self.seed, self.position)
        self.pos += 1
        return index

    def take(self, k: int) -> list[int]:
        return [self._next() for _ in range(k)]

    def take_skipping(
        self, k: int, skip: Callable[[int, int], bool]
    ) -> tuple[list[int], list[int]]:
        """The next ``k`` prompts for which ``skip(index, position)`` is false, and the ones
        passed over on the way (each draw is consumed either way)."""
        taken: list[int] = []
        skipped: list[int] = []
        while len(taken) < k:
            position = self.position
            index = self._next()
            (skipped if skip(index, position) else taken).append(index)
        return taken, skipped

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._make_order()
