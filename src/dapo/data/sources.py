"""Readers: parquet, JSON / JSON lines, ``datasets.save_to_disk`` directories, a directory of
parquet files, a locally cached ``datasets`` name, or in-memory data (a ``datasets.Dataset``,
a pandas ``DataFrame``, a list of row dicts), into validated prompt records. Every source
becomes the same stream of ``(where, row index, row)`` that :func:`build_records` validates.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, Unpack

from dapo.data.records import (
    LoadStats,
    PromptRecord,
    RecordOptions,
    build_records,
    located_rows,
)
from dapo.errors import DataError

if TYPE_CHECKING:
    import datasets
    import pandas

# What data.train / data.eval take (a path, a datasets name, builtin:<task>), or in memory.
PromptSource: TypeAlias = (
    "str | os.PathLike[str] | datasets.Dataset | datasets.DatasetDict | pandas.DataFrame "
    "| Iterable[Mapping[str, Any]]"
)

_BATCH_ROWS = 8192
_FILE_SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".json", ".arrow", ".csv", ".tsv", ".txt")
# "name" or "owner/name": what a datasets hub id looks like.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


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


def _iter_json(path: Path, split: str, setting: str) -> _Located:
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
                f"{setting}={split!r}. Fix: pass {setting}=<one of {sorted(lists)}>."
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


def _pick_split(splits: Any, split: str, setting: str, where: str) -> tuple[Any, str]:
    """The ``split`` of a ``DatasetDict`` (``setting`` names where the split was chosen)."""
    if split not in splits:
        raise DataError(
            f"{where}: split {split!r} not found; the DatasetDict has splits "
            f"{sorted(splits)}. Fix: pass {setting}=<one of {sorted(splits)}>."
        )
    return splits[split], f"{where} [{split}]"


def _open_saved(path: Path, split: str, setting: str) -> tuple[Any, str]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError(
            f"{path}: looks like a datasets.save_to_disk directory but could not be loaded "
            f"({type(exc).__name__}: {exc}). Fix: re-save it with Dataset.save_to_disk."
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        return _pick_split(loaded, split, setting, str(path))
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


def _open_source(source: str, split: str, setting: str) -> tuple[str, _Located]:
    """Resolve ``source`` eagerly (so 'not found' errors come at once); iterate rows lazily."""
    path = Path(os.path.expanduser(source))
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            return str(path), _iter_parquet([path])
        if suffix in (".jsonl", ".ndjson"):
            return str(path), _iter_jsonl(path)
        if suffix == ".json":
            return str(path), _iter_json(path, split, setting)
        raise DataError(
            f"{path}: unsupported file type {suffix!r}. Fix: convert it to .parquet, .jsonl or "
            ".json, or save it with datasets' save_to_disk and pass the directory."
        )
    if path.is_dir():
        if _is_saved_dataset(path):
            ds, where = _open_saved(path, split, setting)
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


_ACCEPTED = (
    "a path (.parquet, .jsonl, .json, a directory), a cached datasets name, a "
    "datasets.Dataset or DatasetDict, a pandas DataFrame, or a list of row dicts"
)


def _open_object(data: Any, split: str, setting: str, name: str | None) -> tuple[str, _Located]:
    """In-memory data: a datasets.Dataset (or a split of a DatasetDict), a pandas
    DataFrame, or any iterable of row mappings."""
    where = name or f"<{type(data).__name__}>"
    ds = sys.modules.get("datasets")  # not imported: ``data`` cannot be one of its objects
    if ds is not None and isinstance(data, ds.DatasetDict | ds.IterableDatasetDict):
        data, where = _pick_split(data, split, setting, where)
    if ds is not None and isinstance(data, ds.Dataset):
        return where, _iter_hf_dataset(data, where)
    if type(data).__module__.startswith("pandas") and hasattr(data, "to_dict"):
        data = data.to_dict(orient="records")
    if isinstance(data, Mapping | str | bytes) or not isinstance(data, Iterable):
        what = "a single mapping, not rows" if isinstance(data, Mapping) else "not rows"
        raise DataError(
            f"{where}: got type {type(data).__name__!r}, {what}. Fix: pass {_ACCEPTED} "
            "(a dict of columns: datasets.Dataset.from_dict(...))."
        )
    return where, located_rows(data, where)


def load_records(
    source: PromptSource,
    *,
    split: str = "train",
    split_setting: str = "split",
    name: str | None = None,
    **options: Unpack[RecordOptions],
) -> tuple[list[PromptRecord], LoadStats]:
    """Load and validate prompt records from a file, directory, cached datasets name or
    in-memory data (:data:`PromptSource`). Errors name in-memory data ``name`` and the
    choice of split ``split_setting`` (e.g. data.train_split).

    Keys are dotted paths into nested fields (:class:`~dapo.data.records.RecordOptions`).
    With ``dedupe`` (default) the first occurrence of each prompt is kept; otherwise all
    rows are kept and repeats share a ``uid``.
    """
    if isinstance(source, str | os.PathLike):
        where, located = _open_source(os.fspath(source), split, split_setting)
    else:
        where, located = _open_object(source, split, split_setting, name)
    return build_records(located, source=where, **options)
