"""Tests for dapo.data: loading, validation, dedupe, rendering and tokenization."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from dapo.config import DataConfig
from dapo.data import (
    DataError,
    LoadStats,
    PromptRecord,
    encode_prompts,
    group_repeats,
    load_prompt_set,
    load_records,
    records_from_rows,
    render_prompt,
)
from dapo.data.prompts import dropped_lines

AIME = Path(__file__).resolve().parents[2] / "shared" / "data" / "aime-2024.parquet"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# ----------------------------------------------------------------------------- helpers


def ref_row(problem: str, answer: Any = "540", source: str = "math_dapo", index: int = 0) -> dict:
    """One row in the DAPO reference format."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"Solve: {problem}"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index, "raw_problem": problem},
    }


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def char_tokenizer(chat_template: str | None = None, bos: bool = False) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one id per character (ids 0..), optional [BOS] post-processor."""
    chars = list(string.printable)
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["[UNK]"] = len(vocab)
    vocab["[BOS]"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="[BOS] $A", special_tokens=[("[BOS]", vocab["[BOS]"])]
        )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]")
    if chat_template is not None:
        hf.chat_template = chat_template
    return hf


def char_ids(text: str) -> list[int]:
    return [string.printable.index(c) for c in text]


# ----------------------------------------------------------------------------- parquet


def test_parquet_reference_format_dedupe_and_repeats(tmp_path):
    rows = [
        ref_row("p1", "540", index=0),
        ref_row("p2", "7", source="aime", index=1),
        ref_row("p1", "540", index=0),
        ref_row("p3", "12", index=2),
        ref_row("p1", "540", index=0),
    ]
    path = write_parquet(tmp_path / "train.parquet", rows)

    records, stats = load_records(str(path))
    assert stats == LoadStats(rows=5, duplicates=2, too_long=0, kept=3)
    assert [r.prompt for r in records] == [
        [{"role": "user", "content": "Solve: p1"}],
        [{"role": "user", "content": "Solve: p2"}],
        [{"role": "user", "content": "Solve: p3"}],
    ]
    assert [r.ground_truth for r in records] == ["540", "7", "12"]
    assert [r.data_source for r in records] == ["math_dapo", "aime", "math_dapo"]
    assert records[0].extra["reward_model"]["style"] == "rule-lighteval/MATH_v2"
    assert records[0].extra["extra_info"] == {"index": 0, "raw_problem": "p1"}
    assert records[0].extra["ability"] == "MATH"
    assert "prompt" not in records[0].extra and "data_source" not in records[0].extra
    uids = [r.uid for r in records]
    assert len(set(uids)) == 3
    assert all(len(u) == 16 and int(u, 16) >= 0 for u in uids)

    all_records, all_stats = load_records(str(path), dedupe=False)
    assert all_stats == LoadStats(rows=5, duplicates=0, too_long=0, kept=5)
    assert [r.uid for r in all_records] == [uids[0], uids[1], uids[0], uids[2], uids[0]]
    assert group_repeats(all_records) == {uids[0]: [0, 2, 4], uids[1]: [1], uids[2]: [3]}


def test_numpy_arrays_from_pandas(tmp_path):
    """pandas gives numpy arrays of message dicts and numpy ints; both are normalized."""
    df = pd.DataFrame(
        {
            "prompt": [
                np.array(
                    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}]
                ),
                np.array([{"role": "user", "content": "b"}]),
                np.array([{"role": "user", "content": "a"}]),  # differs from row 0: no system
            ],
            "answer": np.array([42, 3, 5], dtype=np.int64),
        }
    )
    path = tmp_path / "pd.parquet"
    df.to_parquet(path)  # parquet written from numpy object arrays
    back = pd.read_parquet(path)
    rows = [{col: back[col].iloc[i] for col in back.columns} for i in range(len(back))]
    assert isinstance(rows[0]["prompt"], np.ndarray)  # the case under test
    assert isinstance(rows[0]["answer"], np.integer)

    records, stats = records_from_rows(rows, answer_key="answer")
    assert stats.kept == 3 and stats.duplicates == 0
    assert type(records[0].prompt) is list
    assert records[0].prompt == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
    ]
    assert all(type(m) is dict for m in records[0].prompt)
    assert [r.ground_truth for r in records] == ["42", "3", "5"]

    from_file, _ = load_records(str(path), answer_key="answer")
    assert [r.uid for r in from_file] == [r.uid for r in records]
    assert [r.prompt for r in from_file] == [r.prompt for r in records]


def test_parquet_directory_picks_split(tmp_path):
    root = tmp_path / "hub_layout"
    (root / "data").mkdir(parents=True)
    write_parquet(root / "data" / "train-00000-of-00002.parquet", [ref_row("t1"), ref_row("t2")])
    write_parquet(root / "data" / "train-00001-of-00002.parquet", [ref_row("t3")])
    write_parquet(root / "data" / "test-00000-of-00001.parquet", [ref_row("x1")])

    train, _ = load_records(str(root))
    assert [r.extra["extra_info"]["raw_problem"] for r in train] == ["t1", "t2", "t3"]
    test, _ = load_records(str(root), split="test")
    assert [r.extra["extra_info"]["raw_problem"] for r in test] == ["x1"]

    flat = tmp_path / "flat"
    flat.mkdir()
    write_parquet(flat / "part-0.parquet", [ref_row("a")])
    write_parquet(flat / "part-1.parquet", [ref_row("b")])
    both, stats = load_records(str(flat))
    assert stats.rows == 2
    assert [r.extra["extra_info"]["raw_problem"] for r in both] == ["a", "b"]


def test_max_rows(tmp_path):
    path = write_parquet(tmp_path / "m.parquet", [ref_row(f"p{i}") for i in range(5)])
    records, stats = load_records(str(path), max_rows=3)
    assert stats.rows == 3 and len(records) == 3


@pytest.mark.skipif(not AIME.exists(), reason="shared AIME 2024 file not present")
def test_real_aime_2024():
    records, stats = load_records(str(AIME), dedupe=False)
    assert stats.rows == 960 and len(records) == 960 and stats.duplicates == 0
    groups = group_repeats(records)
    assert len(groups) == 30
    assert all(len(ix) == 32 for ix in groups.values())
    # every repeat of a problem carries the same answer
    assert all(len({records[i].ground_truth for i in ix}) == 1 for ix in groups.values())

    unique, ustats = load_records(str(AIME))
    assert len(unique) == 30 and ustats.kept == 30 and ustats.duplicates == 930
    assert {r.uid for r in unique} == set(groups)
    assert all(r.data_source == "math_dapo" for r in unique)
    first = unique[0]
    assert first.ground_truth == "540"  # |z|=4 problem, AIME 2024 I #7
    assert isinstance(first.prompt, list) and first.prompt[0]["role"] == "user"
    assert "|z|=4" in first.prompt[0]["content"]


# ----------------------------------------------------------------------------- json / datasets


def test_jsonl_custom_keys_and_number_answers(tmp_path):
    path = tmp_path / "qa.jsonl"
    lines = [
        json.dumps({"question": "What is 6*7?", "answer": 42}),
        "",  # blank lines are skipped
        json.dumps({"question": "Half of one?", "answer": 0.5}),
        json.dumps({"question": "Three as float?", "answer": 3.0}),
        json.dumps({"question": "Padded?", "answer": " 12 "}),
        json.dumps({"question": "What is 6*7?", "answer": 42}),
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    records, stats = load_records(str(path), prompt_key="question", answer_key="answer")
    assert stats == LoadStats(rows=5, duplicates=1, too_long=0, kept=4)
    assert [r.prompt for r in records] == [
        "What is 6*7?",
        "Half of one?",
        "Three as float?",
        "Padded?",
    ]
    assert [r.ground_truth for r in records] == ["42", "0.5", "3", "12"]
    assert all(r.data_source == "math_dapo" for r in records)  # no data_source column

    other, _ = load_records(
        str(path), prompt_key="question", answer_key="answer", default_data_source="gsm8k"
    )
    assert {r.data_source for r in other} == {"gsm8k"}


def test_json_list_with_dotted_keys_and_uid_canonical(tmp_path):
    rows = [
        {"problem": {"text": "2+2?"}, "label": {"value": "4"}},
        {"problem": {"text": "3+3?"}, "label": {"value": 6}},
    ]
    path = tmp_path / "list.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    records, _ = load_records(str(path), prompt_key="problem.text", answer_key="label.value")
    assert [(r.prompt, r.ground_truth) for r in records] == [("2+2?", "4"), ("3+3?", "6")]

    # the same string prompt in another file, at another row, gets the same uid
    again = write_jsonl(
        tmp_path / "again.jsonl",
        [{"prompt": "other", "answer": "0"}, {"prompt": "2+2?", "answer": "4"}],
    )
    rec2, _ = load_records(str(again), answer_key="answer")
    assert rec2[1].uid == records[0].uid

    # chat messages: key order inside a message does not matter; role does
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"prompt": [{"role": "user", "content": "q"}], "a": "1"},
            {"prompt": [{"content": "q", "role": "user"}], "a": "1"},
            {"prompt": [{"role": "system", "content": "q"}], "a": "1"},
        ],
    )
    crec, cstats = load_records(str(chat), answer_key="a")
    assert cstats.duplicates == 1 and len(crec) == 2
    assert crec[0].uid != crec[1].uid


def test_save_to_disk_dataset_and_datasetdict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([ref_row("d1", "1"), ref_row("d2", "2"), ref_row("d1", "1")])
    ds.save_to_disk(str(tmp_path / "single"))
    records, stats = load_records(str(tmp_path / "single"))
    assert stats.rows == 3 and stats.duplicates == 1
    assert [r.ground_truth for r in records] == ["1", "2"]
    assert records[0].prompt == [{"role": "user", "content": "Solve: d1"}]

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([ref_row("tr", "5")]),
            "test": datasets.Dataset.from_list([ref_row("te1", "6"), ref_row("te2", "7")]),
        }
    )
    dd.save_to_disk(str(tmp_path / "dict"))
    test_records, _ = load_records(str(tmp_path / "dict"), split="test")
    assert [r.ground_truth for r in test_records] == ["6", "7"]
    train_records, _ = load_records(str(tmp_path / "dict"))
    assert [r.ground_truth for r in train_records] == ["5"]

    with pytest.raises(DataError) as err:
        load_records(str(tmp_path / "dict"), split="validation")
    msg = str(err.value)
    assert "'validation'" in msg and "'test'" in msg and "'train'" in msg


# ----------------------------------------------------------------------------- errors


def _load_error(path: Path, **kwargs: Any) -> str:
    with pytest.raises(DataError) as err:
        load_records(str(path), **kwargs)
    return str(err.value)


def test_missing_prompt_field_lists_keys_and_suggests(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompts": "q", "answer": "1"}])
    msg = _load_error(path, answer_key="answer")
    assert str(path) in msg
    assert "row 0" in msg and "'prompt'" in msg and "missing" in msg
    assert "['answer', 'prompts']" in msg  # available top-level keys
    assert "Did you mean 'prompts'?" in msg
    assert "prompt_key" in msg and "Fix:" in msg


def test_missing_nested_answer_at_later_row(tmp_path):
    rows = [ref_row("a"), ref_row("b"), ref_row("c")]
    del rows[2]["reward_model"]["ground_truth"]
    path = write_jsonl(tmp_path / "nested.jsonl", rows)
    msg = _load_error(path)
    assert "row 2" in msg and "'reward_model.ground_truth'" in msg and "missing" in msg
    assert "answer_key" in msg and str(path) in msg

    rows = [ref_row("a"), ref_row("b")]
    rows[1]["reward_model"] = None
    msg = _load_error(write_jsonl(tmp_path / "null_parent.jsonl", rows))
    assert "row 1" in msg and "'reward_model' is None" in msg


@pytest.mark.parametrize(
    ("bad_row", "expected"),
    [
        ({"prompt": 17, "answer": "1"}, ["'prompt'", "neither a string nor a list", "17"]),
        ({"prompt": None, "answer": "1"}, ["'prompt'", "None", "neither a string nor a list"]),
        ({"prompt": {"text": "q"}, "answer": "1"}, ["'prompt'", "neither a string nor a list"]),
        (
            {"prompt": [{"content": "q"}], "answer": "1"},
            ["'prompt'", "message 0 has no 'role'"],
        ),
        (
            {"prompt": [{"role": "system", "content": "s"}, {"role": "user"}], "answer": "1"},
            ["'prompt'", "message 1 has no 'content'"],
        ),
        ({"prompt": ["q"], "answer": "1"}, ["'prompt'", "message 0 is a str", "not a dict"]),
        ({"prompt": "   ", "answer": "1"}, ["'prompt'", "empty prompt"]),
        ({"prompt": [], "answer": "1"}, ["'prompt'", "empty prompt"]),
        (
            {"prompt": [{"role": "user", "content": ""}], "answer": "1"},
            ["'prompt'", "empty prompt"],
        ),
        ({"prompt": "q", "answer": None}, ["'answer'", "ground truth is None"]),
        ({"prompt": "q", "answer": "  "}, ["'answer'", "ground truth is empty"]),
        ({"prompt": "q", "answer": ["1", "2"]}, ["'answer'", "not a string or number"]),
        ({"prompt": "q", "answer": True}, ["'answer'", "bool"]),
        ({"prompt": "q"}, ["'answer'", "missing", "['prompt']"]),
    ],
)
def test_malformed_row_messages(tmp_path, bad_row, expected):
    good = {"prompt": "fine", "answer": "1"}
    path = write_jsonl(tmp_path / "rows.jsonl", [good, {"prompt": "ok", "answer": 2}, bad_row])
    msg = _load_error(path, answer_key="answer")
    assert str(path) in msg and "row 2" in msg and "Fix:" in msg
    for part in expected:
        assert part in msg, (part, msg)


def test_parquet_null_ground_truth(tmp_path):
    rows = [ref_row("a"), ref_row("b", answer=None)]
    path = write_parquet(tmp_path / "null.parquet", rows)
    msg = _load_error(path)
    assert "row 1" in msg and "'reward_model.ground_truth'" in msg and "None" in msg


def test_invalid_jsonl_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": oops}\n', encoding="utf-8")
    msg = _load_error(path, answer_key="answer")
    assert "row 1 (line 2)" in msg and "invalid JSON" in msg


def test_missing_file_and_unknown_source(tmp_path, monkeypatch):
    missing = tmp_path / "nope.parquet"
    msg = _load_error(missing)
    assert "file not found" in msg and str(missing) in msg

    monkeypatch.chdir(tmp_path)
    for rel in ("data/missing.jsonl", "train.parquet", "some/nested/dir"):
        msg = _load_error(Path(rel))
        assert "file not found" in msg and rel in msg

    # a hub-style name that is not cached: never touch the network in tests
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as err:
        load_records("someone/not-a-cached-dataset")
    msg = str(err.value)
    assert "someone/not-a-cached-dataset" in msg
    assert "not found as a file" in msg and "could not be loaded as a datasets name" in msg
    assert "offline" in msg


def test_unsupported_and_corrupt_files(tmp_path):
    csv = tmp_path / "x.csv"
    csv.write_text("prompt,answer\nq,1\n")
    assert "unsupported file type" in _load_error(csv)

    lfs = tmp_path / "lfs.parquet"
    lfs.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 10\n")
    msg = _load_error(lfs)
    assert str(lfs) in msg and "Git LFS" in msg


def test_empty_dataset(tmp_path):
    schema = pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())})
    empty_pq = tmp_path / "empty.parquet"
    pq.write_table(schema, empty_pq)
    msg = _load_error(empty_pq, answer_key="answer")
    assert "empty" in msg and "0 rows" in msg and str(empty_pq) in msg

    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("\n")
    assert "empty" in _load_error(empty_jsonl)

    with pytest.raises(DataError, match="empty"):
        records_from_rows([])


# ----------------------------------------------------------------------------- render / encode


def test_render_prompt_with_and_without_chat_template():
    chat = PromptRecord(
        prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        ground_truth="4",
    )
    plain = PromptRecord(prompt="2+2?", ground_truth="4")

    templated = char_tokenizer(CHAT_TEMPLATE)
    assert render_prompt(chat, templated) == "<|system|>Be brief.\n<|user|>2+2?\n<|assistant|>"
    assert render_prompt(plain, templated) == "2+2?"  # plain text never templated

    bare = char_tokenizer()
    assert getattr(bare, "chat_template", None) is None
    assert render_prompt(chat, bare) == "system: Be brief.\nuser: 2+2?\nassistant:"  # roles kept
    assert render_prompt(plain, bare) == "2+2?"


def test_render_prompt_template_failure_is_data_error():
    tok = char_tokenizer("{{ raise_exception('only user messages') }}")
    rec = PromptRecord(prompt=[{"role": "user", "content": "q"}], ground_truth="1", uid="abc")
    with pytest.raises(DataError, match="uid=abc.*chat template"):
        render_prompt(rec, tok)


def test_encode_prompts_filters_long_prompts_without_special_tokens():
    tok = char_tokenizer(CHAT_TEMPLATE, bos=True)
    assert tok("ab")["input_ids"][0] == tok.convert_tokens_to_ids("[BOS]")  # default adds BOS
    texts = ["abc", "abcdefgh", "abcd", "abcdefghijk", "a"]
    records = [PromptRecord(t, "1", uid=str(i)) for i, t in enumerate(texts)]
    stats = LoadStats(rows=5, kept=5)

    kept, ids, dropped = encode_prompts(records, tok, max_prompt_length=4, stats=stats)
    assert dropped == 2
    assert [r.prompt for r in kept] == ["abc", "abcd", "a"]  # length 4 == limit is kept
    assert ids == [char_ids("abc"), char_ids("abcd"), char_ids("a")]  # no BOS added
    assert stats.too_long == 2 and stats.kept == 3

    chat = PromptRecord([{"role": "user", "content": "hi"}], "1")
    _, chat_ids, _ = encode_prompts([chat], tok, max_prompt_length=100)
    assert chat_ids == [char_ids("<|user|>hi\n<|assistant|>")]


def test_encode_prompts_all_too_long():
    tok = char_tokenizer()
    records = [PromptRecord("x" * n, "1") for n in (7, 12, 9)]
    with pytest.raises(DataError) as err:
        encode_prompts(records, tok, max_prompt_length=5)
    msg = str(err.value)
    assert "data.max_prompt_length=5" in msg
    assert "shortest 7" in msg and "longest 12" in msg
    assert "all 3 prompts" in msg


def test_the_start_up_lines_count_the_dropped_prompts_and_name_their_first_rows(tmp_path):
    # Rows 2, 4, 5 repeat rows 0 and 1 (row 5 repeats row 0 again); rows 3, 6, 8 are over 6.
    prompts = ["abc", "abcd", "abc", "x" * 9, "abcd", "abc", "y" * 7, "ok", "z" * 30]
    path = write_jsonl(tmp_path / "t.jsonl", [qa_row(p, i) for i, p in enumerate(prompts)])
    stats = LoadStats()
    records = load_prompt_set(QA_DATA, "train", str(path), stats=stats)
    kept, _, dropped = encode_prompts(records, char_tokenizer(), 6, stats=stats)
    assert [r.prompt for r in kept] == ["abc", "abcd", "ok"] and dropped == 3
    assert stats == LoadStats(rows=9, duplicates=3, too_long=3, kept=3)
    assert dropped_lines(stats, "training", 6) == [
        f"dropped 3 duplicate training prompts (the first row of each prompt is kept): "
        f"{path}: row 2 (repeats row 0), row 4 (repeats row 1), row 5 (repeats row 0)",
        f"dropped 3 training prompts longer than data.max_prompt_length=6 tokens: {path}: "
        "row 3 (9 tokens), row 6 (7 tokens), row 8 (30 tokens)",
    ]


def test_the_start_up_lines_name_the_first_five_rows_and_count_the_rest():
    rows = [qa_row("same", 1) for _ in range(8)] + [qa_row("q" * (10 + i), i) for i in range(7)]
    stats = LoadStats()
    records = load_prompt_set(QA_DATA, "train", rows, stats=stats)
    encode_prompts(records, char_tokenizer(), 6, stats=stats)
    duplicates, too_long = dropped_lines(stats, "held-out", 6)
    assert duplicates == (
        "dropped 7 duplicate held-out prompts (the first row of each prompt is kept): "
        "train_dataset: row 1 (repeats row 0), row 2 (repeats row 0), row 3 (repeats row 0), "
        "row 4 (repeats row 0), row 5 (repeats row 0) and 2 more"
    )
    assert too_long == (
        "dropped 7 held-out prompts longer than data.max_prompt_length=6 tokens: train_dataset: "
        "row 8 (10 tokens), row 9 (11 tokens), row 10 (12 tokens), row 11 (13 tokens), "
        "row 12 (14 tokens) and 2 more"
    )
    # Records of unknown origin (a built-in task's) are named by their position.
    bare = LoadStats()
    encode_prompts([PromptRecord(t, "1") for t in ("a", "b" * 9)], char_tokenizer(), 6, stats=bare)
    assert dropped_lines(bare, "training", 6) == [
        "dropped 1 training prompt longer than data.max_prompt_length=6 tokens: prompt 1 (9 tokens)"
    ]
    assert dropped_lines(LoadStats(rows=3, kept=3), "training", 6) == []


def test_the_trainer_says_at_start_up_which_rows_it_dropped(tmp_path):
    from dapo.config import load_config
    from dapo.producer.rollouts import Rollouts
    from dapo.run_inputs import RunInputs

    prompts = ["abc", "abcd", "abc", "x" * 9, "ok", "q" * 20]
    path = write_jsonl(tmp_path / "t.jsonl", [qa_row(p, str(i)) for i, p in enumerate(prompts)])
    cfg = load_config(
        overrides=[
            f"data.train={path}",
            "data.prompt_key=question",
            "data.answer_key=label.value",
            "data.max_prompt_length=6",
            f"output_dir={tmp_path / 'run'}",
            "evaluate=false",
        ]
    )
    lines: list[str] = []
    Rollouts(cfg, char_tokenizer(), RunInputs(), lines.append).close()
    assert lines[:2] == [
        f"dropped 1 duplicate training prompt (the first row of each prompt is kept): {path}: "
        "row 2 (repeats row 0)",
        f"dropped 2 training prompts longer than data.max_prompt_length=6 tokens: {path}: "
        "row 3 (9 tokens), row 5 (20 tokens)",
    ]


def test_group_repeats_order():
    recs = [PromptRecord("a", "1", uid=u) for u in ["x", "y", "x", "z", "y"]]
    assert group_repeats(recs) == {"x": [0, 2], "y": [1, 4], "z": [3]}
    assert list(group_repeats(recs)) == ["x", "y", "z"]


# ----------------------------------------------------------------------------- in-memory data


def qa_row(problem: str, answer: Any, source: str = "gsm8k") -> dict:
    """A row with custom column names and a nested answer (data.answer_key="label.value")."""
    return {"question": problem, "label": {"value": answer, "kind": "int"}, "src": source}


def qa_data(**more: Any) -> DataConfig:
    """The data settings that read :func:`qa_row` rows."""
    return DataConfig(
        prompt_key="question", answer_key="label.value", data_source_key="src", **more
    )


QA_DATA = qa_data()


def test_in_memory_data_gives_the_records_of_the_same_rows_in_a_file(tmp_path):
    import datasets

    rows = [
        qa_row("What is 6*7?", "42"),
        qa_row("Half of one?", " 0.5 ", source="math"),
        qa_row("What is 6*7?", "42"),  # a repeat: dropped
        qa_row("Three?", "3"),
    ]
    from_parquet = load_prompt_set(QA_DATA, "train", write_parquet(tmp_path / "t.parquet", rows))
    from_jsonl = load_prompt_set(QA_DATA, "train", str(write_jsonl(tmp_path / "t.jsonl", rows)))
    assert [(r.prompt, r.ground_truth, r.data_source) for r in from_parquet] == [
        ("What is 6*7?", "42", "gsm8k"),
        ("Half of one?", "0.5", "math"),
        ("Three?", "3", "gsm8k"),
    ]
    assert from_jsonl == from_parquet  # prompt, answer, source, uid and the other fields
    assert from_parquet[0].extra == {"label": {"value": "42", "kind": "int"}}
    for data in (
        datasets.Dataset.from_list(rows),
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}),
        rows,
        iter(rows),  # any iterable of rows, read once
        pd.DataFrame(rows),
    ):
        assert load_prompt_set(QA_DATA, "train", data) == from_parquet, type(data)

    # The held-out set: data.eval_split of a DatasetDict, data.max_eval_prompts first rows.
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows)}
    )
    data = qa_data(max_eval_prompts=2)
    assert load_prompt_set(data, "eval", splits) == from_parquet[:2]
    assert load_prompt_set(data, "eval", rows) == from_parquet[:2]


def test_in_memory_rows_are_deduplicated_and_length_filtered_like_a_file(tmp_path):
    import datasets

    rows = [qa_row("abc", 1), qa_row("abcdefgh", 2), qa_row("abc", 1), qa_row("a", 3)]
    file_records, file_stats = load_records(
        write_jsonl(tmp_path / "r.jsonl", rows), prompt_key="question", answer_key="label.value"
    )
    for data in (rows, datasets.Dataset.from_list(rows)):
        records, stats = load_records(data, prompt_key="question", answer_key="label.value")
        assert stats == file_stats == LoadStats(rows=4, duplicates=1, too_long=0, kept=3)
        assert records == file_records
        kept, ids, dropped = encode_prompts(records, char_tokenizer(), max_prompt_length=4)
        assert [r.prompt for r in kept] == ["abc", "a"] and dropped == 1
        assert ids == [char_ids("abc"), char_ids("a")]


def test_in_memory_missing_column_names_it_and_the_fix():
    import datasets

    rows = [{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}]
    for data in (rows, datasets.Dataset.from_list(rows)):
        with pytest.raises(DataError) as err:
            load_prompt_set(DataConfig(answer_key="answer"), "train", data)
        assert str(err.value) == (
            "train_dataset: row 0: field 'prompt': missing; the row's top-level keys are "
            "['answer', 'question']. Fix: pass data.prompt_key=<the right key> (dotted paths "
            "reach nested fields, e.g. 'reward_model.ground_truth')"
        )
        with pytest.raises(DataError) as err:
            load_prompt_set(DataConfig(prompt_key="question"), "eval", data)
        msg = str(err.value)
        assert msg.startswith("eval_dataset: row 0: field 'reward_model.ground_truth': missing")
        assert "Fix: pass data.answer_key=<the right key>" in msg


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([], "train_dataset: the dataset is empty: 0 rows read"),
        ([{"prompt": "q", "answer": "1"}, "q2"], "train_dataset: row 1: is a str ('q2'), not a"),
        ({"prompt": ["q"], "answer": ["1"]}, "train_dataset: got type 'dict', a single mapping"),
        (42, "train_dataset: got type 'int', not rows. Fix: pass a path"),
    ],
    ids=["empty", "not-a-row", "dict-of-columns", "not-data"],
)
def test_in_memory_data_that_is_not_rows(data, expected):
    with pytest.raises(DataError) as err:
        load_prompt_set(DataConfig(answer_key="answer"), "train", data)
    assert str(err.value).startswith(expected) and "Fix:" in str(err.value)


def test_in_memory_datasetdict_without_the_split():
    import datasets

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([ref_row("a")])})
    with pytest.raises(DataError) as err:
        load_prompt_set(DataConfig(), "eval", splits)
    assert str(err.value) == (
        "eval_dataset: split 'test' not found; the DatasetDict has splits ['train']. "
        "Fix: pass data.eval_split=<one of ['train']>."
    )


def test_encode_prompts_tokenizes_a_multi_turn_opening_as_the_renderer_does():
    """``text_of`` (a multi-turn opening with the tools' schemas) is tokenized in batches:
    the ids are the renderer's own, one prompt at a time, and the limit counts the tools."""
    from dapo.data.tasks import load_task
    from dapo.data.tasks.calculator import CHAT_TEMPLATE as TOOL_TEMPLATE
    from dapo.data.tasks.calculator import add
    from dapo.environments import ChatRenderer, prompt_messages
    from dapo.environments.tools import tool_schema
    from dapo.models.tiny import build_tokenizer

    tok = build_tokenizer(TOOL_TEMPLATE)
    renderer = ChatRenderer(tok, [tool_schema(add, "add")])
    records = load_task("builtin:calculator", "train", 40)
    text_of = lambda r: renderer.opening_text(prompt_messages(r))  # noqa: E731
    expected = [renderer.opening(prompt_messages(r)) for r in records]
    kept, ids, dropped = encode_prompts(records, tok, 10_000, text_of=text_of)
    assert dropped == 0 and ids == expected
    plain = encode_prompts(records, tok, 10_000)[1]
    assert all(len(a) > len(b) for a, b in zip(ids, plain, strict=True))  # the schemas count
    limit = sorted(len(x) for x in expected)[20]
    kept, ids, dropped = encode_prompts(records, tok, limit, text_of=text_of)
    assert ids == [x for x in expected if len(x) <= limit] and dropped == 40 - len(ids)


def test_a_prompt_set_is_tokenized_once_per_tokenizer_and_texts(monkeypatch):
    """The ids of a set already tokenized by the same tokenizer definition are reused (a
    second trainer on the same data); another tokenizer, or other texts, are tokenized."""
    import dapo.data.prompts as P

    monkeypatch.setattr(P, "_RECENT", type(P._RECENT)())
    calls: list[int] = []
    texts = ["abc", "ab", "a"]

    def counted(tok):
        original = type(tok).__call__

        class Counted(type(tok)):
            def __call__(self, batch, **kw):
                calls.append(len(batch))
                return original(self, batch, **kw)

        tok.__class__ = Counted
        return tok

    first = P.tokenize_texts(texts, char_tokenizer())
    assert first == [char_ids("abc"), char_ids("ab"), char_ids("a")]
    first[0].append(99)  # the caller's lists are its own
    assert P.tokenize_texts(texts, char_tokenizer()) == [char_ids(t) for t in texts]
    # A subclass that overrides __call__ is always asked (and not remembered).
    P.tokenize_texts(texts, counted(char_tokenizer()))
    P.tokenize_texts(texts, counted(char_tokenizer()))
    assert calls == [3, 3]
    # Another vocabulary, same texts: its own ids, not the remembered ones.
    from dapo.models.tiny import build_tokenizer

    other = build_tokenizer()
    theirs = [other(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert theirs != [char_ids(t) for t in texts] and P.tokenize_texts(texts, other) == theirs
    assert P.tokenize_texts(["abd"], char_tokenizer()) == [char_ids("abd")]
    assert len(P._RECENT) == 3


def test_repeated_prompt_texts_are_tokenized_once_each():
    """The tokenizer sees each distinct text once; every repeat gets the same ids, in its
    own list (as many lists as texts, in their order)."""
    import dapo.data.prompts as P

    seen: list[str] = []
    tok = char_tokenizer()
    original = type(tok).__call__

    class Counted(type(tok)):
        def __call__(self, batch, **kw):
            seen.extend(batch)
            return original(self, batch, **kw)

    tok.__class__ = Counted
    texts = ["12+3", "4+5", "12+3", "12+3", "7", "4+5"]
    ids = P.tokenize_texts(texts, tok)
    assert sorted(seen) == ["12+3", "4+5", "7"]
    assert ids == [char_ids(t) for t in texts]
    ids[0].append(99)
    assert ids[2] == char_ids("12+3") and ids[0] is not ids[3]


def test_chat_prompts_without_a_chat_template_are_said_once_at_start_up(tmp_path):
    """Training and held-out chat prompts on a tokenizer with no template: one line says they
    are joined with their roles; plain-text prompts or a templated tokenizer say nothing."""
    from dapo.data.prompts import no_template_line

    chat = [
        PromptRecord(prompt=[{"role": "user", "content": f"{i}+1?"}], ground_truth=str(i + 1))
        for i in range(3)
    ]
    plain = PromptRecord(prompt="2+2?", ground_truth="4")
    line = no_template_line([*chat, plain], char_tokenizer())
    assert line is not None and line.startswith("3 of 4 prompts are chat messages")
    assert "'role: content' lines" in line
    assert no_template_line([plain], char_tokenizer()) is None
    assert no_template_line(chat, char_tokenizer(CHAT_TEMPLATE)) is None

    from dapo.config import load_config
    from dapo.models.tiny import build_tokenizer
    from dapo.producer.rollouts import Rollouts
    from dapo.run_inputs import RunInputs

    rows = tmp_path / "chat.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"prompt": r.prompt, "reward_model": {"ground_truth": r.ground_truth}})
            + "\n"
            for r in chat
        )
    )
    cfg = load_config(
        overrides={"data.train": str(rows), "data.eval": str(rows), "output_dir": str(tmp_path)}
    )
    said: list[str] = []
    rollouts = Rollouts(cfg, build_tokenizer(), RunInputs(), said.append, None)
    rollouts.close()
    joined = [x for x in said if "chat messages" in x]
    assert len(joined) == 1 and joined[0].startswith("6 of 6 prompts"), said
