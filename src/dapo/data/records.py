"""Prompt records: validate and normalise rows of the DAPO reference format.

Every data problem raises :class:`DataError` with the file, the 0-based row index, the
field and the fix.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from dapo.data.images import IMAGE_COLUMNS, image_digest, read_images
from dapo.errors import DataError

_MISSING = object()


@dataclass
class PromptRecord:
    """One prompt with its reference answer."""

    prompt: str | list[dict[str, str]]  # plain text, or chat messages [{"role":..., "content":...}]
    ground_truth: Any  # a string; a dict where the rewards take one; "" where none asks
    data_source: str = "math_dapo"
    uid: str = ""  # stable id of the problem: identical prompts share it
    extra: dict[str, Any] = field(default_factory=dict)
    # RGB PIL images, one per placeholder of the prompt, in order (dapo.data.images); the
    # prompt's messages then have content parts ({"type": "image"}, {"type": "text"}).
    images: list[Any] = field(default_factory=list)

    def __setstate__(self, state: dict[str, Any]) -> None:  # pickled before images existed
        self.__dict__.update({"images": [], **state})


NAMED_ROWS = 5  # dropped rows named in the start-up lines (the first ones)

Row = tuple[str, int]  # where a record came from: the file (or data's name) and the row index


@dataclass
class LoadStats:
    """Counts from loading (and, through ``encode_prompts(stats=...)``, length filtering),
    with where the records came from and which rows were dropped (the first
    :data:`NAMED_ROWS`), for the start-up lines; only the counts compare."""

    rows: int = 0  # rows read
    duplicates: int = 0  # rows dropped as duplicate prompts
    repeats: list[int] = field(default_factory=list, compare=False)  # rows per distinct prompt
    too_long: int = 0  # dropped by the prompt-length filter (filled by encode_prompts)
    kept: int = 0
    origins: list[Row] = field(default_factory=list, compare=False, repr=False)  # per record
    # (the duplicate row, the row it repeats), the first few
    duplicate_rows: list[tuple[Row, Row]] = field(default_factory=list, compare=False)
    # (position among the records encoded, length in tokens), the first few
    too_long_rows: list[tuple[int, int]] = field(default_factory=list, compare=False)

    def origin(self, position: int) -> Row | None:
        """Where the record at ``position`` came from, when known."""
        return self.origins[position] if position < len(self.origins) else None


# --------------------------------------------------------------------------- helpers


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except ValueError:  # e.g. an int of more than 4300 digits
        text = f"<{type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _row_error(where: str, index: int, key: str, problem: str, fix: str) -> DataError:
    return DataError(f"{where}: row {index}: field '{key}': {problem}. Fix: {fix}")


def _to_plain(value: Any) -> Any:
    """Numpy arrays -> lists, numpy scalars -> Python scalars; everything else unchanged."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return value.tolist()
    return value


def _candidate_keys(row: Mapping[str, Any]) -> list[str]:
    """Top-level keys plus one level of dotted nested keys, for 'did you mean'."""
    keys: list[str] = []
    for k, v in row.items():
        keys.append(str(k))
        if isinstance(v, Mapping):
            keys.extend(f"{k}.{sub}" for sub in v)
    return keys


def _is_map(value: Any) -> bool:
    return type(value) is dict or isinstance(value, Mapping)


def _get_field(row: Mapping[str, Any], key: str) -> Any:
    """Value at ``key`` (a literal column name or a dotted path), or ``_MISSING``."""
    if key in row:
        return row[key]
    cur: Any = row
    for part in key.split("."):
        if _is_map(cur) and part in cur:
            cur = cur[part]
        else:
            return _MISSING
    return cur


