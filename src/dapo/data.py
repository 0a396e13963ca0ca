"""Prompt datasets: load, validate, deduplicate, render and tokenize.

Reads the DAPO reference format (one row per prompt: ``prompt`` as chat messages,
``reward_model.ground_truth``, ``data_source``) from parquet, JSON / JSON lines, a
directory written by ``datasets.save_to_disk``, a directory of parquet files, or a
locally cached ``datasets`` name. Every data problem raises :class:`DataError` with the
file, the 0-based row index, the field and the fix.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DataError",
    "LoadStats",
    "PromptRecord",
    "encode_prompts",
    "group_repeats",
    "load_records",
    "records_from_rows",
    "render_prompt",
]

_BATCH_ROWS = 8192
_TOKENIZE_BATCH = 1024
_FILE_SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".json", ".arrow", ".csv", ".tsv", ".txt")
# "name" or "owner/name": what a datasets hub id looks like.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_MISSING = object()


@dataclass
class PromptRecord:
    """One prompt with its reference answer."""

    prompt: str | list[dict[str, str]]  # plain text, or chat messages [{"role":..., "content":...}]
    ground_truth: str
    data_source: str = "math_dapo"
    uid: str = ""  # stable id of the problem: identical prompts share it
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadStats:
    """Counts from loading (and, through ``encode_prompts(stats=...)``, length filtering)."""

    rows: int = 0  # rows read
    duplicates: int = 0  # rows dropped as duplicate prompts
    too_long: int = 0  # dropped by the prompt-length filter (filled by encode_prompts)
    kept: int = 0


class DataError(ValueError):
    """A problem with the data; the message names the file, row, field and the fix."""


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
            if part is None:
                raise _row_error(
                    where,
                    index,
                    key,
                    f"message {j} has no '{name}' (keys: {sorted(map(str, msg))})",
                    "each chat message must be a dict with 'role' and 'content' strings",
                )
            if not isinstance(part, str):
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
        if not messages or not any(m["content"].strip() for m in messages):
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


def _normalize_answer(value: Any, where: str, index: int, key: str) -> str:
    fix = "give every row a non-empty ground-truth answer (string or number), or drop the row"
    value = _to_plain(value)
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
    raise _row_error(
        where,
        index,
        key,
        f"ground truth is a {type(value).__name__} ({_short(value)}), not a string or number",
        "store a single answer as a string or number; check answer_key points at the answer",
    )


def _dedupe_key(prompt: str | list[dict[str, str]]) -> str | tuple[tuple[str, str], ...]:
    """Cheap hashable key, equal exactly when the canonical forms are equal."""
    if isinstance(prompt, str):
        return prompt
    return tuple((m["role"], m["content"]) for m in prompt)


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


# --------------------------------------------------------------------------- readers

_Located = Iterator[tuple[str, int, dict[str, Any]]]  # (file, row index in file, row)


def _lfs_hint(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
    except OSError:
        return ""
    if head.startswith(b"version https://git-lfs"):
        return " The file is a Git LFS pointer, not the data: fetch it with `git lfs pull`."
    return ""


def _iter_parquet(paths: list[Path]) -> _Located:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in paths:
        try:
            pf = pq.ParquetFile(path)
            batches = pf.iter_batches(batch_size=_BATCH_ROWS)
            index = 0
            for batch in batches:
                for row in batch.to_pylist():
                    yield str(path), index, row
                    index += 1
        except (pa.ArrowException, OSError) as exc:
            raise DataError(
                f"{path}: could not read as parquet ({exc}).{_lfs_hint(path)} "
                "Fix: check the file is a complete, valid parquet file."
            ) from exc


def _not_utf8(path: Path, exc: UnicodeDecodeError) -> DataError:
    where = ""
    with open(path, "rb") as fh:  # find the line (the text reader decodes ahead in chunks)
        for lineno, raw in enumerate(fh, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as line_exc:
                where = f" line {lineno}, byte {line_exc.start}:"
                exc = line_exc
                break
    return DataError(
        f"{path}:{where} not UTF-8 text ({exc.reason}).{_lfs_hint(path)} Fix: save the file "
        "as UTF-8 (JSON text is UTF-8), or convert it to parquet."
    )


def _parse_json(text: str) -> Any:
    """``json.loads``; every failure is a ``ValueError`` (too deep nesting too, and an
    integer of more than 4300 digits)."""
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError("nested too deeply") from exc


def _iter_jsonl(path: Path) -> _Located:
    index = lineno = 0
    with open(path, encoding="utf-8") as fh:
        lines = iter(fh)
        while True:
            try:
                line = next(lines)
            except StopIteration:
                break
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, exc) from exc
            lineno += 1
            if not line.strip():
                continue
            try:
                row = _parse_json(line)
            except ValueError as exc:
                msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                raise DataError(
                    f"{path}: row {index} (line {lineno}): invalid JSON ({msg}). "
                    "Fix: each line must be one JSON object."
                ) from exc
            if not isinstance(row, dict):
                raise DataError(
                    f"{path}: row {index} (line {lineno}): is a {type(row).__name__}, "
                    "not a JSON object. Fix: each line must be one JSON object."
                )
            yield str(path), index, row
            index += 1


def _iter_json(path: Path, split: str) -> _Located:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc) from exc
    try:
        data = _parse_json(text)
    except ValueError as exc:
        if getattr(exc, "msg", None) == "Extra data":  # several values: JSON lines in a .json
            yield from _iter_jsonl(path)
            return
        raise DataError(
            f"{path}: invalid JSON ({exc}). Fix: store a list of row objects, or one "
            "object per line (.jsonl)."
        ) from exc
    if isinstance(data, dict):
        lists = {k: v for k, v in data.items() if isinstance(v, list)}
        if split in lists:
            data = lists[split]
        elif len(lists) == 1:
            data = next(iter(lists.values()))
        elif "prompt" in data or not lists:
            data = [data]
        else:
            raise DataError(
                f"{path}: a JSON object with several lists {sorted(lists)} and none named "
                f"split={split!r}. Fix: pass split=<one of {sorted(lists)}>."
            )
    if not isinstance(data, list):
        raise DataError(
            f"{path}: top-level JSON is a {type(data).__name__}. Fix: store a list of row "
            "objects, or one object per line (.jsonl)."
        )
    for index, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(
                f"{path}: row {index}: is a {type(row).__name__}, not a JSON object. "
                "Fix: every row must be an object with the prompt and answer fields."
            )
        yield str(path), index, row


def _iter_hf_dataset(ds: Any, where: str) -> _Located:
    index = 0
    for table in ds.with_format("arrow").iter(batch_size=_BATCH_ROWS):
        for row in table.to_pylist():
            yield where, index, row
            index += 1


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _parquet_files(path: Path, split: str) -> list[Path]:
    files = sorted(p for p in path.rglob("*.parquet") if p.is_file())

    def in_split(p: Path) -> bool:
        stem = p.name[: -len(".parquet")]
        rel_dirs = p.relative_to(path).parts[:-1]
        return (
            split in rel_dirs or stem == split or bool(re.match(rf"{re.escape(split)}[-_.]", stem))
        )

    chosen = [p for p in files if in_split(p)]
    return chosen or files


def _open_saved(path: Path, split: str) -> tuple[Any, str]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError(
            f"{path}: looks like a datasets.save_to_disk directory but could not be loaded "
            f"({type(exc).__name__}: {exc}). Fix: re-save it with Dataset.save_to_disk."
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"{path}: split {split!r} not found; the DatasetDict has splits "
                f"{sorted(loaded)}. Fix: pass split=<one of {sorted(loaded)}>."
            )
        return loaded[split], f"{path} [{split}]"
    return loaded, str(path)


def _open_by_name(name: str, split: str, what: str) -> tuple[Any, str]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as exc:
        raise DataError(
            f"{name}: {what}, and could not be loaded as a datasets name "
            f"({type(exc).__name__}: {exc}). This machine may be offline: datasets names only "
            "work when already in the local cache. Fix: pass the path of a .parquet / .jsonl "
            "/ .json file or a save_to_disk directory, or check the name and split."
        ) from exc
    if not isinstance(ds, datasets.Dataset):
        raise DataError(
            f"{name}: load_dataset returned a {type(ds).__name__}, not a Dataset. "
            "Fix: pass a split or a file path."
        )
    return ds, f"{name} [{split}]"


def _looks_like_path(source: str) -> bool:
    if source.startswith(("/", "./", "../", "~", ".\\", "..\\")):
        return True
    if source.lower().endswith(_FILE_SUFFIXES) or source.count("/") > 1:
        return True
    if os.sep != "/" and os.sep in source:
        return True
    return not _HUB_ID.match(source)


def _open_source(source: str, split: str) -> tuple[str, _Located]:
    """Resolve ``source`` eagerly (so 'not found' errors come at once); iterate rows lazily."""
    path = Path(os.path.expanduser(source))
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            return str(path), _iter_parquet([path])
        if suffix in (".jsonl", ".ndjson"):
            return str(path), _iter_jsonl(path)
        if suffix == ".json":
            return str(path), _iter_json(path, split)
        raise DataError(
            f"{path}: unsupported file type {suffix!r}. Fix: convert it to .parquet, .jsonl or "
            ".json, or save it with datasets' save_to_disk and pass the directory."
        )
    if path.is_dir():
        if _is_saved_dataset(path):
            ds, where = _open_saved(path, split)
            return where, _iter_hf_dataset(ds, where)
        files = _parquet_files(path, split)
        if files:
            return str(path), _iter_parquet(files)
        ds, where = _open_by_name(
            str(path), split, "directory has no parquet files and no save_to_disk metadata"
        )
        return where, _iter_hf_dataset(ds, where)
    if _looks_like_path(source):
        raise DataError(
            f"{source}: file not found (resolved to {path.absolute()}). Fix: check the path; "
            f"relative paths are resolved from the working directory {os.getcwd()}."
        )
    ds, where = _open_by_name(source, split, "not found as a file or directory")
    return where, _iter_hf_dataset(ds, where)


# --------------------------------------------------------------------------- public API


def _build(
    located: Iterable[tuple[str, int, Mapping[str, Any]]],
    *,
    source: str,
    prompt_key: str,
    answer_key: str,
    data_source_key: str,
    default_data_source: str,
    dedupe: bool,
    max_rows: int | None,
) -> tuple[list[PromptRecord], LoadStats]:
    if max_rows is not None and max_rows < 0:
        raise DataError(f"max_rows must be >= 0 or None, got {max_rows}")
    stats = LoadStats()
    records: list[PromptRecord] = []
    uids: dict[Any, str] = {}  # dedupe key -> uid
    for where, index, row in located:
        if max_rows is not None and stats.rows >= max_rows:
            break
        stats.rows += 1
        raw_prompt = _get_field(row, prompt_key)
        if raw_prompt is _MISSING:
            raise _missing_field_error(where, index, row, prompt_key, "prompt_key")
        prompt = _normalize_prompt(raw_prompt, where, index, prompt_key)
        raw_answer = _get_field(row, answer_key)
        if raw_answer is _MISSING:
            raise _missing_field_error(where, index, row, answer_key, "answer_key")
        answer = _normalize_answer(raw_answer, where, index, answer_key)

        key = _dedupe_key(prompt)
        uid = uids.get(key)
        if uid is None:
            uid = uids[key] = _uid(_canonical(prompt), where, index, prompt_key)
        elif dedupe:
            stats.duplicates += 1
            continue

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
                    where, index, data_source_key, "data source is too large to be a name",
                    "store the data source as a short string",
                ) from None
        extra = {
            k: v
            for k, v in row.items()
            if k not in (prompt_key, data_source_key) and not str(k).startswith("__index_level_")
        }
        records.append(PromptRecord(prompt, answer, data_source, uid, extra))

    if stats.rows == 0:
        limit = f" (max_rows={max_rows})" if max_rows is not None else ""
        raise DataError(
            f"{source}: the dataset is empty: 0 rows read{limit}. Fix: point at a file or "
            "split that has rows."
        )
    stats.kept = len(records)
    return records, stats


def records_from_rows(
    rows: Iterable[Mapping[str, Any]],
    *,
    source: str = "<rows>",
    prompt_key: str = "prompt",
    answer_key: str = "reward_model.ground_truth",
    data_source_key: str = "data_source",
    default_data_source: str = "math_dapo",
    dedupe: bool = True,
    max_rows: int | None = None,
) -> tuple[list[PromptRecord], LoadStats]:
    """Validate in-memory rows (dicts; numpy arrays allowed) into records, like ``load_records``."""
    return _build(
        ((source, i, row) for i, row in enumerate(rows)),
        source=source,
        prompt_key=prompt_key,
        answer_key=answer_key,
        data_source_key=data_source_key,
        default_data_source=default_data_source,
        dedupe=dedupe,
        max_rows=max_rows,
    )


def load_records(
    source: str,
    *,
    split: str = "train",
    prompt_key: str = "prompt",
    answer_key: str = "reward_model.ground_truth",
    data_source_key: str = "data_source",
    default_data_source: str = "math_dapo",
    dedupe: bool = True,
    max_rows: int | None = None,
) -> tuple[list[PromptRecord], LoadStats]:
    """Load and validate prompt records from a file, directory or cached datasets name.

    Keys are dotted paths into nested fields. With ``dedupe`` the first occurrence of each
    prompt is kept; otherwise all rows are kept and repeats share a ``uid``.
    """
    where, located = _open_source(str(source), split)
    return _build(
        located,
        source=where,
        prompt_key=prompt_key,
        answer_key=answer_key,
        data_source_key=data_source_key,
        default_data_source=default_data_source,
        dedupe=dedupe,
        max_rows=max_rows,
    )


def render_prompt(record: PromptRecord, tokenizer: Any) -> str:
    """Prompt text: chat messages through the tokenizer's chat template (if it has one)."""
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
    return "\n".join(m["content"] for m in prompt)


