"""The built-in code scorer: test layouts, output comparison, scores and logged fields, the
checks before training, and the refusal where no sandbox can be had."""

from __future__ import annotations

import json
import sys
import time

import pytest

from dapo.config import load_config
from dapo.data.records import PromptRecord
from dapo.errors import ConfigError, DataError
from dapo.rewards import SCORERS, RewardScorer, ScoreRequest, sandbox, scorer_for_source
from dapo.rewards import code as code_module
from dapo.rewards.code import UNISOLATED_WARNING, code_reward, extract_program
from dapo.rewards.code_tests import TestSpecError, outputs_match, parse_tests, values_match

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces"
)

SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
STDIN = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7\n"]}


def test_the_three_layouts_score_a_right_and_a_wrong_program():
    deepcoder = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    open_r1 = {
        "language": "python",
        "test_cases": [{"input": "5 5", "output": "10", "type": "stdin_stdout"}],
    }
    for truth in (STDIN, json.dumps(STDIN), deepcoder, json.dumps(deepcoder), open_r1):
        assert code_reward(SUM, truth)["score"] == 1.0, truth
        assert code_reward(SUM.replace("a + b", "a * b"), truth)["score"] == -1.0, truth


def test_function_call_tests_in_verl_and_deepcoder_layouts():
    program = "```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```"
    verl = {"fn_name": "add", "inputs": [[1, 2], [0.1, 0.2]], "outputs": [[3], 0.3]}
    deepcoder = {
        "fn_name": "add",
        "tests": [{"input": "1\n2", "output": "3", "testtype": "functional"}],
    }
    assert code_reward(program, verl)["score"] == 1.0  # [3] (APPS's wrap) and 0.1+0.2~0.3
    assert code_reward(program, deepcoder)["score"] == 1.0
    top_level = "```python\ndef add(a, b):\n    return a - b\n```"
    assert code_reward(top_level, verl)["score"] == -1.0


def test_outputs_compare_as_livecodebench_does():
    assert outputs_match("3  \r\n4\r\n\r\n", "3\n4")  # trailing spaces, CRLF, blank lines
    assert outputs_match("0.3333333", "0.33333333")  # numbers within the tolerance
    assert not outputs_match("0.33", "0.3333333")
    assert not outputs_match("3 4", "3 5") and not outputs_match("3", "3 4")
    assert not outputs_match("abc", "abd")
    assert values_match([1, 2.0000000001], [1, 2]) and values_match(5, [5])
    assert not values_match(True, 1) and not values_match([1, 2], [2, 1])


def test_partial_credit_and_the_logged_fields():
    half = "```python\nx = input()\nprint(3 if x.startswith('1') else 0)\n```"
    out = code_reward(half, STDIN, partial_credit=True)
    assert out["pass_rate"] == pytest.approx(1 / 3)
    assert out["score"] == pytest.approx(2 / 3 - 1) and out["acc"] == 0.0
    assert code_reward(half, STDIN)["score"] == -1.0  # DAPO's rule: all or nothing
    broken = code_reward("```python\ndef f(:\n```", STDIN)
    assert broken["compile_error"] == 1.0 and broken["score"] == -1.0
    crash = code_reward("```python\nraise ValueError('no')\n```", STDIN)
    assert crash["runtime_error"] == 1.0 and crash["timeout"] == 0.0
    slow = code_reward("```python\nwhile True: pass\n```", STDIN, test_timeout_s=0.5)
    assert slow["timeout"] == 1.0 and slow["pass_rate"] == 0.0


