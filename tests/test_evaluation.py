"""Evaluation: the avg@k / pass@k / maj@k math, repeat detection, and ``dapo eval`` end to end."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo.cli import main
from dapo.evaluation.run import engine_accuracy, load_eval_problems, score_groups
from dapo.evaluation.stats import majority_answer, majority_correct, pass_at_k, summarize
from dapo.rewards import RewardScorer
from dapo.rollout import Group, SamplingParams

# --------------------------------------------------------------------------- pass@k


def test_pass_at_k_hand_computed_values() -> None:
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 0, 2) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0  # n - c = 1 < k: every pair holds a correct sample
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 is the plain accuracy
    # n == k: 1 if any sample is correct, else 0
    assert pass_at_k(3, 1, 3) == 1.0
    assert pass_at_k(3, 0, 3) == 0.0


def test_pass_at_k_matches_brute_force_subsets() -> None:
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                expected = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(expected), (n, c, k)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 1, 0), (2, 1, 3), (3, 4, 1), (3, -1, 1)])
def test_pass_at_k_rejects_impossible_inputs(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# --------------------------------------------------------------------------- maj@k


def _judged(answers, truth):
    """Correctness as a strict scorer gives it: the raw answer equals the truth."""
    return [a == truth for a in answers]


def test_majority_correct_and_wrong() -> None:
    for answers, right in ((["5", "5", "3"], True), (["3", "3", "5"], False), (["7"], False)):
        assert majority_correct(answers, _judged(answers, "5")) is right
    assert majority_correct(["7"], [True])


def test_majority_ties_go_to_first_occurrence() -> None:
    assert majority_correct(["5", "3"], _judged(["5", "3"], "5"))
    assert not majority_correct(["3", "5"], _judged(["3", "5"], "5"))
    assert majority_answer(["3", "5", "5", "3"]) == "3"
    assert not majority_correct(["3", "5", "5", "3"], _judged(["3", "5", "5", "3"], "5"))
    assert majority_correct(["5", "3", "3", "5", "9"], _judged(["5", "3", "3", "5", "9"], "5"))


def test_majority_none_answers_do_not_vote() -> None:
    # None is the most common entry but is not an answer: the single "5" wins.
    assert majority_correct([None, None, "5"], [False, False, True])
    assert majority_answer([None, "4", None]) == "4"
    assert majority_answer([None, None]) is None
    assert not majority_correct([None, None], [True, True])  # no votes: wrong
    assert not majority_correct([], [])
    # an answer that normalises to nothing ("$") does not vote either
    assert majority_answer(["$", "$", "2"]) == "2"
    with pytest.raises(ValueError, match="2 answers but 1 correctness"):
        majority_correct(["1", "2"], [True])


def test_majority_votes_are_normalised_and_the_winner_judged_by_the_scorer() -> None:
    # Without normalisation "3" (2 votes) would beat two different spellings of 1/2.
    answers = ["\\frac12", "3", "\\frac{1}{2}", "3", "$\\frac{1}{2}$"]
    assert majority_answer(answers) == "\\frac{1}{2}"
    # The winner's first response ("\\frac12") decides: right if the scorer took it...
    assert majority_correct(answers, [True, False, True, False, True])
    # ...wrong if the scorer (the paper's strict one) rejected that spelling, even though
    # the normalised vote equals the normalised truth.
    assert not majority_correct(answers, [False, False, True, False, True])
    assert not majority_correct(["1,000", "1000", "7"], [False, True, False])


# --------------------------------------------------------------------------- summarize


def test_summarize_per_source_and_overall() -> None:
    correct = [[True, False], [False, False], [True, True]]
    answers = [["1", "2"], [None, "7"], ["4", "4"]]
    sources = ["A", "A", "B"]
    truncated = [[False, True], [False, False], [True, True]]
    out = summarize(correct, answers, sources, k=2, truncated=truncated)
    overall, a, b = out["overall"], out["by_source"]["A"], out["by_source"]["B"]
    assert set(out["by_source"]) == {"A", "B"}
    assert overall == pytest.approx(
        {"problems": 3, "avg@2": 0.5, "pass@2": 2 / 3, "maj@2": 2 / 3, "truncated": 0.5}
    )
    # problem 0: tie "1"/"2" -> "1" (first) is right; problem 1: "7" is wrong
    assert a == pytest.approx(
        {"problems": 2, "avg@2": 0.25, "pass@2": 0.5, "maj@2": 0.5, "truncated": 0.25}
    )
    assert b == pytest.approx(
        {"problems": 1, "avg@2": 1.0, "pass@2": 1.0, "maj@2": 1.0, "truncated": 1.0}
    )


def test_summarize_more_samples_than_k_uses_the_unbiased_estimator() -> None:
    out = summarize([[True, True, False, False, False]], [["9"] * 5], ["s"], k=2)
    assert out["overall"]["pass@2"] == pytest.approx(0.7)
    assert out["overall"]["avg@2"] == pytest.approx(0.4)
    assert "truncated" not in out["overall"]


def test_summarize_rejects_ragged_input() -> None:
    with pytest.raises(ValueError, match="fewer than k"):
        summarize([[True]], [["1"]], ["s"], k=2)
    with pytest.raises(ValueError, match="answers"):
        summarize([[True, False]], [["1"]], ["s"], k=2)
    with pytest.raises(ValueError, match="sources"):
        summarize([[True]], [["1"]], [], k=1)


# --------------------------------------------------------------------------- scoring glue


class _ScriptedEngine:
    """Returns fixed response texts (encoded with the char tokenizer) instead of sampling."""

    def __init__(self, tokenizer, texts: list[list[str]], truncated: list[list[bool]]) -> None:
        self.tok, self.texts, self.truncated = tokenizer, texts, truncated
        self.calls: list[SamplingParams] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        self.calls.append(params)
        assert len(prompts) == len(self.texts)
        return [
            Group(
                prompt_ids=p,
                response_ids=[self.tok(t, add_special_tokens=False)["input_ids"] for t in ts],
                logprobs=[[0.0] * len(t) for t in ts],
                truncated=list(tr),
            )
            for p, ts, tr in zip(prompts, self.texts, self.truncated, strict=True)
        ]

    def load_weights(self, named_tensors) -> None:  # pragma: no cover - protocol only
        pass


def _records():
    from dapo.data import PromptRecord

    return [PromptRecord("Add 2+3.", "5", "s1"), PromptRecord("Add 4+5.", "9", "s2")]


def test_score_groups_and_trainer_evaluate_use_the_scorer_and_answers() -> None:
    from dapo.models.tiny import build_tokenizer

    tok = build_tokenizer()
    texts = [["work\nAnswer: 5", "Answer: 4"], ["Answer: $9$", "no answer here"]]
    engine = _ScriptedEngine(tok, texts, [[False, True], [False, False]])
    records = _records()
    ids = [tok(r.prompt, add_special_tokens=False)["input_ids"] for r in records]
    with RewardScorer(num_workers=0) as scorer:
        groups = engine.generate(ids, SamplingParams(n=2))
        correct, answers = score_groups(groups, records, tok, scorer)
        assert correct == [[True, False], [True, False]]
        assert answers == [["5", "4"], ["$9$", None]]

        params = SamplingParams(n=2, max_tokens=16)
        ev = engine_accuracy(engine, tok, records, ids, scorer, params)
    assert ev["acc"] == pytest.approx(0.5)
    assert ev["n"] == 4
    assert ev["truncated"] == pytest.approx(0.25)
    expected_len = sum(len(t) for ts in texts for t in ts) / 4
    assert ev["response_length"] == pytest.approx(expected_len)


def _scored(texts: list[str], truth: str, source: str):
    """One problem's responses ``texts``, scored as ``dapo eval`` scores them:
    ``(correct, answers)``."""
    from dapo.data import PromptRecord
    from dapo.models.tiny import build_tokenizer

    tok = build_tokenizer()
    records = [PromptRecord("How many?", truth, source)]
    engine = _ScriptedEngine(tok, [texts], [[False] * len(texts)])
    ids = [tok(r.prompt, add_special_tokens=False)["input_ids"] for r in records]
    with RewardScorer(num_workers=0) as scorer:
        groups = engine.generate(ids, SamplingParams(n=len(texts)))
        return score_groups(groups, records, tok, scorer)


def test_maj_at_k_judges_the_winner_with_the_paper_s_scorer() -> None:
    """dapo_math (verl's math_dapo) rejects `12.` for 12, and the lenient normaliser reads it
    as 12: two such answers outvote one right `12`. The scorer's verdict on the winner
    decides maj@k, as it decides avg@k (a normalised-string comparison counted it right)."""
    correct, answers = _scored(["Answer: 12.", "Answer: 12.", "Answer: 12"], "12", "math_dapo")
    assert correct == [[False, False, True]]  # the paper's rules
    assert majority_answer(answers[0]) == majority_answer(["12"])  # one vote of three
    out = summarize(correct, answers, ["math_dapo"], k=3)["overall"]
    assert out["avg@3"] == pytest.approx(1 / 3) and out["pass@3"] == 1.0
    assert out["maj@3"] == 0.0


def test_each_scorer_s_answers_vote_as_it_reads_them() -> None:
    from dapo.rewards.math import boxed_or_answer, gsm8k_answer

    assert gsm8k_answer("so #### 1,000") == gsm8k_answer("\\boxed{1000.0}") == "1000"
    assert gsm8k_answer("Answer: 2.5") == "2.5" and gsm8k_answer("no number") is None
    assert boxed_or_answer("thus \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert boxed_or_answer("\\boxed{3}\nAnswer: 4") == "4"  # the Answer: line first
    assert boxed_or_answer("nothing") is None
    with RewardScorer(num_workers=0) as scorer:
        assert scorer.answer_reader("openai/gsm8k") is gsm8k_answer
        assert scorer.answer_reader("HuggingFaceH4/MATH-500") is boxed_or_answer
        assert scorer.answer_reader("math_dapo")("x\nAnswer: 7") == "7"
        assert scorer.answer_reader("codeforces")("```python\nprint(1)\n```") is None


def test_maj_at_k_of_gsm8k_responses_votes_on_their_hash_answers() -> None:
    """GSM8K responses end ``#### N`` and have no ``Answer:`` line: read with the DAPO
    line alone they cast no vote, and maj@k was 0 however right they were."""
    correct, answers = _scored(
        ["so #### 1,000", "#### 7", "#### 1000"], "#### 1000", "openai/gsm8k"
    )
    assert correct == [[True, False, True]] and answers == [["1000", "7", "1000"]]
    out = summarize(correct, answers, ["openai/gsm8k"], k=3)["overall"]
    assert out["maj@3"] == 1.0 and out["avg@3"] == pytest.approx(2 / 3)


# --------------------------------------------------------------------------- data


def _write_reference_parquet(path: Path, problems: list[tuple[str, str, str]], repeats) -> Path:
    """Rows in the DAPO reference format; problem i appears ``repeats[i]`` times, interleaved."""
    rows = []
    for r in range(max(repeats)):
        for i, (source, question, answer) in enumerate(problems):
            if r < repeats[i]:
                rows.append(
                    {
                        "data_source": source,
                        "prompt": [
                            {
                                "role": "user",
                                "content": f"{question}\n\nEnd with a line Answer: <answer>.",
                            }
                        ],
                        "ability": "MATH",
                        "reward_model": {"ground_truth": answer, "style": "rule"},
                        "extra_info": {"index": i, "raw_problem": question, "split": "test"},
                    }
                )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


PROBLEMS = [
    ("src_a", "What is 2+3?", "5"),
    ("src_a", "What is 7-4?", "3"),
    ("src_b", "What is 6*7? Multiply the two numbers.", "42"),
]


def test_repeated_rows_are_samples_of_one_problem(tmp_path: Path) -> None:
    path = _write_reference_parquet(tmp_path / "rep.parquet", PROBLEMS, [4, 4, 4])
    problems = load_eval_problems(str(path))
    assert problems.rows == 12
    assert problems.repeats == 4  # dapo eval's default k
    assert [r.ground_truth for r in problems.records] == ["5", "3", "42"]
    assert [r.data_source for r in problems.records] == ["src_a", "src_a", "src_b"]

    uneven = _write_reference_parquet(tmp_path / "uneven.parquet", PROBLEMS, [4, 2, 1])
    problems = load_eval_problems(str(uneven))
    assert len(problems.records) == 3
    assert problems.repeats is None  # -> k defaults to 1
    assert (problems.min_repeats, problems.max_repeats) == (1, 4)
    assert len(load_eval_problems(str(path), max_problems=2).records) == 2


# --------------------------------------------------------------------------- dapo eval


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dapo.models.tiny import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("eval_model") / "rand-tiny"
    tok = build_tokenizer()
    build_model(len(tok), seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def eval_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_reference_parquet(
        tmp_path_factory.mktemp("eval_data") / "set.parquet", PROBLEMS, [4, 4, 4]
    )


def _check_metrics(entry: dict, k: int) -> None:
    for key in (f"avg@{k}", f"pass@{k}", f"maj@{k}", "truncated"):
        assert 0.0 <= entry[key] <= 1.0, (key, entry)
    assert entry[f"avg@{k}"] <= entry[f"pass@{k}"]


def test_cli_eval_end_to_end(
    random_model: Path, eval_parquet: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "reports" / "r.json"
    args = ["eval", str(random_model), "--data", str(eval_parquet), "--max-tokens", "8"]
    assert main([*args, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 problems, each repeated 4 times" in printed
    assert "avg@4" in printed and "overall" in printed

    report = json.loads(out.read_text())
    for key in ("model", "data", "temperature", "top_p", "seconds", "dropped_too_long"):
        assert key in report
    assert report["k"] == 4  # defaults to the repeat count
    assert report["problems"] == 3 and report["samples"] == 12
    assert report["max_tokens"] == 8 and report["top_p"] == 0.7
    assert report["dropped_too_long"] == 0
    _check_metrics(report["overall"], 4)
    assert set(report["by_source"]) == {"src_a", "src_b"}
    assert [report["by_source"][s]["problems"] for s in ("src_a", "src_b")] == [2, 1]
    for entry in report["by_source"].values():
        _check_metrics(entry, 4)


def test_cli_eval_options_and_default_output(
    random_model: Path, eval_parquet: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    from dapo.data import load_records, render_prompt
    from dapo.models.tiny import build_tokenizer

    monkeypatch.chdir(tmp_path)
    records, _ = load_records(str(eval_parquet), dedupe=False)
    tok = build_tokenizer()
    lengths = [
        len(tok(render_prompt(r, tok), add_special_tokens=False)["input_ids"]) for r in records[:3]
    ]
    # a prompt budget that fits the two shorter problems only: the longest is dropped
    budget = sorted(lengths)[1]
    assert budget < max(lengths)
    args = ["eval", str(random_model), "--data", str(eval_parquet), "--max-tokens", "4"]
    assert main([*args, "--k", "2", "--max-prompt-length", str(budget), "--seed", "3"]) == 0
    report = json.loads((tmp_path / "rand-tiny-eval.json").read_text())
    assert report["k"] == 2 and "avg@2" in report["overall"]
    assert report["problems"] == 2 and report["samples"] == 4
    assert report["dropped_too_long"] == 1
    assert "dropped 1 of 3" in capsys.readouterr().out


def test_run_evaluation_closes_its_engine(
    random_model: Path, eval_parquet: Path, tmp_path: Path, monkeypatch
) -> None:
    """The engine is closed when the evaluation ends, and when it fails half-way (a vLLM
    engine holds memory and a process group until then)."""
    from dapo.evaluation import run as eval_run

    made: list = []

    class Recording:
        def __init__(self, inner, fail: bool) -> None:
            self.inner, self.fail, self.closed = inner, fail, False

        def generate(self, prompts, params):
            if self.fail:
                raise RuntimeError("engine died")
            return self.inner.generate(prompts, params)

        def close(self) -> None:
            self.closed = True

    real = eval_run._make_engine
    for fail in (False, True):
        monkeypatch.setattr(
            eval_run,
            "_make_engine",
            lambda *a, fail=fail: made.append(Recording(real(*a), fail)) or made[-1],
        )
        run = lambda: eval_run.run_evaluation(  # noqa: E731
            str(random_model),
            str(eval_parquet),
            max_tokens=4,
            output=tmp_path / "r.json",
            log=lambda _: None,
        )
        if fail:
            with pytest.raises(RuntimeError, match="engine died"):
                run()
        else:
            assert run()["problems"] == 3
        assert made[-1].closed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--k", "0"], "--k must be >= 1"),
        (["--engine", "nope"], "unknown engine 'nope'"),
        (["--top-p", "0"], "--top-p"),
    ],
)
def test_cli_eval_bad_options_exit_2(
    random_model: Path, eval_parquet: Path, capsys, extra: list[str], message: str
) -> None:
    assert main(["eval", str(random_model), "--data", str(eval_parquet), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_cli_eval_missing_and_malformed_data_exit_2(
    random_model: Path, tmp_path: Path, capsys
) -> None:
    missing = tmp_path / "no-such-set.parquet"
    assert main(["eval", str(random_model), "--data", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "not found" in err

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "reward_model": {"ground_truth": None}}) + "\n")
    assert main(["eval", str(random_model), "--data", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "row 0" in err and "ground truth is None" in err

    # --answer-key passes through to the loader
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"q": "What is 1+1?", "a": "2"}) + "\n")
    out = tmp_path / "good.json"
    cmd = ["eval", str(random_model), "--data", str(good), "--max-tokens", "2"]
    assert main([*cmd, "--prompt-key", "q", "--answer-key", "a", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["problems"] == 1


def test_cli_eval_unavailable_engine_exit_2(
    random_model: Path, eval_parquet: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    from dapo.rollout import vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    args = ["eval", str(random_model), "--data", str(eval_parquet), "--engine", "vllm"]
    assert main([*args, "--output", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "--engine vllm" in err and "pip install 'dapo[vllm]'" in err
    assert not (tmp_path / "x.json").exists()


# --------------------------------------------------------------------------- the scorer of dapo eval

# Every response says "Answer: 5." to problems whose answer is 5: the DAPO reference's rules
# (dapo_math) reject the final period, the lenient ones and GSM8K's number reading accept it.
SCORED_PROBLEMS = [("src_a", "What is 2+3?", "5"), ("openai/gsm8k", "What is 10-5?", "5")]


class _Says:
    """An engine that answers every prompt with the same text (scripted, not sampled)."""

    def __init__(self, tokenizer, text: str) -> None:
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        n = params.n
        return [
            Group(p, [list(self.ids)] * n, [[0.0] * len(self.ids)] * n, [False] * n)
            for p in prompts
        ]


@pytest.fixture
def says_five(monkeypatch: pytest.MonkeyPatch) -> None:
    from dapo.evaluation import run as eval_run

    monkeypatch.setattr(
        eval_run, "_make_engine", lambda _name, _model, tok, *_: _Says(tok, "Answer: 5.")
    )


def _eval_scored(
    random_model: Path, tmp_path: Path, *extra: str
) -> tuple[int, dict[str, float], dict[str, str]]:
    """``dapo eval`` on SCORED_PROBLEMS: exit code, avg@2 per source, scorer per source."""
    data = _write_reference_parquet(tmp_path / "scored.parquet", SCORED_PROBLEMS, [2, 2])
    out = tmp_path / "scored.json"
    args = ["eval", str(random_model), "--data", str(data), "--max-tokens", "4"]
    code = main([*args, "--output", str(out), *extra])
    if code != 0:
        return code, {}, {}
    report = json.loads(out.read_text())
    avg = {source: entry["avg@2"] for source, entry in report["by_source"].items()}
    return code, avg, report["scorers"]


def test_cli_eval_names_the_scorer_of_each_data_source(
    random_model: Path, tmp_path: Path, says_five: None, capsys
) -> None:
    code, avg, scorers = _eval_scored(random_model, tmp_path)
    assert code == 0
    printed = capsys.readouterr().out
    assert "scoring data_source 'src_a' with the built-in dapo_math scorer" in printed
    assert "scoring data_source 'openai/gsm8k' with the built-in gsm8k scorer" in printed
    assert scorers == {"openai/gsm8k": "gsm8k", "src_a": "dapo_math"}
    assert avg == {"openai/gsm8k": 1.0, "src_a": 0.0}  # "5." is not "5" by the reference


def test_cli_eval_scorer_overrides_every_data_source(
    random_model: Path, tmp_path: Path, says_five: None, capsys
) -> None:
    code, avg, scorers = _eval_scored(random_model, tmp_path, "--scorer", "dapo_math_lenient")
    assert code == 0
    printed = capsys.readouterr().out
    for source in ("src_a", "openai/gsm8k"):
        assert f"scoring data_source {source!r} with the built-in dapo_math_lenient" in printed
        assert scorers[source] == "dapo_math_lenient"
    assert avg == {"openai/gsm8k": 1.0, "src_a": 1.0}  # the lenient rules drop the period

    code, avg, scorers = _eval_scored(random_model, tmp_path, "--scorer", "dapo_math")
    assert code == 0
    assert avg == {"openai/gsm8k": 0.0, "src_a": 0.0}
    assert set(scorers.values()) == {"dapo_math"}


def test_cli_eval_scorer_takes_a_module_function(
    random_model: Path, tmp_path: Path, says_five: None, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    module = tmp_path / "dapo_eval_test_scorer.py"
    module.write_text(
        "def first_digit(response, ground_truth):\n"
        "    digits = [c for c in response if c.isdigit()]\n"
        "    return 1.0 if digits[:1] == [str(ground_truth)[0]] else -1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = "dapo_eval_test_scorer:first_digit"
    code, avg, scorers = _eval_scored(random_model, tmp_path, "--scorer", spec)
    assert code == 0
    assert f"scoring data_source 'src_a' with {spec}, as --scorer says" in capsys.readouterr().out
    assert scorers == {"openai/gsm8k": spec, "src_a": spec}
    assert avg == {"openai/gsm8k": 1.0, "src_a": 1.0}


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (
            "dapo_maths",
            "--scorer name 'dapo_maths' is neither a built-in scorer "
            "(code, dapo_math, dapo_math_lenient, gsm8k, math_verify) nor a spec",
        ),
        ("no_such_module_xyz:fn", "--scorer: reward function spec 'no_such_module_xyz:fn'"),
        ("dapo.rewards:no_such_fn", "has no attribute 'no_such_fn'"),
    ],
)
def test_cli_eval_bad_scorer_exits_2_before_loading_anything(
    random_model: Path,
    eval_parquet: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys,
    value: str,
    said: str,
) -> None:
    from dapo.evaluation import run as eval_run

    def no_model(*_: object) -> None:
        raise AssertionError("the model was loaded for a bad --scorer")

    monkeypatch.setattr(eval_run, "load_model", no_model)
    assert main(["eval", str(random_model), "--data", str(eval_parquet), "--scorer", value]) == 2
    err = capsys.readouterr().err
    assert said in err
    assert "Traceback" not in err
