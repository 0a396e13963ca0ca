"""Transcripts of rollouts (dapo.metrics.transcripts): what a person reads of a step."""

from __future__ import annotations

import json

import pytest

from dapo.data.records import PromptRecord
from dapo.handover import ScoredGroup
from dapo.metrics import MetricsLogger, TranscriptWriter, read_transcripts, transcript_records
from dapo.metrics.transcripts import format_transcript
from dapo.models.tiny import build_tokenizer

TOK = build_tokenizer()
EOS = TOK.eos_token_id
CALL = '<tool_call>{"name": "add", "arguments": {"numbers": [1, 2]}}</tool_call>'


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def single_turn(n: int = 4, uid: str = "u0") -> ScoredGroup:
    responses = [ids(f"Answer: {i}") + [EOS] for i in range(n - 1)] + [ids("Answer: 1234")]
    return ScoredGroup(
        prompt_ids=ids("1+2=?"),
        response_ids=responses,
        sample_logprobs=[[0.0] * len(r) for r in responses],
        truncated=[False] * (n - 1) + [True],
        rewards=[1.0, -1.0, -1.0, -1.5][:n],
        correct=[True, False, False, False][:n],
        record=PromptRecord("1+2=?", "3", "addition", uid),
        step=4,
        penalty=[0.0, 0.0, 0.0, -0.5][:n],
    )


def episode_group() -> ScoredGroup:
    first, reply, last = ids(CALL) + [EOS], ids("\nT: 3\nA: "), ids("Answer: 3") + [EOS]
    bad = ids("<tool_call>{oops</tool_call>") + [EOS]
    responses = [first + reply + last, bad]
    masks = [[1] * len(first) + [0] * len(reply) + [1] * len(last), [1] * len(bad)]
    return ScoredGroup(
        prompt_ids=ids("U: add 1 and 2\nA: "),
        response_ids=responses,
        sample_logprobs=[[0.0] * len(r) for r in responses],
        truncated=[False, False],
        rewards=[1.0, -1.0],
        correct=[True, False],
        record=PromptRecord("add 1 and 2", "3", "calculator", "c0"),
        step=7,
        penalty=[0.0, 0.0],
        model_mask=masks,
        episode_stats=[
            {"end": "done", "failure": None, "turns": 2},
            {"end": "bad_tool_call", "failure": "tool call is not valid JSON", "turns": 1},
        ],
    )


def test_an_episode_is_split_into_turns_with_roles_and_tool_calls():
    rec, bad = transcript_records(7, [episode_group()], [[0.7, -0.7]], TOK, k=2, seed=0)
    assert [t["role"] for t in rec["turns"]] == ["assistant", "environment", "assistant"]
    assert rec["turns"][0]["text"] == CALL  # decoded without its EOS
    assert rec["turns"][0]["tool_calls"] == [{"name": "add", "arguments": {"numbers": [1, 2]}}]
    assert rec["turns"][1] == {"role": "environment", "text": "\nT: 3\nA: ", "tokens": 9}
    assert rec["turns"][2] == {
        "role": "assistant",
        "text": "Answer: 3",
        "tokens": len("Answer: 3") + 1,
        "tool_calls": [],
    }
    assert (rec["end"], rec["failure"], rec["reward"], rec["advantage"]) == ("done", None, 1.0, 0.7)
    assert rec["prompt"] == "U: add 1 and 2\nA: " and rec["generated_step"] == 7
    assert rec["group_rewards"] == [1.0, -1.0] and rec["ground_truth"] == "3"
    (turn,) = bad["turns"]
    assert turn["tool_calls"] == [] and "not valid JSON" in turn["tool_call_error"]
    assert (bad["end"], bad["advantage"], bad["sample"]) == ("bad_tool_call", -0.7, 1)
    assert bad["failure"] == "tool call is not valid JSON"
    # One of them when one is asked for; no advantages: null.
    (one,) = transcript_records(7, [episode_group()], None, TOK, k=1, seed=0)
    assert one["advantage"] is None and one["sample"] in (0, 1)