def test_the_program_is_the_last_python_block_or_the_whole_response():
    assert extract_program("```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_program("print(5)") == "print(5)"
    assert extract_program("print(5)", require_block=True) is None
    assert extract_program("```cpp\nint main(){}\n```") is None
    out = code_reward("a, b = map(int, input().split())\nprint(a + b)", STDIN)
    assert out["score"] == 1.0
    assert code_reward("print(3)", STDIN, require_block=True)["compile_error"] == 1.0


def test_malformed_specs_say_what_is_wrong():
    for truth, said in (
        ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
        ({"inputs": [], "outputs": []}, "empty"),
        ("not json", "not JSON"),
        ({"language": "cpp", "test_cases": []}, "only Python"),
        ([{"input": "1", "output": "2", "testtype": "functional"}], "names no function"),
        ({"question": "?"}, "none of"),
    ):
        with pytest.raises(TestSpecError, match=said):
            parse_tests(truth)


def test_a_malformed_row_is_refused_before_training_naming_it():
    with RewardScorer([("code", 1.0)], num_workers=0) as scorer:
        records = [PromptRecord("p", STDIN, "x"), PromptRecord("q", {"inputs": ["1"]}, "x")]
        with pytest.raises(DataError, match=r"train.jsonl: row 7: field 'tests'.*outputs"):
            scorer.check_records(records, [("train.jsonl", 3), ("train.jsonl", 7)], "tests")
    with RewardScorer(num_workers=0) as scorer:  # math rows are not the code scorer's
        scorer.check_records([PromptRecord("p", "5", "math_dapo")], [("f", 0)], "answer")
        assert scorer.answers == "text"


def test_code_data_sources_get_the_code_scorer():
    for source in (
        "codecontests",
        "deepmind/code_contests",
        "apps",
        "codeparrot/apps",
        "likaixin/TACO-verified",
        "livecodebench",
        "primeintellect",
        "PrimeIntellect/verifiable-coding-problems",
        "open-r1/codeforces",
    ):
        assert scorer_for_source(source) == "code", source
    for source in ("math_dapo", "PrimeIntellect/verifiable-math-problems", "openai/gsm8k", "happs"):
        assert scorer_for_source(source) != "code", source
    assert scorer_for_source("apps", {"apps": "dapo_math"}) == "dapo_math"
    assert "code" in SCORERS


def test_a_groups_programs_at_their_time_limit_cost_about_one_limit():
    loop = "```python\nimport time\ntime.sleep(60)\n```"
    requests = [ScoreRequest(loop, STDIN, "codecontests") for _ in range(6)]
    with RewardScorer(num_workers=1, timeout_s=10, code={"test_timeout_s": 1.0}) as scorer:
        scorer.score_grouped([ScoreRequest(SUM, STDIN, "codecontests")], [1])  # warm
        start = time.monotonic()
        rewards, _, result = scorer.score_grouped(requests, [6])
        took = time.monotonic() - start
    assert rewards == [[-1.0] * 6] and result.failures == 0
    assert all(info["timeout"] == 1.0 for info in result.infos)
    assert took < 1.9, f"6 programs at a 1 s limit took {took:.2f} s"


def test_the_settings_reach_the_workers_from_the_config():
    cfg = load_config(None, ["reward.code.partial_credit=true", "reward.functions=[code]"])
    from dataclasses import asdict

    half = "```python\nx = input()\nprint(3 if x.startswith('1') else 0)\n```"
    with RewardScorer([("code", 1.0)], num_workers=1, code=asdict(cfg.reward.code)) as scorer:
        result = scorer.score([ScoreRequest(half, STDIN)])
    assert result.rewards == [pytest.approx(2 / 3 - 1)]
    assert result.infos[0]["pass_rate"] == pytest.approx(1 / 3)
    assert scorer.answers == "any"  # a dict of tests is a valid answer


def test_without_a_sandbox_the_scorer_refuses_unless_told_none(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    sandbox.isolation_problem.cache_clear()
    try:
        assert "not installed" in sandbox.isolation_problem()
        with pytest.raises(sandbox.SandboxUnavailable, match="reward.code.sandbox=none"):
            code_reward(SUM, STDIN)
        record = PromptRecord("p", STDIN, "codecontests")
        with (
            RewardScorer(num_workers=0) as scorer,
            pytest.raises(ConfigError, match="apt-get install bubblewrap"),
        ):
            scorer.check_records([record], [("f", 0)], "tests")
        with RewardScorer(num_workers=0, code={"sandbox": "none"}) as scorer:
            scorer.check_records([record], [("f", 0)], "tests")
            assert UNISOLATED_WARNING in scorer.describe(["codecontests"])
            assert scorer.describe(["math_dapo"]) == scorer.describe(["math_dapo"])[:1]
            assert scorer.score([ScoreRequest(SUM, STDIN, "codecontests")]).rewards == [1.0]
        assert code_module.code_reward(SUM, STDIN, sandbox="none")["score"] == 1.0
    finally:
        sandbox.isolation_problem.cache_clear()


def test_unknown_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown setting.*timeout_seconds"):
        code_reward(SUM, STDIN, timeout_seconds=3)