def encode_prompts(
    records: list[PromptRecord],
    tokenizer: Any,
    max_prompt_length: int,
    *,
    stats: LoadStats | None = None,
) -> tuple[list[PromptRecord], list[list[int]], int]:
    """Render and tokenize prompts; drop (never truncate) those over ``max_prompt_length``.

    Returns the kept records, their token ids and the number dropped. If ``stats`` is
    given, its ``too_long`` and ``kept`` are updated.
    """
    if max_prompt_length <= 0:
        raise DataError(
            f"data.max_prompt_length must be positive, got {max_prompt_length}. "
            "Fix: set data.max_prompt_length to the prompt token budget."
        )
    texts = [render_prompt(r, tokenizer) for r in records]
    all_ids: list[list[int]] = []
    for start in range(0, len(texts), _TOKENIZE_BATCH):
        enc = tokenizer(texts[start : start + _TOKENIZE_BATCH], add_special_tokens=False)
        all_ids.extend(list(ids) for ids in enc["input_ids"])

    kept: list[PromptRecord] = []
    kept_ids: list[list[int]] = []
    for record, ids in zip(records, all_ids, strict=True):
        if len(ids) <= max_prompt_length:
            kept.append(record)
            kept_ids.append(ids)
    dropped = len(records) - len(kept)
    if records and not kept:
        lengths = [len(ids) for ids in all_ids]
        raise DataError(
            f"all {len(records)} prompts are longer than data.max_prompt_length="
            f"{max_prompt_length} tokens (shortest {min(lengths)}, longest {max(lengths)}). "
            f"Fix: raise data.max_prompt_length to at least {min(lengths)} "
            f"({max(lengths)} keeps every prompt), or check the tokenizer/chat template."
        )
    if stats is not None:
        stats.too_long = dropped
        stats.kept = len(kept)
    return kept, kept_ids, dropped


def group_repeats(records: list[PromptRecord]) -> dict[str, list[int]]:
    """Map each uid to the indices of its records, in first-appearance order."""
    groups: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        groups.setdefault(record.uid, []).append(i)
    return groups
