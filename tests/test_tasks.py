"""The built-in tasks: answers, worked solutions and their noise, lengths, difficulty, splits."""

from __future__ import annotations

import random
import re

import pytest

from dapo.data.tasks import TASKS, load_task
from dapo.data.tasks import long_addition as L
from dapo.rewards import dapo_math_score

COLUMN = re.compile(r"(\d)\+(\d)(\+1)?=(\d+), (\d+)")


def parse(solution: str) -> tuple[list[tuple[int, int, bool, int, str]], str | None, int]:
    """A solution's column lines ``x+y[+1]=s, result`` as tuples, the result of its final
    ``carry 1, R`` line (None without one) and its answer; the format is asserted."""
    *body, last = solution.split("\n")
    assert last.startswith("Answer: "), solution
    carry_line = None
    if body and body[-1].startswith("carry 1, "):
        carry_line = body.pop().removeprefix("carry 1, ")
    columns = []
    for text in body:
        m = COLUMN.fullmatch(text)
        assert m, f"malformed line {text!r} in {solution!r}"
        columns.append((int(m[1]), int(m[2]), m[3] is not None, int(m[4]), m[5]))
    return columns, carry_line, int(last.removeprefix("Answer: "))


def digit(n: int, i: int) -> int:
    return n // 10**i % 10


def test_long_addition_is_registered_next_to_addition():
    assert set(TASKS) == {
        "builtin:addition",
        "builtin:long_addition",
        "builtin:calculator",
        "builtin:chat_addition",
        "builtin:chat_addition-sanity",
        "builtin:colour_count",
        "builtin:code",
    }
    records = load_task("builtin:long_addition", "test", n=5)
    assert len(records) == 5 and all(r.data_source == "builtin_long_addition" for r in records)
    with pytest.raises(ValueError, match="builtin:addition, builtin:long_addition"):
        load_task("builtin:long_additon", "test", n=1)


def test_clean_solution_adds_column_by_column_and_scores_right():
    text, answer = L.worked_solution(4738, 975)
    assert text == "8+5=13, 3\n3+7+1=11, 13\n7+9+1=17, 713\n4+0+1=5, 5713\nAnswer: 5713"
    assert answer == 5713
    assert L.worked_solution(95, 7)[0] == "5+7=12, 2\n9+0+1=10, 02\ncarry 1, 102\nAnswer: 102"
    for r in L.long_addition_records("test", n=300):
        a, b = r.extra["a"], r.extra["b"]
        assert r.prompt == f"Add {a}+{b} column by column. End with: Answer: <sum>\n"
        solution, answer = L.worked_solution(a, b)
        columns, carry_line, final = parse(solution)
        assert len(columns) == max(len(str(a)), len(str(b)))
        carry = 0
        for i, (x, y, plus, s, result) in enumerate(columns):
            assert (x, y, plus, s) == (digit(a, i), digit(b, i), bool(carry), x + y + carry)
            assert result == str(a + b)[-(i + 1) :].zfill(i + 1)
            carry = int(s >= 10)
        assert (carry_line is not None) == bool(carry)
        assert final == answer == a + b == int(r.ground_truth)
        assert dapo_math_score(solution, r.ground_truth) == 1.0


