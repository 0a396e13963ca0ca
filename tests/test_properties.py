"""Property-based tests: the config and data loaders either succeed or raise their own error.

Whatever document, override list or data row they are given, ``load_config`` returns a
valid :class:`Config` or raises :class:`ConfigError`, and ``records_from_rows`` /
``load_records`` return well-formed records or raise :class:`DataError`: never a
``TypeError``, ``KeyError``, ``UnicodeDecodeError`` ... from deep inside.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dapo.config import Config, ConfigError, all_keys, config_from_dict, load_config
from dapo.data import DataError, PromptRecord, load_records, records_from_rows

SETTINGS = settings(
    max_examples=150,
    deadline=None,  # 2 shared cores: timing varies a lot
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FILE_SETTINGS = settings(SETTINGS, max_examples=80)

KEYS = all_keys()
LEAVES = sorted({k.rsplit(".", 1)[-1] for k in KEYS})

# --- values -----------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**500), max_value=10**500),  # beyond float range
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        ["hf", "vllm", "dapo", "grpo", "token-mean", "cosine", "true", "1e-6", "nan", "", "k3"]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(LEAVES)), inner, max_size=4),
    ),
    max_leaves=10,
)


def key_paths() -> st.SearchStrategy[str]:
    """Real keys, real keys mangled, and arbitrary dotted text."""
    mangled = st.builds(
        lambda k, i, c: k[:i] + c + k[i + 1 :],
        st.sampled_from(KEYS),
        st.integers(0, 30),
        st.sampled_from(["", ".", "_", "x", " ", "..", "="]),
    )
    return st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS), mangled, st.text(max_size=15))


def nested(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A YAML mapping from dotted keys (later keys win, a section may replace a value)."""
    out: dict[str, Any] = {}
    for path, value in pairs:
        node = out
        parts = path.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return out


def check_config(load: Any) -> Config | None:
    try:
        cfg = load()
    except ConfigError as exc:
        assert str(exc)
        return None
    assert isinstance(cfg, Config)
    # A valid config survives its own YAML (what a run writes to config.yaml).
    again = config_from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again.to_dict() == cfg.to_dict()
    return cfg


# --- configuration ------------------------------------------------------------------------


@SETTINGS
@given(pairs=st.lists(st.tuples(key_paths(), values), max_size=6))
def test_random_yaml_mappings_load_or_raise_config_error(pairs, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(nested(pairs), allow_unicode=True))
    check_config(lambda: load_config(path))


@SETTINGS
@given(
    text=st.one_of(
        st.text(max_size=200),
        st.lists(
            st.sampled_from(
                [
                    "train:",
                    "  lr: ",
                    "steps",
                    ": ",
                    "- ",
                    "[",
                    "{",
                    "}",
                    "]",
                    "&a ",
                    "*a",
                    "!!python/object ",
                    "\n",
                    "  ",
                    "1e400",
                    "'",
                ]
            ),
            max_size=30,
        ).map("".join),
    )
)
def test_random_yaml_text_loads_or_raises_config_error(text, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    check_config(lambda: load_config(path))


@SETTINGS
@given(data=st.binary(max_size=200))
def test_random_bytes_as_config_file_raise_config_error(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_bytes(data)
    check_config(lambda: load_config(path))


override_values = st.one_of(
    st.text(max_size=20),
    values.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...")),
)


@SETTINGS
@given(
    items=st.lists(
        st.one_of(
            st.tuples(key_paths(), override_values).map(lambda kv: f"{kv[0]}={kv[1]}"),
            st.text(max_size=25),
        ),
        max_size=6,
    )
)
def test_random_override_lists_load_or_raise_config_error(items):
    check_config(lambda: load_config(overrides=items))


@SETTINGS
@given(pairs=st.dictionaries(key_paths(), values, max_size=5))
def test_random_override_dicts_load_or_raise_config_error(pairs):
    check_config(lambda: load_config(overrides=pairs))


@SETTINGS
@given(pairs=st.lists(st.tuples(st.sampled_from(KEYS), values), min_size=1, max_size=4))
def test_valid_keys_with_random_values_never_crash_validation(pairs):
    """Type-correct values of every kind reach validate(): it must cope with all of them."""
    items = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in pairs]
    items = [i.removesuffix("\n...").removesuffix("...") for i in items]
    check_config(lambda: load_config(overrides=items))


# --- data rows ----------------------------------------------------------------------------

texts = st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "What is 1+1?", "2", "\n"]))
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": texts}),
        st.dictionaries(st.sampled_from(["role", "content", "name"]), values, max_size=3),
        values,
    ),
    max_size=3,
)
prompts = st.one_of(
    texts,
    messages,
    st.fixed_dictionaries(
        {"role": st.lists(texts, max_size=2), "content": st.lists(values, max_size=2)}
    ),
    values,
)
answers = st.one_of(
    texts,
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    values,
)
rows = st.builds(
    lambda prompt, reward_model, source, extra, drop: {
        k: v
        for k, v in {
            "prompt": prompt,
            "reward_model": reward_model,
            "data_source": source,
            **extra,
        }.items()
        if k not in drop
    },
    prompts,
    st.one_of(st.fixed_dictionaries({"ground_truth": answers}), values),
    st.one_of(texts, values),
    st.dictionaries(st.text(max_size=6), values, max_size=2),
    st.sets(st.sampled_from(["prompt", "reward_model", "data_source"]), max_size=1),
)
keys = st.sampled_from(
    ["prompt", "reward_model.ground_truth", "data_source", "reward_model", "a.b"]
)


