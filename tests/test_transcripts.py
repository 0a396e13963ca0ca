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


def labelled_group(g: int, uid: str, n: int = 4) -> ScoredGroup:
    """A group of ``n`` whose every response names its group and sample ("g3 s1")."""
    responses = [ids(f"g{g} s{i}") + [EOS] for i in range(n)]
    return ScoredGroup(
        prompt_ids=ids(f"{g}+0=?"),
        response_ids=responses,
        sample_logprobs=[[0.0] * len(r) for r in responses],
        truncated=[False] * n,
        rewards=[-1.0] * n,
        correct=[False] * n,
        record=PromptRecord(f"{g}+0=?", str(g), "addition", uid),
        step=1,
        penalty=[0.0] * n,
    )


def test_left_out_groups_are_labelled_with_their_own_group_and_sample(tmp_path):
    """Transcripts of the groups left out of training name each its own group (numbered on
    after the trained ones, in generation order) and the sample shown, one group each."""
    from dapo.config import load_config
    from dapo.health import HealthMonitor
    from dapo.training.record import RunRecord

    cfg = load_config(
        overrides=[
            f"output_dir={tmp_path}",
            "logging.transcripts_per_step=5",
            "logging.console=false",
            "logging.tensorboard=false",
        ]
    )
    record = RunRecord(
        cfg,
        tmp_path,
        resumed_from=None,
        is_main=True,
        tokenizer=TOK,
        parser=lambda _: [],
        health=HealthMonitor(cfg, warn=False),
    )
    trained = [labelled_group(0, "t0", n=1)]
    left_out = [(labelled_group(1 + j, f"x{j}"), f"reason {j}") for j in range(6)]
    record.step(1, {}, trained, [[0.0]], left_out)
    record.close()
    recs = read_transcripts(tmp_path)
    shown = [r for r in recs if r.get("left_out")]
    assert len(recs) == 5 and len(shown) == 4  # one trained sample, then the left-out
    pairs = [(r["group"], r["sample"]) for r in shown]
    assert len({g for g, _ in pairs}) == 4  # four different groups, none labelled alike
    assert len({s for _, s in pairs}) > 1  # not every group's same sample
    for r in shown:
        j = r["group"] - len(trained)
        assert 0 <= j < len(left_out)
        assert r["uid"] == f"x{j}" and r["left_out"] == f"reason {j}"
        assert r["turns"][0]["text"] == f"g{1 + j} s{r['sample']}"  # that very sample
        assert "NOT TRAINED" in format_transcript(r)
        assert f"group {r['group']}  sample {r['sample']}" in format_transcript(r)
    (kept,) = [r for r in recs if not r.get("left_out")]
    assert kept["group"] == 0 and kept["uid"] == "t0"


@pytest.mark.usefixtures("one_thread")
def test_a_step_that_leaves_out_every_group_labels_each_by_its_real_indices(
    random_tiny_model, tmp_path, monkeypatch
):
    """A run's step whose groups are all left out (every response wrong): its transcripts'
    (group, sample) pairs are distinct and name the group the producer left out at that
    index, and the response shown is that sample's."""
    import warnings
    from pathlib import Path

    from dapo.config import load_config
    from dapo.training.record import RunRecord
    from dapo.training.trainer import Trainer

    rewards = Path(__file__).with_name("trainer_rewards.py")
    seen: dict[int, list[tuple[str, list[str]]]] = {}
    step = RunRecord.step

    def watch(self, n, metrics, groups, advantages, left_out=()):
        assert not groups  # every group all wrong: none trained
        seen[n] = [(g.record.uid, [TOK.decode(r) for r in g.response_ids]) for g, _ in left_out]
        return step(self, n, metrics, groups, advantages, left_out)

    monkeypatch.setattr(RunRecord, "step", watch)
    cfg = load_config(
        overrides=[
            f"model.name_or_path={random_tiny_model}",
            f"output_dir={tmp_path}",
            "train.steps=1",
            "train.prompts_per_step=4",
            "rollout.num_generations=4",
            "rollout.max_completion_length=8",
            "algorithm.overlong_buffer=4",
            "algorithm.max_gen_rounds=2",
            "logging.transcripts_per_step=6",
            "evaluate=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            "reward.num_workers=0",
            f"reward.functions=[{{name: '{rewards}:always_wrong'}}]",
        ]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(cfg, log=lambda _: None).run()
    recs = read_transcripts(tmp_path)
    groups = seen[1]
    assert len(groups) >= 8 and len(recs) == 6  # two rounds of 4 prompts or more, all left out
    assert len({(r["group"], r["sample"]) for r in recs}) == 6
    assert len({r["group"] for r in recs}) == 6  # from six different groups
    for r in recs:
        uid, responses = groups[r["group"]]
        assert r["uid"] == uid and r["left_out"].startswith("filtered out by dynamic sampling")
        text = "".join(t["text"] for t in r["turns"])
        assert responses[r["sample"]].startswith(text)  # shown without its EOS