def test_noisy_solutions_are_consistent_and_noisy_at_the_stated_rates():
    """Each kind of warm-up noise appears at about its stated rate, every line follows from
    the line before it, and the answer is wrong exactly when a carry was dropped."""
    rng = random.Random(0)
    carries = dropped = boundaries = shortcuts = written = runs = 0
    for _ in range(8000):
        a, b = L._sample_operands(rng)
        solution, answer = L.worked_solution(a, b, rng)
        columns, carry_line, final = parse(solution)
        assert final == answer
        i = 0
        while i < len(columns):  # runs of a repeated line
            j = i
            while j + 1 < len(columns) and columns[j + 1] == columns[i]:
                j += 1
            runs += j > i
            assert j - i <= L.MAX_REPEATS
            i = j + 1
        worked = [x for k, x in enumerate(columns) if k == 0 or x != columns[k - 1]]
        written += len(worked)
        due, slipped = False, False
        for k, (x, y, plus, s, _) in enumerate(worked):
            assert (x, y, s) == (digit(a, k), digit(b, k), x + y + plus)
            assert plus <= due  # a carry only after a column that overflowed
            if due:
                carries += 1
                dropped += not plus
                slipped |= not plus
            due = s >= 10
        w, n = len(worked), max(len(str(a)), len(str(b)))
        boundaries += w if w < n else n - 1
        if w < n:  # a shortcut: the remaining columns added at once, with the carry or not
            shortcuts += 1
            assert carry_line is None
            rest = a // 10**w + b // 10**w
            kept = int(f"{rest + due}{worked[-1][4]}")
            assert final in (kept, int(f"{rest}{worked[-1][4]}"))
            slipped |= final != kept
        else:
            assert (carry_line is not None) <= due
            if due:  # the carry out of the last column, kept as a line "carry 1, R" or not
                carries += 1
                dropped += carry_line is None
                slipped |= carry_line is None
        assert (final == a + b) == (not slipped), solution
        assert (dapo_math_score(solution, str(a + b)) == 1.0) == (not slipped)
    assert dropped / carries == pytest.approx(L.DROP_CARRY, abs=0.02)
    assert shortcuts / boundaries == pytest.approx(L.SHORTCUT, abs=0.01)
    assert runs / written == pytest.approx(L.REPEAT, abs=0.015)


def test_lengths_vary_several_fold_and_clean_solutions_fit_the_suggested_limit():
    # Response tokens = characters + EOS with the built-in character tokenizer.
    records = L.long_addition_records("test", 3000)
    lengths = [len(L.worked_solution(r.extra["a"], r.extra["b"])[0]) + 1 for r in records]
    assert min(lengths) <= 20 and max(lengths) >= 78
    assert max(lengths) / min(lengths) >= 4
    assert max(lengths) <= L.SUGGESTED_MAX_LENGTH
    # Rambling pushes a share of the warm-up solutions past the limit.
    rng = random.Random(1)
    noisy = [len(L.sft_example(rng)[1]) + 1 for _ in range(5000)]
    over = sum(n > L.SUGGESTED_MAX_LENGTH for n in noisy) / len(noisy)
    assert 0.03 < over < 0.15


def test_difficulty_spread_and_splits():
    train = L.long_addition_records("train", n=4000)
    test = L.long_addition_records("test", n=1000)
    digits = [len(str(max(r.extra["a"], r.extra["b"]))) for r in train]
    assert set(digits) == set(range(1, L.MAX_DIGITS + 1))
    # Each operand has 1..MAX_DIGITS digits, independently: the longer one has the full
    # width with odds 1 - ((MAX_DIGITS - 1) / MAX_DIGITS)^2.
    full = 1 - ((L.MAX_DIGITS - 1) / L.MAX_DIGITS) ** 2
    assert digits.count(L.MAX_DIGITS) / len(digits) == pytest.approx(full, abs=0.03)
    assert {r.uid for r in train}.isdisjoint({r.uid for r in test})
    assert [r.uid for r in L.long_addition_records("test", n=50)] == [r.uid for r in test[:50]]
    rng = random.Random(2)
    assert all(L.split_of(*L._sample_split(rng, "train")) == "train" for _ in range(200))
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        L.long_addition_records("valid", n=1)


# --- the built-in models, one per task -------------------------------------------------------


def test_each_builtin_model_has_its_own_cache_and_unknown_ones_are_named(tmp_path, monkeypatch):
    from dapo.errors import ModelError
    from dapo.models import tiny
    from dapo.models.loading import BUILTIN_MODELS, resolve_model_path

    monkeypatch.setenv("DAPO_CACHE", str(tmp_path))
    assert (
        set(tiny.RECIPES)
        == set(BUILTIN_MODELS)
        == {"builtin:tiny", "builtin:tiny-long", "builtin:tiny-tool", "builtin:tiny-code"}
    )
    # The default model keeps the cache directory it always had.
    assert tiny.cache_dir("builtin:tiny") == tmp_path / "builtin-tiny-v3"
    assert tiny.cache_dir("builtin:tiny-long").name.startswith("builtin-tiny-long-v")
    assert tiny.RECIPES["builtin:tiny-long"].sft_example is L.sft_example
    assert tiny.cache_dir("builtin:tiny-tool").name.startswith("builtin-tiny-tool-v")
    with pytest.raises(ModelError, match="builtin:tiny, builtin:tiny-long, builtin:tiny-tool"):
        resolve_model_path("builtin:tiny-lnog")


