"""benchmarks/measure_task.py: how a column-addition response is read, and a smoke run."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch

from dapo.data.tasks.long_addition import worked_solution

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def measure_task(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the scripts import _report
    return importlib.import_module("measure_task")


def test_a_clean_solution_has_no_noise(measure_task):
    text, _ = worked_solution(4738, 975)
    b = measure_task.column_behaviour(text, 4738, 975)
    assert b == dict(columns=4, carry_due=3, dropped=0, slips=0, repeats=0, shortcut=0, malformed=0)


def test_dropped_carries_repeats_slips_and_shortcuts_are_told_apart(measure_task):
    # 47+38: the carry of 7+8 is dropped (4+3=7), the line repeated; then a wrong digit.
    text = "7+8=15, 5\n7+8=15, 5\n4+3=7, 75\nAnswer: 75"
    b = measure_task.column_behaviour(text, 47, 38)
    assert (b["columns"], b["carry_due"], b["dropped"], b["repeats"], b["slips"]) == (2, 1, 1, 1, 0)
    assert b["shortcut"] == 0
    slip = measure_task.column_behaviour("7+8=14, 4\n4+3+1=8, 84\nAnswer: 84", 47, 38)
    assert (slip["slips"], slip["dropped"]) == (1, 0)  # 7+8 is not 14; the carry is kept
    jump = measure_task.column_behaviour("7+8=15, 5\nAnswer: 85\n", 47, 38)
    assert jump["shortcut"] == 1 and jump["columns"] == 1
    assert measure_task.column_behaviour("7+8 is 15\nAnswer: 85", 47, 38)["malformed"] == 1


def test_entropy_is_measured_at_the_sampling_temperature(measure_task, random_tiny_model):
    from dapo.models import load_policy

    model = load_policy(str(random_tiny_model)).eval()
    prompt, responses = [5, 6, 7], [[8, 9], [10, 11, 12]]
    hot = measure_task.entropies(model, prompt, responses, pad=0, temperature=2.0)
    assert [len(e) for e in hot] == [2, 3]
    # Direct: the softmax at temperature 2 of the logits that predict each response token.
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + responses[1]])).logits[0] / 2.0
    p = logits.softmax(-1)
    want = -(p * p.log()).sum(-1)[2:5]
    assert hot[1] == pytest.approx(want.tolist(), rel=1e-4)


def test_smoke_run_reports_consistent_figures(measure_task, random_tiny_model, tmp_path, capsys):
    out = tmp_path / "task.json"
    r = measure_task.main(
        [
            "--model",
            str(random_tiny_model),
            "--problems",
            "6",
            "--generations",
            "2",
            "--max-length",
            "12",
            "--limits",
            "4,8",
            "--temperature",
            "1.5",
            "--output",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["entropy_mean"] == pytest.approx(r["entropy_mean"])
    n = r["problems"] * r["generations"]
    assert r["problems"] == 6 and sum(lv["n"] for lv in r["levels"].values()) == n
    assert r["temperature"] == 1.5 and r["length_max"] <= 12
    # A random model rarely stops: most responses run into the limit, and those are longer
    # than every smaller limit.
    assert r["truncated_frac"] <= r["longer_than"]["8"] <= r["longer_than"]["4"] <= 1
    acc = sum(lv["acc"] * lv["n"] for lv in r["levels"].values()) / n
    assert r["accuracy"] == pytest.approx(acc)
    assert (
        0 < r["entropy_mean"] <= math.log(len(measure_task.load_tokenizer(str(random_tiny_model))))
    )
    assert "temperature 1.5" in capsys.readouterr().out


def test_well_formed_means_an_answer_line_with_an_integer(measure_task):
    assert measure_task.well_formed("51 + 29 = 80\nAnswer: 80")
    assert measure_task.well_formed("Answer: $-7$.")  # normalised as the scorer does
    assert not measure_task.well_formed("51 + 29 = 80")  # no Answer: line
    assert not measure_task.well_formed("51 + 29 = 80\nAnswer: eighty")
    assert not measure_task.well_formed("Answer: 10.5")


def test_a_chat_variant_reports_format_and_mixed_groups_and_lists_mixed_problems(
    measure_task, random_tiny_model, monkeypatch
):
    """--variant measures a chat_addition candidate (no column behaviour); the mixed share,
    pass@G and well-formed figures agree with per-response outcomes counted here."""
    real = measure_task.dapo_math_score
    # The random model is never right: score by a rule that makes some groups mixed.
    texts_seen: list[str] = []

    def fake(text: str, truth: str) -> float:
        texts_seen.append(text)
        return 1.0 if len(texts_seen) % 3 == 0 else real(text, truth)

    monkeypatch.setattr(measure_task, "dapo_math_score", fake)
    r = measure_task.main(
        [
            "--model",
            str(random_tiny_model),
            "--variant",
            "add_2d_1d",
            "--split",
            "train",
            "--problems",
            "4",
            "--generations",
            "3",
            "--max-length",
            "6",
            "--select-mixed",
            "2",
        ]
    )
    assert r["behaviour"] is None and r["split"] == "train" and "add_2d_1d" in r["task"]
    # Every group holds exactly one right response (every third call): all mixed.
    assert (
        r["mixed_groups"] == 1.0 and r["pass_at_g"] == 1.0 and r["accuracy"] == pytest.approx(1 / 3)
    )
    assert len(r["mixed_problems"]) == 2 and all(p["op"] == "+" for p in r["mixed_problems"])
    assert r["well_formed_frac"] == sum(map(measure_task.well_formed, texts_seen)) / 12