def check_records(
    load: Any, n_rows: int | None = None, dedupe: bool = True
) -> list[PromptRecord] | None:
    try:
        records, stats = load()
    except DataError as exc:
        assert str(exc)
        return None
    assert stats.kept == len(records) >= 1 and stats.rows >= stats.kept
    if n_rows is not None:
        assert stats.rows == n_rows
    assert stats.rows == stats.kept + stats.duplicates
    for r in records:
        if isinstance(r.prompt, str):
            assert r.prompt.strip()
        else:
            assert r.prompt and all(
                set(m) == {"role", "content"} and all(isinstance(x, str) for x in m.values())
                for m in r.prompt
            )
            assert any(m["content"].strip() for m in r.prompt)
        assert isinstance(r.ground_truth, str) and r.ground_truth.strip() == r.ground_truth
        assert r.ground_truth
        assert isinstance(r.data_source, str) and r.data_source
        assert re.fullmatch(r"[0-9a-f]{16}", r.uid)
    if dedupe:
        assert len({r.uid for r in records}) == len(records)
    return records


@SETTINGS
@given(data=st.lists(rows, max_size=5), prompt_key=keys, answer_key=keys)
def test_random_rows_give_records_or_data_error(data, prompt_key, answer_key):
    check_records(
        lambda: records_from_rows(data, prompt_key=prompt_key, answer_key=answer_key),
        n_rows=len(data),
    )


@SETTINGS
@given(data=st.lists(rows, max_size=5), max_rows=st.one_of(st.none(), st.integers(-2, 6)))
def test_random_rows_with_max_rows(data, max_rows):
    check_records(lambda: records_from_rows(data, max_rows=max_rows, dedupe=False), dedupe=False)


def _json_line(row: Any) -> str:
    return json.dumps(row, allow_nan=True, default=str)


lines = st.one_of(
    rows.map(_json_line),
    rows.map(_json_line),
    st.text(max_size=40),
    st.sampled_from(
        [
            "[1, 2]",
            "null",
            "{}",
            '{"prompt": "\\ud800x", "reward_model": {"ground_truth": 1}}',
            "{" * 3000,
            "1" * 5000,
            '{"prompt": "q", "reward_model": {"ground_truth": NaN}}',
        ]
    ),
)


@FILE_SETTINGS
@given(content=st.lists(lines, max_size=5), suffix=st.sampled_from([".jsonl", ".json"]))
def test_random_jsonl_files_give_records_or_data_error(content, suffix):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"data{suffix}"
        path.write_text("\n".join(content), encoding="utf-8", errors="surrogatepass")
        check_records(lambda: load_records(str(path)))


@FILE_SETTINGS
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".jsonl", ".json", ".parquet"]))
def test_random_bytes_files_give_records_or_data_error(data, suffix):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"data{suffix}"
        path.write_bytes(data)
        check_records(lambda: load_records(str(path)))


@FILE_SETTINGS
@given(data=st.lists(rows, max_size=5), json_top=st.booleans())
def test_random_json_documents_give_records_or_data_error(data, json_top):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "data.json"
        doc: Any = data if json_top else {"train": data, "test": []}
        path.write_text(json.dumps(doc, allow_nan=True, default=str))
        check_records(lambda: load_records(str(path)))


# Parquet columns have one type: draw a type per column, then rows of that type.
parquet_prompt = st.one_of(
    st.lists(st.one_of(st.none(), texts), min_size=1, max_size=4),
    st.lists(
        st.one_of(
            st.none(),
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.one_of(st.none(), texts), "content": st.one_of(st.none(), texts)}
                ),
                max_size=3,
            ),
        ),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.one_of(st.none(), st.integers(-5, 5)), min_size=1, max_size=4),
)
parquet_answer = st.one_of(
    st.lists(st.one_of(st.none(), texts), min_size=1, max_size=4),
    st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), min_size=1, max_size=4),
    st.lists(
        st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)), min_size=1, max_size=4
    ),
    st.lists(st.one_of(st.none(), st.booleans()), min_size=1, max_size=4),
)


@FILE_SETTINGS
@given(prompt_col=parquet_prompt, answer_col=parquet_answer, nested_answer=st.booleans())
def test_random_parquet_files_give_records_or_data_error(prompt_col, answer_col, nested_answer):
    n = min(len(prompt_col), len(answer_col))
    table_rows = [
        {
            "prompt": p,
            "reward_model": {"ground_truth": a} if nested_answer else a,
            "data_source": "src",
        }
        for p, a in zip(prompt_col[:n], answer_col[:n], strict=True)
    ]
    try:
        table = pa.Table.from_pylist(table_rows)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        assume(False)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "data.parquet"
        pq.write_table(table, path)
        check_records(lambda: load_records(str(path)), n_rows=n)


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), -float("inf"), True, None, [], {}, 10**5000, "  "],
    ids=["nan", "inf", "-inf", "bool", "none", "list", "dict", "huge-int", "blank"],
)
def test_bad_answers_are_data_errors_naming_row_and_field(value):
    rows_ = [
        {"prompt": "q0", "reward_model": {"ground_truth": "1"}},
        {"prompt": "q1", "reward_model": {"ground_truth": value}},
    ]
    with pytest.raises(DataError) as info:
        records_from_rows(rows_, source="mem")
    msg = str(info.value)
    assert "mem: row 1" in msg and "reward_model.ground_truth" in msg and "Fix:" in msg


def test_finite_float_answers_keep_their_value():
    (rec,), _ = records_from_rows([{"prompt": "q", "reward_model": {"ground_truth": 2.5}}])
    assert math.isclose(float(rec.ground_truth), 2.5)