def test_warm_up_continues_from_the_base_model_on_the_named_task(tmp_path, monkeypatch, one_thread):
    """builtin:tiny-long's warm-up starts from its base model's weights (not a random
    start), trains on long additions, in batches of similar length, and saves a model."""
    import dataclasses
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from dapo.models import tiny

    base_dir = tmp_path / "base"
    base = tiny.build_model(len(tiny.build_tokenizer()), seed=5)
    base.save_pretrained(base_dir)
    asked = []
    monkeypatch.setattr(
        tiny, "ensure_builtin_model", lambda name, log: asked.append(name) or base_dir
    )
    seen = []

    def spy(rng):
        seen.append(L.sft_example(rng))
        return seen[-1]

    recipe = tiny.RECIPES["builtin:tiny-long"]
    assert recipe.base == "builtin:tiny" and recipe.length_buckets > 1
    fast = dataclasses.replace(recipe, sft_example=spy, steps=1)
    monkeypatch.setattr(tiny, "RECIPES", {**tiny.RECIPES, "builtin:tiny-long": fast})
    out = tiny.warm_up(tmp_path / "m", "builtin:tiny-long", log=lambda _: None)
    assert asked == ["builtin:tiny"]
    # One batch drawn from a pool of `length_buckets` batches sorted by length.
    assert len(seen) == tiny.WARMUP_BATCH * recipe.length_buckets
    assert all(p.startswith("Add ") and p.endswith("Answer: <sum>\n") for p, _ in seen)
    meta = json.loads((out / "builtin.json").read_text())
    assert meta["name"] == "builtin:tiny-long" and meta["steps"] == 1
    trained = AutoModelForCausalLM.from_pretrained(out)
    fresh = tiny.build_model(len(tiny.build_tokenizer()), seed=0)

    def distance(m):
        return sum(
            (p - q).abs().sum().item()
            for p, q in zip(trained.parameters(), m.parameters(), strict=True)
        )

    # One step at the first warm-up learning rate moves the base weights a little.
    assert 0 < distance(base) < 0.01 * distance(fresh)
    assert all(torch.isfinite(p).all() for p in trained.parameters())


# --- builtin:chat_addition, the task for a real chat model ------------------------------------

QUESTION = re.compile(r"What is (\d+) ([-+x]) (\d+)\?")


def asked(record) -> tuple[int, str, int]:
    """The operands and operation of a chat problem, read from its last user message."""
    last = record.prompt[-1]
    assert last["role"] == "user"
    m = QUESTION.fullmatch(last["content"])
    assert m, last
    return int(m[1]), m[2], int(m[3])


def test_chat_addition_asks_in_chat_messages_with_the_format_and_three_worked_examples():
    from dapo.data.tasks import chat_addition as C

    record = C.chat_addition_records("test", n=1)[0]
    a, _, b = asked(record)
    assert record.prompt == [
        {
            "role": "system",
            "content": "Answer with the equation, then a last line: Answer: <number>",
        },
        {"role": "user", "content": "What is 23 + 45?"},
        {"role": "assistant", "content": "23 + 45 = 68\nAnswer: 68"},
        {"role": "user", "content": "What is 47 + 38?"},
        {"role": "assistant", "content": "47 + 38 = 85\nAnswer: 85"},
        {"role": "user", "content": "What is 76 + 49?"},
        {"role": "assistant", "content": "76 + 49 = 125\nAnswer: 125"},
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]
    assert (record.data_source, record.uid) == ("chat_addition", f"chat-{a}+{b}")


