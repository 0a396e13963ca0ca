"""On-policy distillation (algorithm.teacher): the per-token advantage, the teacher's checks,
its scoring in process and over the rollout server, and a distillation-only run."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from learner_utils import backward, learner  # tests/learner_utils.py
from vllm_check import needs_vllm

from dapo import algorithms as alg
from dapo.algorithms import LossSettings
from dapo.config import load_config
from dapo.errors import ConfigError, TrainingError
from dapo.models.tiny import build_model, build_tokenizer
from dapo.rollout.fingerprint import Fingerprint
from dapo.rollout.server import RolloutServer
from dapo.rollout.server_client import ServerEngine
from dapo.rollout.weight_channel import free_port
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs
from dapo.training.teacher import ModelTeacher, ServerTeacher, Teacher, check_tokenizers
from dapo.training.trainer import Trainer


def test_per_token_advantage_is_the_hand_computed_one():
    task = torch.tensor([0.5, -1.0])
    teacher = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, 0.0]])
    student = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -2.0, 0.0]])
    sampled = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # row 1: an env token, padding
    out = alg.distill_advantages(task, teacher, student, sampled, coef=2.0)
    # 0.5 + 2*(-1 + 1.5), 0.5 + 2*(-2 + 1), 0.5 + 2*0 ; -1 + 2*(-0.25 + 1), -1, -1
    expected = torch.tensor([[1.5, -1.5, 0.5], [0.5, -1.0, -1.0]])
    assert torch.equal(out, expected)
    sums = alg.distill_sums(task, teacher, student, sampled, coef=2.0)
    # loss tokens: (0,0) (0,1) (0,2) (1,0); log pi_s - log pi_t: -0.5, 1, 0, -0.75
    assert sums == {
        "tokens": 4.0,
        "reverse_kl": -0.25,
        "teacher_logprob": -3.75,
        "teacher_abs": 2 * (0.5 + 1 + 0 + 0.75),
        "task_abs": 0.5 * 3 + 1.0,
    }
    m = alg.distill_metrics(sums)
    assert m["distill/reverse_kl"] == pytest.approx(-0.0625)
    assert m["distill/teacher_share"] == pytest.approx(4.5 / 7.0)


def test_no_gradient_flows_through_the_teacher_signal():
    student = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = alg.distill_advantages(
        torch.zeros(1), torch.tensor([[-0.5, -0.5]]), student, torch.ones(1, 2), 1.0
    )
    assert not out.requires_grad


def _samples(tok, texts: list[tuple[str, str]], adv: list[float]) -> list[Sample]:
    out = []
    for (prompt, response), a in zip(texts, adv, strict=True):
        p, r = tok.encode(prompt), tok.encode(response)
        out.append(Sample(p, r, a, [1.0] * len(r)))
    return out


TEXTS = [("12+3=", "15"), ("12+3=", "16 ok"), ("7+8=", "15"), ("7+8=", "1")]


@pytest.fixture(scope="module")
def models(tok):
    torch.manual_seed(0)
    return build_model(len(tok), seed=0).eval(), build_model(len(tok), seed=1).eval()


def test_a_teacher_equal_to_the_student_gives_exactly_zero_signal(tok, models, one_thread):
    student, _ = models
    settings = LossSettings()
    lrn = learner(student, settings, token_budget=4096)
    teacher = ModelTeacher(copy.deepcopy(student), lrn.forward)
    lrn.use_teacher(Teacher(teacher, coef=3.0, distill_only=False))
    samples = _samples(tok, TEXTS, [1.0, -1.0, 0.5, -0.5])
    metrics = lrn.update(samples, step=0, group_size=2)
    assert metrics["distill/reverse_kl"] == 0.0 and metrics["distill/teacher_share"] == 0.0
    for s in samples:
        assert torch.equal(s.token_advantages, torch.full((len(s.response_ids),), s.advantage))
    assert metrics["perf/teacher_s"] >= 0.0
    assert metrics["distill/teacher_logprob"] < 0.0


def test_environment_tokens_carry_no_teacher_signal(tok, models, one_thread):
    student, other = models
    opts = ForwardOptions(tok.pad_token_id)
    p, r = tok.encode("12+3="), tok.encode("15 => 15")
    model_mask = [1, 1, 0, 0, 0, 0, 1, 1]  # the middle: an environment's answer
    s = Sample(p, r, 0.75, [float(m) for m in model_mask], model_mask=model_mask)
    s.old_logprobs = compute_logprobs(student, [s], opts)[0]
    metrics = Teacher(ModelTeacher(other, opts), 1.0, distill_only=False).attach([s])
    env = torch.tensor(model_mask) == 0
    assert torch.equal(s.token_advantages[env], torch.full((int(env.sum()),), 0.75))
    assert (s.token_advantages[~env] != 0.75).all()  # the sampled tokens do get a signal
    t = compute_logprobs(other, [s], opts)[0]
    kl = (s.old_logprobs - t)[~env].mean()
    assert metrics["distill/reverse_kl"] == pytest.approx(float(kl), abs=1e-6)


def test_distill_only_replaces_the_task_advantage(tok, models, one_thread):
    student, other = models
    opts = ForwardOptions(tok.pad_token_id)
    samples = _samples(tok, TEXTS[:2], [1.0, -1.0])
    for s, lp in zip(samples, compute_logprobs(student, samples, opts), strict=True):
        s.old_logprobs = lp
    Teacher(ModelTeacher(other, opts), 0.5, distill_only=True).attach(samples)
    t = compute_logprobs(other, samples, opts)
    for s, lp in zip(samples, t, strict=True):
        assert s.advantage == 0.0
        torch.testing.assert_close(s.token_advantages, 0.5 * (lp - s.old_logprobs))


def test_micro_batch_splits_give_the_same_gradient(tok, models, one_thread):
    student, other = models
    opts = ForwardOptions(tok.pad_token_id)
    grads = []
    for budget in (4096, 8):  # one micro-batch; one or two samples each
        model = copy.deepcopy(student).train()
        samples = _samples(tok, TEXTS, [1.0, -1.0, 0.5, -0.5])
        for s, lp in zip(samples, compute_logprobs(model, samples, opts), strict=True):
            s.old_logprobs = lp
        Teacher(ModelTeacher(other, opts), 1.0, distill_only=False).attach(samples)
        backward(model, samples, LossSettings(), token_budget=budget)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)


def test_the_tokenizer_check_refuses_a_mismatched_pair_in_one_message(tok):
    check_tokenizers(tok, build_tokenizer(), "student-dir", "teacher-dir")  # the same: passes
    other = build_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    with pytest.raises(TrainingError) as info:
        check_tokenizers(tok, other, "student-dir", "teacher-dir")
    msg = str(info.value)
    assert "teacher-dir" in msg and "student-dir" in msg
    assert "vocabularies of" in msg and "'<tool>'" in msg and "special tokens only" in msg
    assert msg.count("algorithm.teacher") == 1


# --- the run: configuration, start-up checks, distillation alone ------------------------------


def _config(student: Path, out: Path, *extra: str):
    return load_config(
        overrides=[
            f"model.name_or_path={student}",
            f"output_dir={out}",
            "train.steps=2",
            "train.prompts_per_step=2",
            "train.mini_batch_size=2",
            "rollout.num_generations=2",
            "rollout.max_completion_length=8",
            "algorithm.overlong_buffer=4",
            "evaluate=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "logging.console=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            "reward.num_workers=0",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("teacher")
    build_model(len(tok), seed=7).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_distill_only_runs_with_no_reward_function(random_tiny_model, teacher_dir, tmp_path):
    cfg = _config(
        random_tiny_model,
        tmp_path / "run",
        f"algorithm.teacher={teacher_dir}",
        "algorithm.distill_only=true",
        "algorithm.overlong_filter=false",  # the random student rarely ends a response
    )
    trainer = Trainer(cfg, log=lambda _: None)

    def no_reward(*args, **kwargs):
        raise AssertionError("distill_only must call no reward function")

    trainer.rollouts.scorer.rewards.score_groups = no_reward
    trainer.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/updates" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["actor/updates"] == 1.0 and r["reward/failures"] == 0.0
        assert r["sampling/trained_groups"] == 2.0  # uniform (all-zero) groups are not dropped
        assert r["distill/teacher_share"] == 1.0 and r["distill/reverse_kl"] != 0.0
        assert "perf/teacher_s" in r
        # Nothing was scored: no reward or train accuracy that would read 0.
        assert not {"reward/mean", "reward/acc", "reward/std"} & r.keys()


def test_a_teacher_that_cannot_be_loaded_stops_before_training(random_tiny_model, tmp_path):
    cfg = _config(random_tiny_model, tmp_path / "run", "algorithm.teacher=./no/such/teacher")
    with pytest.raises(TrainingError, match=r"`algorithm.teacher` = './no/such/teacher'"):
        Trainer(cfg, log=lambda _: None)


def test_a_mismatched_teacher_stops_before_training(random_tiny_model, tmp_path, tok):
    other = build_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    path = tmp_path / "teacher"
    build_model(len(other), seed=3).save_pretrained(path)
    other.save_pretrained(path)
    cfg = _config(random_tiny_model, tmp_path / "run", f"algorithm.teacher={path}")
    with pytest.raises(TrainingError, match="is not the student's"):
        Trainer(cfg, log=lambda _: None)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_teacher_server_that_is_down_is_one_clear_error(random_tiny_model, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    cfg = _config(
        random_tiny_model,
        tmp_path / "run",
        f"algorithm.teacher=server:{url}",
        "rollout.server_timeout_s=1",
    )
    with pytest.raises(TrainingError, match=rf"`algorithm.teacher` = 'server:{url}'.*no rollout"):
        Trainer(cfg, log=lambda _: None)


def test_the_config_rules_of_distillation():
    with pytest.raises(ConfigError, match="`algorithm.distill_only` = True is invalid"):
        load_config(overrides=["algorithm.distill_only=true"])
    with pytest.raises(ConfigError, match="`rollout.temperature` = 0.7 is invalid"):
        load_config(overrides=["algorithm.teacher=server:http://h:1", "rollout.temperature=0.7"])
    with pytest.raises(ConfigError, match="`algorithm.skip_uniform_prompts` = True is invalid"):
        load_config(
            overrides=[
                "algorithm.teacher=x",
                "algorithm.distill_only=true",
                "algorithm.skip_uniform_prompts=true",
            ]
        )
    with pytest.raises(ConfigError, match="`algorithm.distill_coef` = 0"):
        load_config(overrides=["algorithm.teacher=x", "algorithm.distill_coef=0"])


class ScoringEngine:
    """A rollout-server engine that only scores: prompt log-probs of a tiny model."""

    max_model_len, eos_token_id, on_cpu = 64, 1, True

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.llm = SimpleNamespace(collective_rpc=lambda *a, **k: [None])

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        out = []
        for seq in sequences:
            logits = self.model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])
            out.append(lp[:, 0].tolist())
        return out

    def close(self) -> None:
        pass


def test_a_server_teacher_scores_as_the_model_teacher_does(tok, models, one_thread):
    _, other = models
    fp = Fingerprint(len(tok), 1, None, name="teacher")
    srv = RolloutServer(ScoringEngine(other), model="teacher", fingerprint=fp)
    port = free_port()
    srv.start("127.0.0.1", port)
    try:
        client = ServerEngine(f"http://127.0.0.1:{port}", max_model_len=32, eos_token_id=1)
        samples = _samples(tok, TEXTS, [0.0] * 4)
        remote = ServerTeacher(client).logprobs(samples)
        local = ModelTeacher(other, ForwardOptions(tok.pad_token_id)).logprobs(samples)
        for a, b in zip(remote, local, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    finally:
        srv.close()


ENVS = Path(__file__).with_name("sample_environments.py")


@pytest.mark.slow
def test_multi_turn_episodes_get_no_teacher_signal_on_environment_tokens(
    tool_model, teacher_dir, tmp_path, one_thread
):
    cfg = _config(
        tool_model,
        tmp_path / "run",
        f"algorithm.teacher={teacher_dir}",
        "data.train=builtin:calculator",
        f"rollout.environment={ENVS}:TwoTurns",
        "rollout.max_turns=2",
        "rollout.max_completion_length=80",
        "algorithm.overlong_buffer=8",
        "algorithm.overlong_filter=false",
        "algorithm.dynamic_sampling=false",
        "train.prompts_per_step=4",
        "rollout.num_generations=4",
        "train.steps=1",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    seen: list[Sample] = []
    attach = trainer.learner.teacher.attach

    def record(samples):
        out = attach(samples)
        seen.extend(samples)
        return out

    trainer.learner.teacher.attach = record
    trainer.run()
    env_tokens = 0
    for s in seen:
        env = s.sampled() == 0
        env_tokens += int(env.sum())
        assert torch.equal(s.token_advantages[env], torch.full((int(env.sum()),), s.advantage))
    assert env_tokens > 0 and any((s.token_advantages != s.advantage).any() for s in seen)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_rank_lora_distillation_runs_and_resumes(
    mode, random_tiny_model, teacher_dir, tmp_path
):
    from ranks import torchrun

    out = tmp_path / "run"
    common = [
        "-m",
        "dapo",
        "train",
        f"model.name_or_path={random_tiny_model}",
        f"output_dir={out}",
        f"algorithm.teacher={teacher_dir}",
        "algorithm.distill_only=true",
        "train.prompts_per_step=4",
        "train.mini_batch_size=2",
        "rollout.num_generations=2",
        "rollout.max_completion_length=8",
        "algorithm.overlong_buffer=4",
        "algorithm.overlong_filter=false",
        "evaluate=false",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "checkpoint.save_every=1",
        "checkpoint.save_final_model=false",
        f"train.data_parallel={mode}",
        "model.lora.rank=4",
    ]
    torchrun(*common, "train.steps=1", cwd=tmp_path)
    torchrun(*common, "train.steps=2", "resume=true", cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 1 and summary["steps"] == 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill/reverse_kl" in r]
    assert len(steps) == 2 and all(r["distill/teacher_share"] == 1.0 for r in steps)


def test_a_teacher_server_of_another_vocabulary_is_refused_at_connect(tok):
    from dapo.training.teacher import load_teacher

    small = Fingerprint(10, 1, None, name="other-model")
    srv = RolloutServer(ScoringEngine(None), model="other-model", fingerprint=small)
    port = free_port()
    srv.start("127.0.0.1", port)
    try:
        cfg = load_config(
            overrides=[
                f"algorithm.teacher=server:http://127.0.0.1:{port}",
                "data.max_prompt_length=32",
                "rollout.max_completion_length=8",
                "algorithm.overlong_buffer=4",
            ]
        )
        with pytest.raises(TrainingError) as info:
            load_teacher(cfg, tok, log=lambda _: None)
    finally:
        srv.close()
    assert str(info.value).startswith(
        f"`algorithm.teacher` = 'server:http://127.0.0.1:{port}' serves another model than a "
        f"teacher of the student: other-model has a vocabulary of 10 tokens, the student's "
        f"tokenizer {len(tok)}"
    )


def test_the_example_config_is_a_distillation_run():
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "distill.yaml")
    a = cfg.algorithm
    assert (a.teacher, a.distill_only, cfg.model.name_or_path) == (
        "builtin:tiny-long",
        True,
        "builtin:tiny",
    )


@needs_vllm
@pytest.mark.slow
def test_distillation_with_the_vllm_engine(random_tiny_model, teacher_dir, tmp_path, one_thread):
    cfg = _config(
        random_tiny_model,
        tmp_path / "run",
        f"algorithm.teacher={teacher_dir}",
        "algorithm.distill_only=true",
        "algorithm.overlong_filter=false",
        "rollout.engine=vllm",
    )
    Trainer(cfg, log=lambda _: None).run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill/reverse_kl" in r]
    assert len(steps) == 2 and all(r["distill/reverse_kl"] != 0.0 for r in steps)
    assert all("rollout/logprob_mismatch" in r for r in steps)  # the old log-probs: the trainer's


def test_a_bad_score_request_gets_a_400_naming_the_field(tok, models):
    import urllib.error
    import urllib.request

    _, other = models
    srv = RolloutServer(ScoringEngine(other), model="t", fingerprint=Fingerprint(len(tok), 1, None))
    port = free_port()
    srv.start("127.0.0.1", port)
    try:
        for body, expected in [
            ({"sequences": [[5]]}, "`sequences[0]` has 1 token: scoring needs at least 2"),
            ({"sequences": [[5, 10_000]]}, "`sequences[0][1]` = 10000 is not a token id"),
            ({"prompts": [[5, 6]]}, "unknown field `prompts` in POST /score"),
        ]:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/score",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=30)
            assert info.value.code == 400
            assert expected in json.loads(info.value.read())["error"]
    finally:
        srv.close()
