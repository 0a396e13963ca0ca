"""Prompt data: records, readers for files and ``datasets``, prompt rendering, built-in tasks.

- ``records``: :class:`PromptRecord` and the validation of rows of the DAPO reference format.
- ``sources``: parquet, JSON / JSON lines, saved ``datasets`` and cached dataset names, and
  in-memory data (``datasets.Dataset``, pandas ``DataFrame``, lists of row dicts).
- ``prompts``: rendering through the chat template, tokenizing, the length filter, and the
  seeded stream of training prompts.
- ``tasks``: the built-in tasks (``builtin:addition``).
"""

from dapo.data.prompts import (
    PromptStream,
    encode_prompts,
    group_repeats,
    load_prompt_set,
    render_prompt,
)
from dapo.data.records import DataError, LoadStats, PromptRecord, records_from_rows
from dapo.data.sources import PromptSource, load_records

__all__ = [
    "DataError",
    "LoadStats",
    "PromptRecord",
    "PromptSource",
    "PromptStream",
    "encode_prompts",
    "group_repeats",
    "load_prompt_set",
    "load_records",
    "records_from_rows",
    "render_prompt",
]