def test_chat_addition_answers_are_right_and_the_default_scorer_reads_them():
    from dapo.data.tasks import chat_addition as C
    from dapo.rewards import scorer_for_source

    # Not mapped to a scorer of its own: the default reward (dapo_math) scores it.
    assert scorer_for_source(C.DATA_SOURCE) == "dapo_math"
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "x": lambda a, b: a * b}
    for name, variant in C.VARIANTS.items():
        for record in C.variant_records(variant, "train", n=200):
            a, op, b = asked(record)
            assert (op, a, b) == (variant.op, record.extra["a"], record.extra["b"])
            assert record.ground_truth == str(ops[op](a, b)), name
            # The examples' own format, answered right, scores +1; one off scores -1.
            right = variant.response(a, b)
            assert dapo_math_score(right, record.ground_truth) == 1.0
            wrong = right.replace(f"Answer: {record.ground_truth}", f"Answer: {ops[op](a, b) + 1}")
            assert dapo_math_score(wrong, record.ground_truth) == -1.0
        shown = [m for m in variant.messages(50, 5) if m["role"] == "assistant"]
        assert len(shown) == len(variant.examples)
        assert all(("=" in m["content"]) == variant.equation for m in shown)
    levels = {r.extra["level"] for r in C.chat_addition_records("test", n=300)}
    assert levels == {0, 1, 2}  # no carry, a carry, a sum of 100 or more


def test_chat_addition_splits_are_disjoint_seeded_and_without_repeats():
    from dapo.data.tasks import chat_addition as C

    variant = C.CHOSEN
    every = variant.problems()
    assert len(every) == 90 * 90 == len(set(every))
    held_out = {p for p in every if variant.split_of(*p) == "test"}
    assert 0.08 < len(held_out) / len(every) < 0.12  # about 1 in TEST_SHARE
    assert not held_out & set(variant.examples)  # the prompt's examples are never held out

    test = C.chat_addition_records("test", n=len(held_out))
    train = C.chat_addition_records("train", n=20000)  # what data.train loads
    test_problems = {(r.extra["a"], r.extra["b"]) for r in test}
    assert test_problems == held_out  # every held-out problem once, none twice
    train_problems = {(r.extra["a"], r.extra["b"]) for r in train}
    assert train_problems == set(every) - held_out  # 20000 > 7278: all, in repeated passes
    assert not {r.uid for r in train} & {r.uid for r in test}
    # Seeded: the same seed gives the same order, another seed another one.
    assert [r.uid for r in C.chat_addition_records("test", n=50)] == [r.uid for r in test[:50]]
    other = C.chat_addition_records("test", n=50, seed=7)
    assert [r.uid for r in other] != [r.uid for r in test[:50]]
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        C.chat_addition_records("valid", n=1)


def test_chat_addition_and_its_sanity_set_are_builtin_data_sets():
    from dapo.config import DataConfig
    from dapo.data.prompts import load_prompt_set
    from dapo.data.tasks import chat_addition as C

    data = DataConfig(train=C.NAME, eval=C.NAME, max_eval_prompts=300)
    train, held_out = load_prompt_set(data, "train"), load_prompt_set(data, "eval")
    assert len(held_out) == 300 and not {r.uid for r in train} & {r.uid for r in held_out}

    sanity = load_task(C.SANITY_NAME, "train", n=20000)
    assert len(sanity) == len({r.uid for r in sanity}) == 32
    assert [r.uid for r in load_task(C.SANITY_NAME, "test", n=500)] == [r.uid for r in sanity]
    assert all(C.CHOSEN.split_of(*asked(r)[::2]) == "train" for r in sanity)
    for r in sanity:
        a, _, b = asked(r)
        assert r.ground_truth == str(a + b)


@pytest.mark.slow
def test_an_interrupted_warm_up_resumes_from_its_saved_progress(tmp_path, one_thread):
    """Progress is saved every tenth of the warm-up; a build interrupted midway goes on from
    there and ends with the weights of an uninterrupted build."""
    import torch
    from transformers import AutoModelForCausalLM

    from dapo.models import tiny

    def build(out, log):
        return tiny.warm_up(out, "builtin:tiny", steps=4, log=log)

    straight = AutoModelForCausalLM.from_pretrained(build(tmp_path / "a", lambda _: None))

    class Interrupt(Exception):
        pass

    def stop_after_two(line):
        if line.startswith("warm-up 2/4"):
            raise Interrupt

    out = tmp_path / "b"
    with pytest.raises(Interrupt):
        build(out, stop_after_two)
    assert not out.exists() and tiny.progress_path(out).is_file()
    heard: list[str] = []
    resumed = AutoModelForCausalLM.from_pretrained(build(out, heard.append))
    assert heard[0] == "resuming the warm-up of builtin:tiny at step 2/4 (saved progress)"
    assert [line.split(":")[0] for line in heard[1:]] == ["warm-up 3/4", "warm-up 4/4"]
    assert not tiny.progress_path(out).exists()  # the finished model replaces it
    for (name, p), q in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name
    # Progress of another warm-up (other steps) is not used.
    with pytest.raises(Interrupt):
        build(tmp_path / "c", stop_after_two)
    heard.clear()
    tiny.warm_up(tmp_path / "c", "builtin:tiny", steps=2, log=heard.append)
    assert not heard[0].startswith("resuming")