def _missing_field_error(
    where: str, index: int, row: Mapping[str, Any], key: str, param: str
) -> DataError:
    top = sorted(str(k) for k in row)
    close = difflib.get_close_matches(key, _candidate_keys(row), n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    cur: Any = row
    reached: list[str] = []
    for part in key.split(".")[:-1]:
        if not _is_map(cur) or part not in cur:
            break
        cur = cur[part]
        reached.append(part)
        if cur is None:
            hint = f" ('{'.'.join(reached)}' is None.){hint}"
            break
    return _row_error(
        where,
        index,
        key,
        f"missing; the row's top-level keys are {top}{'.' + hint if hint else ''}",
        f"pass {param}=<the right key> (dotted paths reach nested fields, "
        f"e.g. 'reward_model.ground_truth')",
    )


def _normalize_messages(value: Any, where: str, index: int, key: str) -> list[dict[str, str]]:
    if _is_map(value) and isinstance(_to_plain(value.get("role")), list):
        # struct-of-lists layout: {"role": [...], "content": [...]}
        roles, contents = _to_plain(value.get("role")), _to_plain(value.get("content"))
        if not isinstance(contents, list) or len(contents) != len(roles):
            raise _row_error(
                where,
                index,
                key,
                "chat messages given as a dict of lists with unequal "
                f"'role'/'content' lengths: {_short(value)}",
                "store the prompt as a list of {'role': ..., 'content': ...} dicts",
            )
        value = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
    messages: list[dict[str, str]] = []
    for j, msg in enumerate(value):
        if not _is_map(msg):
            raise _row_error(
                where,
                index,
                key,
                f"message {j} is a {type(msg).__name__} ({_short(msg)}), not a dict",
                "each chat message must be a dict with 'role' and 'content' strings",
            )
        clean: dict[str, str] = {}
        for name in ("role", "content"):
            part = msg.get(name)
            if name == "content" and isinstance(_to_plain(part), list | tuple):
                part = _parts_content(_to_plain(part), where, index, key, j)
            if part is None:
                raise _row_error(
                    where,
                    index,
                    key,
                    f"message {j} has no '{name}' (keys: {sorted(map(str, msg))})",
                    "each chat message must be a dict with 'role' and 'content' strings",
                )
            if not isinstance(part, str) and not (name == "content" and isinstance(part, list)):
                raise _row_error(
                    where,
                    index,
                    key,
                    f"message {j} '{name}' is a {type(part).__name__} ({_short(part)}), "
                    "not a string",
                    f"make every message's '{name}' a string",
                )
            clean[name] = part
        messages.append(clean)
    return messages


def _parts_content(parts: Any, where: str, index: int, key: str, j: int) -> str | list[dict]:
    """A message's content given as parts: text joined into a string when it has no image,
    else ``[{"type": "image"} | {"type": "text", "text": str}]``."""
    out: list[dict[str, Any]] = []
    for part in parts:
        part = _plain_tree(part)
        kind = part.get("type") if _is_map(part) else None
        if kind == "image":
            out.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        else:
            raise _row_error(
                where,
                index,
                key,
                f"message {j} has a content part {_short(part)} that is neither "
                "{'type': 'text', 'text': str} nor {'type': 'image'}",
                "give content as a string or a list of text and image parts",
            )
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _has_content(content: str | list[dict[str, Any]]) -> bool:
    return bool(content.strip()) if isinstance(content, str) else bool(content)


def _normalize_prompt(value: Any, where: str, index: int, key: str) -> str | list[dict[str, str]]:
    fix_empty = "remove the row or fill in the prompt"
    if isinstance(value, str):
        if not value.strip():
            raise _row_error(where, index, key, "empty prompt", fix_empty)
        return value
    if type(value) is list:  # fast path: well-formed messages
        fast: list[dict[str, str]] = []
        for msg in value:
            if type(msg) is not dict:
                break
            role, content = msg.get("role"), msg.get("content")
            if type(role) is not str or type(content) is not str:
                break
            fast.append({"role": role, "content": content})
        else:
            if any(m["content"].strip() for m in fast):
                return fast
    else:
        value = _to_plain(value)
    is_struct_of_lists = _is_map(value) and isinstance(_to_plain(value.get("role")), list)
    if isinstance(value, list | tuple) or is_struct_of_lists:
        messages = _normalize_messages(value, where, index, key)
        if not messages or not any(_has_content(m["content"]) for m in messages):
            raise _row_error(
                where, index, key, f"empty prompt (messages: {_short(messages)})", fix_empty
            )
        return messages
    found = "None" if value is None else f"a {type(value).__name__} ({_short(value)})"
    raise _row_error(
        where,
        index,
        key,
        f"prompt is {found}, neither a string nor a list of chat messages",
        "store a string or a list of {'role': ..., 'content': ...} dicts, "
        "or point prompt_key at the right field",
    )


def _plain_tree(value: Any) -> Any:
    """``value`` with numpy arrays and scalars made lists and Python scalars, all the way
    down (a parquet row's nested fields)."""
    value = _to_plain(value)
    if isinstance(value, Mapping):
        return {str(k): _plain_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain_tree(v) for v in value]
    return value


def _normalize_answer(
    value: Any, where: str, index: int, key: str, answers: str = "text"
) -> str | dict[str, Any]:
    fix = "give every row a non-empty ground-truth answer (string or number), or drop the row"
    value = _to_plain(value)
    if isinstance(value, Mapping) and answers != "text":
        return _plain_tree(value)
    if value is None:
        raise _row_error(where, index, key, "ground truth is None", fix)
    if isinstance(value, bool):
        raise _row_error(
            where,
            index,
            key,
            f"ground truth is a bool ({value})",
            "store the answer as a string or number; check answer_key points at the answer",
        )
    if isinstance(value, int):
        try:
            return str(value)
        except ValueError:  # more digits than Python converts to text
            raise _row_error(
                where, index, key, f"ground truth is an integer of {value.bit_length()} bits", fix
            ) from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _row_error(where, index, key, f"ground truth is {value}", fix)
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise _row_error(where, index, key, f"ground truth is empty ({value!r})", fix)
        return text
    dict_fix = (
        " (a dict answer goes whole to reward functions that take it: give "
        "reward.functions, as the built-in scorers read text)"
        if isinstance(value, Mapping)
        else ""
    )
    raise _row_error(
        where,
        index,
        key,
        f"ground truth is a {type(value).__name__} ({_short(value)}), not a string or number",
        "store a single answer as a string or number; check answer_key points at the answer"
        + dict_fix,
    )


def _dedupe_key(prompt: str | list[dict[str, Any]]) -> str | tuple[tuple[str, str], ...]:
    """Cheap hashable key, equal exactly when the canonical forms are equal."""
    if isinstance(prompt, str):
        return prompt
    return tuple(
        (m["role"], m["content"] if isinstance(m["content"], str) else json.dumps(m["content"]))
        for m in prompt
    )


def _canonical(prompt: str | list[dict[str, str]]) -> str:
    if isinstance(prompt, str):
        return "text:" + prompt
    # messages are normalized to {"role", "content"} in that order, so this JSON is canonical
    return "chat:" + json.dumps(prompt, ensure_ascii=False, separators=(",", ":"))


def _uid(canonical: str, where: str, index: int, key: str) -> str:
    try:
        data = canonical.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. "\ud800" in a JSON file
        raise _row_error(
            where,
            index,
            key,
            f"the prompt is not valid Unicode (it holds the lone surrogate "
            f"{exc.object[exc.start]!r})",
            "remove the broken character (often half of an emoji split by truncation)",
        ) from None
    return hashlib.sha1(data).hexdigest()[:16]


# --------------------------------------------------------------------------- public API


class RecordOptions(TypedDict, total=False):
    """How rows map to records (the keyword arguments of ``load_records`` and
    ``records_from_rows``; defaults in :func:`build_records`)."""

    prompt_key: str  # dotted path of the prompt: text or chat messages
    answer_key: str  # dotted path of the ground truth
    data_source_key: str  # dotted path of the data source (picks the scorer)
    default_data_source: str  # for rows without one
    dedupe: bool  # keep the first row of each prompt (else all; repeats share a uid)
    max_rows: int | None  # stop after this many rows
    setting_prefix: str  # how errors name the key options: "data." -> data.prompt_key
    # What an answer may be: "text" (a string or number: the built-in scorers), "any" (a
    # dict too: user reward functions), "optional" (and absent: no reward asks for one).
    answers: str
    image_key: str | None  # the images' column (None: "images", else "image")


def build_records(
    located: Iterable[tuple[str, int, Mapping[str, Any]]],
    *,
    source: str,
    prompt_key: str = "prompt",
    answer_key: str = "reward_model.ground_truth",
    data_source_key: str = "data_source",
    default_data_source: str = "math_dapo",
    dedupe: bool = True,
    max_rows: int | None = None,
    setting_prefix: str = "",
    answers: str = "text",
    image_key: str | None = None,
) -> tuple[list[PromptRecord], LoadStats]:
    """Validate ``(where, row index, row)`` triples into records; ``source`` names the data
    in errors, and the key options are named there ``setting_prefix + "prompt_key"`` etc."""
    if max_rows is not None and max_rows < 0:
        raise DataError(f"max_rows must be >= 0 or None, got {max_rows}")
    stats = LoadStats()
    records: list[PromptRecord] = []
    uids: dict[Any, tuple[str, Row]] = {}  # dedupe key -> uid, its first row
    first: dict[Any, int] = {}  # dedupe key -> its position in stats.repeats
    for where, index, row in located:
        if max_rows is not None and stats.rows >= max_rows:
            break
        stats.rows += 1
        raw_prompt = _get_field(row, prompt_key)
        if raw_prompt is _MISSING:
            raise _missing_field_error(where, index, row, prompt_key, f"{setting_prefix}prompt_key")
        prompt = _normalize_prompt(raw_prompt, where, index, prompt_key)
        raw_answer = _get_field(row, answer_key)
        if raw_answer is _MISSING and answers == "optional":
            answer: str | dict[str, Any] = ""
        elif raw_answer is _MISSING:
            raise _missing_field_error(where, index, row, answer_key, f"{setting_prefix}answer_key")
        else:
            answer = _normalize_answer(raw_answer, where, index, answer_key, answers)

        images: list[Any] = []
        if (
            any(k in row for k in IMAGE_COLUMNS)
            or (image_key and image_key in row)
            or (
                not isinstance(prompt, str)
                and any(not isinstance(m["content"], str) for m in prompt)
            )
        ):
            images = read_images(row, prompt, where, index, image_key)
        key = _dedupe_key(prompt)
        if images:
            key = (key, image_digest(images))
        seen = uids.get(key)
        if seen is None:
            canonical = _canonical(prompt) + (f"images:{key[1]}" if images else "")
            uid = _uid(canonical, where, index, prompt_key)
            uids[key] = (uid, (where, index))
            first[key] = len(stats.repeats)
            stats.repeats.append(1)
        elif dedupe:
            stats.repeats[first[key]] += 1
            stats.duplicates += 1
            if len(stats.duplicate_rows) < NAMED_ROWS:
                stats.duplicate_rows.append(((where, index), seen[1]))
            continue
        else:
            stats.repeats[first[key]] += 1
            uid = seen[0]

        raw_source = _to_plain(_get_field(row, data_source_key))
        if raw_source is _MISSING or raw_source is None or raw_source == "":
            data_source = default_data_source
        elif isinstance(raw_source, str):
            data_source = raw_source
        else:
            try:
                data_source = str(raw_source)
            except ValueError:  # an integer of more than 4300 digits
                raise _row_error(
                    where,
                    index,
                    data_source_key,
                    "data source is too large to be a name",
                    "store the data source as a short string",
                ) from None
        extra = {
            k: _plain_tree(v)
            for k, v in row.items()
            if k not in (prompt_key, data_source_key, image_key, *IMAGE_COLUMNS)
            and not str(k).startswith("__index_level_")
        }
        records.append(PromptRecord(prompt, answer, data_source, uid, extra, images))
        stats.origins.append((where, index))

    if stats.rows == 0:
        limit = f" (max_rows={max_rows})" if max_rows is not None else ""
        raise DataError(
            f"{source}: the dataset is empty: 0 rows read{limit}. Fix: point at a file or "
            "split that has rows."
        )
    stats.kept = len(records)
    return records, stats


def record_field(record: PromptRecord, key: str, setting: str) -> Any:
    """The value of the row field ``key`` (dotted paths reach nested fields) of a record;
    a :class:`DataError` naming the config ``setting`` that asked for it if it has none."""
    value = _get_field(record.extra, key)
    if value is _MISSING or value is None:
        close = difflib.get_close_matches(key, _candidate_keys(record.extra), n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise DataError(
            f"training prompt uid={record.uid}: {setting}={key!r}, but the row has no such "
            f"field{hint}; its fields are {sorted(str(k) for k in record.extra)}. Fix: name a "
            f"field every row has, or set {setting}=null"
        )
    return _to_plain(value)


def located_rows(rows: Iterable[Any], where: str) -> Iterator[tuple[str, int, Mapping[str, Any]]]:
    """``(where, row index, row)`` for in-memory rows, each checked to be a mapping."""
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataError(
                f"{where}: row {index}: is a {type(row).__name__} ({_short(row, 60)}), not a "
                "mapping. Fix: give every row as a dict with the prompt and answer fields."
            )
        yield where, index, row


def records_from_rows(
    rows: Iterable[Mapping[str, Any]], *, source: str = "<rows>", **options: Unpack[RecordOptions]
) -> tuple[list[PromptRecord], LoadStats]:
    """Validate in-memory rows (dicts; numpy arrays allowed) into records, like ``load_records``."""
    return build_records(located_rows(rows, source), source=source, **options)
