"""The built-in tasks: answers, worked solutions and their noise, lengths, difficulty, splits."""

from __future__ import annotations

import random
import re
import statistics

import pytest

from dapo.data.tasks import TASKS, load_task
from dapo.data.tasks import chain as C
from dapo.rewards import dapo_math_score

LINE = re.compile(r"^(\d+)\+(\d+)=(\d+)$")


def parse(solution: str) -> tuple[list[tuple[int, int, int]], int]:
    """The lines ``a+b=c`` of a chain solution and its final answer (the format is asserted)."""
    *body, last = solution.split("\n")
    assert last.startswith("Answer: "), solution
    lines = []
    for text in body:
        m = LINE.match(text)
        assert m, f"malformed line {text!r} in {solution!r}"
        lines.append(tuple(map(int, m.groups())))
    return lines, int(last.removeprefix("Answer: "))


def test_chain_is_registered_next_to_addition():
    assert set(TASKS) == {"builtin:addition", "builtin:chain"}
    records = load_task("builtin:chain", "test", n=5)
    assert len(records) == 5 and all(r.data_source == "builtin_chain" for r in records)
    with pytest.raises(ValueError, match="builtin:addition, builtin:chain"):
        load_task("builtin:chains", "test", n=1)


def test_clean_solution_adds_term_by_term_and_scores_right():
    text, answer = C.worked_solution([7, 5, 9, 3, 8])
    assert text == "7+5=12\n12+9=21\n21+3=24\n24+8=32\nAnswer: 32"
    assert answer == 32
    for r in C.chain_records("test", n=300):
        terms = r.extra["terms"]
        solution, answer = C.worked_solution(terms)
        lines, final = parse(solution)
        assert len(lines) == len(terms) - 1
        assert all(a + b == c for a, b, c in lines)
        assert [b for _, b, _ in lines] == terms[1:]
        assert final == answer == sum(terms) == int(r.ground_truth)
        assert r.prompt == f"Add {'+'.join(map(str, terms))} line by line. End with: Answer: <sum>\n"
        assert dapo_math_score(solution, r.ground_truth) == 1.0


def test_noisy_solutions_are_consistent_and_noisy_at_the_stated_rates():
    """Each kind of warm-up noise appears at about its stated rate, and every line follows
    from the ones before it (the answer is wrong exactly when a carry was dropped)."""
    rng = random.Random(0)
    carry_lines = dropped = boundaries = shortcuts = lines_written = repeats = 0
    for _ in range(6000):
        terms = C._sample_terms(rng)
        solution, answer = C.worked_solution(terms, rng)
        lines, final = parse(solution)
        assert final == answer
        distinct = [x for i, x in enumerate(lines) if i == 0 or x != lines[i - 1]]
        repeats += len(lines) - len(distinct)
        lines_written += len(distinct)
        total, slipped = terms[0], False
        for (a, b, c), term in zip(distinct, terms[1:], strict=False):
            assert a == total and b == term
            if a % 10 + b % 10 >= 10:
                carry_lines += 1
                dropped += c == a + b - 10
                slipped |= c == a + b - 10
            assert c in (a + b, a + b - 10)
            total = c
        # A shortcut ends the working early and adds the rest of the terms at once.
        worked = len(distinct)
        boundaries += worked + (worked < len(terms) - 1)
        shortcuts += worked < len(terms) - 1
        assert final == total + sum(terms[1 + worked :])
        assert (final == sum(terms)) == (not slipped)
        assert (dapo_math_score(solution, str(sum(terms))) == 1.0) == (not slipped)
    assert dropped / carry_lines == pytest.approx(C.DROP_CARRY, abs=0.02)
    assert shortcuts / boundaries == pytest.approx(C.SHORTCUT, abs=0.01)
    # Each written line repeats with REPEAT, then again with REPEAT_AGAIN each time.
    expected = C.REPEAT / (1 - C.REPEAT_AGAIN)
    assert repeats / lines_written == pytest.approx(expected, rel=0.15)