def test_a_second_process_waits_for_the_first_build(tmp_path, monkeypatch):
    """Two builders of one built-in model at once: one builds, the other waits for it and
    uses its model (a file lock; threads hold separate open files, as processes do)."""
    import json
    import threading
    import time

    from dapo.models import tiny

    monkeypatch.setenv("DAPO_CACHE", str(tmp_path))
    monkeypatch.setenv(tiny.BUILD_ENV, "1")  # not the shipped copy: build it
    builds = []

    def fake_warm_up(path, name, log):
        builds.append(name)
        time.sleep(0.5)
        path.mkdir(parents=True)
        (path / "builtin.json").write_text(json.dumps({"name": name}))
        return path

    monkeypatch.setattr(tiny, "warm_up", fake_warm_up)
    logs: list[list[str]] = [[], []]
    paths = []

    def builder(i):
        paths.append(tiny.ensure_builtin_model("builtin:tiny", log=logs[i].append))

    first = threading.Thread(target=builder, args=(0,))
    first.start()
    time.sleep(0.1)
    builder(1)
    first.join()
    assert builds == ["builtin:tiny"] and paths[0] == paths[1] == tiny.cache_dir("builtin:tiny")
    assert logs[1] and logs[1][0].startswith("waiting for another process building builtin:tiny")


def test_the_shipped_models_are_used_while_their_recipe_is_the_same(tmp_path, monkeypatch):
    """builtin:tiny and builtin:tiny-tool ship as warm_up built them; a changed recipe or
    $DAPO_BUILD_BUILTIN=1 builds into the cache instead."""
    import dataclasses
    import json

    from transformers import AutoConfig

    from dapo.models import tiny

    monkeypatch.setenv("DAPO_CACHE", str(tmp_path))
    builds = []

    def fake_warm_up(path, name, log):
        builds.append(name)
        path.mkdir(parents=True)
        (path / "builtin.json").write_text(json.dumps({"name": name}))
        return path

    monkeypatch.setattr(tiny, "warm_up", fake_warm_up)
    for name in ("builtin:tiny", "builtin:tiny-tool", "builtin:tiny-code"):
        path = tiny.ensure_builtin_model(name, log=lambda _: None)
        assert path == tiny.SHIPPED / tiny.cache_dir(name).name
        meta = json.loads((path / "builtin.json").read_text())
        recipe = tiny.RECIPES[name]
        assert (meta["name"], meta["version"], meta["steps"], meta["seed"]) == (
            name,
            recipe.version,
            recipe.steps,
            0,
        )
        assert AutoConfig.from_pretrained(path).hidden_size == 128
        assert (path / "model.safetensors").stat().st_size > 3_000_000
    assert builds == [] and not any(tmp_path.iterdir())
    assert tiny.shipped_model("builtin:tiny-long") is None  # not shipped: built on first use

    bumped = dataclasses.replace(tiny.RECIPES["builtin:tiny"], steps=301)
    monkeypatch.setitem(tiny.RECIPES, "builtin:tiny", bumped)
    assert tiny.ensure_builtin_model("builtin:tiny", log=lambda _: None) == tiny.cache_dir()
    monkeypatch.setenv(tiny.BUILD_ENV, "1")
    tiny.ensure_builtin_model("builtin:tiny-tool", log=lambda _: None)
    assert builds == ["builtin:tiny", "builtin:tiny-tool"]