def test_a_single_turn_sample_has_one_turn_and_its_reward_parts():
    recs = transcript_records(3, [single_turn()], [[1.5, -0.5, -0.5, -0.5]], TOK, k=4, seed=1)
    assert [r["sample"] for r in recs] == [0, 1, 2, 3]
    assert [r["end"] for r in recs] == ["eos", "eos", "eos", "truncated"]
    last = recs[3]
    assert last["turns"] == [
        {"role": "assistant", "text": "Answer: 1234", "tokens": 12, "tool_calls": []}
    ]
    assert (last["reward"], last["penalty"], last["score"], last["correct"]) == (
        -1.5,
        -0.5,
        -1.0,
        False,
    )
    assert recs[0]["prompt"] == "1+2=?" and recs[0]["data_source"] == "addition"


def test_samples_come_from_different_groups_and_the_choice_is_seeded():
    groups = [single_turn(uid=f"u{i}") for i in range(6)]
    a = transcript_records(2, groups, None, TOK, k=3, seed=9)
    assert len(a) == 3 and len({r["group"] for r in a}) == 3
    assert a == transcript_records(2, groups, None, TOK, k=3, seed=9)  # deterministic
    picks = {
        tuple((r["group"], r["sample"]) for r in transcript_records(s, groups, None, TOK, 3, 9))
        for s in range(8)
    }
    assert len(picks) > 1  # another step, other samples
    assert transcript_records(2, groups, None, TOK, k=0, seed=9) == []
    with pytest.raises(ValueError, match="2 advantage lists for 6 groups"):
        transcript_records(2, groups, [[0.0] * 4] * 2, TOK, k=3, seed=9)


def test_the_writer_appends_and_a_resume_drops_the_lines_after_its_step(tmp_path):
    groups = [single_turn(uid=f"u{i}") for i in range(3)]
    with TranscriptWriter(tmp_path) as w:
        for step in (1, 2, 3):
            w.write(transcript_records(step, groups, None, TOK, k=2, seed=0))
    assert [r["step"] for r in read_transcripts(tmp_path)] == [1, 1, 2, 2, 3, 3]
    with (tmp_path / "rollouts.jsonl").open("a") as f:
        f.write('{"step": 4, "gro')  # a crash mid-line
    with TranscriptWriter(tmp_path, resume_step=2) as w:
        w.write(transcript_records(3, groups, None, TOK, k=1, seed=0))
    assert [r["step"] for r in read_transcripts(tmp_path)] == [1, 1, 2, 2, 3]
    with TranscriptWriter(tmp_path):  # a new run starts the file empty
        pass
    assert read_transcripts(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="transcripts_per_step=0"):
        read_transcripts(tmp_path / "nowhere")


def test_format_shows_prompt_roles_tool_calls_and_outcome():
    recs = transcript_records(7, [episode_group()], [[0.7, -0.7]], TOK, k=2, seed=0)
    text = format_transcript(recs[0])
    assert "step 7  group 0  sample 0  reward +1.000  advantage +0.700  end done" in text
    assert "--- prompt (as the model saw it) ---\nU: add 1 and 2\nA: " in text
    assert '-> tool call add({"numbers": [1, 2]})' in text
    assert "--- environment (" in text and "group rewards: [1.0, -1.0]" in text
    assert "does not parse" in format_transcript(recs[1])


def test_the_logger_shows_transcripts_in_tensorboard_and_a_wandb_table(tmp_path, monkeypatch):
    logged = {}

    class WandbTable:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        def log(self, values, step):
            logged.update(values, step=step)

        def finish(self):
            pass

    class FakeWandb:
        Table = WandbTable

        @staticmethod
        def init(**kw):
            return Run()

    monkeypatch.setattr("dapo.metrics.logger._import_wandb", lambda: FakeWandb)
    recs = transcript_records(7, [episode_group()], [[0.7, -0.7]], TOK, k=2, seed=0)
    with MetricsLogger(tmp_path, total_steps=2, console=False, wandb=True) as lg:
        lg.log_transcripts(1, recs)
    table = logged["rollouts"]
    assert logged["step"] == 1 and table.columns[:5] == [
        "step",
        "group",
        "sample",
        "prompt",
        "transcript",
    ]
    assert table.data[0][4].startswith("[assistant] <tool_call>") and table.data[1][5] == -1.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("rollouts/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 1 and "tool call add" in text and json.dumps({"numbers": [1, 2]}) in text