def test_lengths_vary_several_fold_and_clean_solutions_fit_the_suggested_limit():
    # Response tokens = characters + EOS with the built-in character tokenizer.
    lengths = [len(C.worked_solution(r.extra["terms"])[0]) + 1 for r in C.chain_records("test", 3000)]
    assert min(lengths) <= 18 and max(lengths) >= 72
    assert max(lengths) / min(lengths) >= 4
    assert max(lengths) <= C.SUGGESTED_MAX_LENGTH
    # Rambling pushes a real share of warm-up solutions past the limit.
    rng = random.Random(1)
    noisy = [len(C.sft_example(rng)[1]) + 1 for _ in range(5000)]
    over = sum(n > C.SUGGESTED_MAX_LENGTH for n in noisy) / len(noisy)
    assert 0.02 < over < 0.15


def test_difficulty_spread_and_splits():
    train = C.chain_records("train", n=4000)
    test = C.chain_records("test", n=1000)
    counts = [len(r.extra["terms"]) for r in train]
    assert set(counts) == set(range(C.MIN_TERMS, C.MAX_TERMS + 1))
    wide = [all(t >= 10 for t in r.extra["terms"]) for r in train]
    narrow = [all(t <= 9 for t in r.extra["terms"]) for r in train]
    assert all(w or n for w, n in zip(wide, narrow, strict=True))
    assert statistics.fmean(wide) == pytest.approx(C.WIDE_SHARE, abs=0.03)
    assert {r.uid for r in train}.isdisjoint({r.uid for r in test})
    assert [r.uid for r in C.chain_records("test", n=50)] == [r.uid for r in test[:50]]
    rng = random.Random(2)
    assert all(C._split_of(C._sample_split(rng, "train")) == "train" for _ in range(200))
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        C.chain_records("valid", n=1)


# --- the built-in models, one per task -------------------------------------------------------


def test_each_builtin_model_has_its_own_cache_and_unknown_ones_are_named(tmp_path, monkeypatch):
    from dapo.errors import ModelError
    from dapo.models import tiny
    from dapo.models.loading import BUILTIN_MODELS, resolve_model_path

    monkeypatch.setenv("DAPO_CACHE", str(tmp_path))
    assert set(tiny.RECIPES) == set(BUILTIN_MODELS) == {"builtin:tiny", "builtin:tiny-chain"}
    # The default model keeps the cache directory it always had.
    assert tiny.cache_dir("builtin:tiny") == tmp_path / "builtin-tiny-v3"
    assert tiny.cache_dir("builtin:tiny-chain").name.startswith("builtin-tiny-chain-v")
    assert tiny.RECIPES["builtin:tiny-chain"].sft_example is C.sft_example
    with pytest.raises(ModelError, match="builtin:tiny, builtin:tiny-chain"):
        resolve_model_path("builtin:tiny-chians")


def test_warm_up_trains_on_the_named_task(tmp_path, one_thread):
    """A 2-step warm-up of builtin:tiny-chain saves a loadable model trained on chain data."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from dapo.models import tiny

    seen = []

    def spy(rng):
        seen.append(C.sft_example(rng))
        return seen[-1]

    recipe = tiny.RECIPES["builtin:tiny-chain"]
    monkeypatched = {**tiny.RECIPES, "builtin:tiny-chain": tiny.Recipe(spy, recipe.version, 2, "")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "RECIPES", monkeypatched)
        out = tiny.warm_up(tmp_path / "m", "builtin:tiny-chain", log=lambda _: None)
    assert len(seen) == 2 * tiny.WARMUP_BATCH
    assert all(p.startswith("Add ") and "line by line" in p for p, _ in seen)
    meta = json.loads((out / "builtin.json").read_text())
    assert meta["name"] == "builtin:tiny-chain" and meta["steps"] == 2
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.isfinite(next(model.parameters())).all()
