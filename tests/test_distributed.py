"""Data-parallel training with torch.distributed: 2 gloo ranks on CPU."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from ranks import forked, torchrun  # tests/ranks.py

from dapo.parallel import distributed as D

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def test_destroy_waits_for_every_rank_before_leaving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leaving while a peer still has collectives in flight aborted a gloo rank; the barrier
    must come first. Without a process group, destroy does nothing."""
    calls: list[str] = []
    monkeypatch.setattr(D.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(D.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(D.dist, "destroy_process_group", lambda: calls.append("destroy"))
    D.destroy()
    assert calls == ["barrier", "destroy"]
    calls.clear()
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    D.destroy()
    assert calls == []


def test_balance_by_tokens_spreads_the_load() -> None:
    parts = D.balance_by_tokens([100, 1, 50, 50, 2, 97], 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    loads = [sum([100, 1, 50, 50, 2, 97][i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 4


def _small_run(model: Path, out: Path) -> list[str]:
    """``-m dapo train`` arguments of a 4-prompt run with a checkpoint every step."""
    return [
        "-m",
        "dapo",
        "train",
        f"model.name_or_path={model}",
        f"output_dir={out}",
        "train.prompts_per_step=4",
        "train.mini_batch_size=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=12",
        "algorithm.overlong_buffer=4",
        "algorithm.dynamic_sampling=false",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "checkpoint.save_every=1",
        "train.micro_batch_tokens=60",
    ]


def _dist_worker():
    sys.path.insert(0, str(HERE))
    try:
        import dist_worker
    finally:
        sys.path.remove(str(HERE))
    return dist_worker


@pytest.fixture(scope="module")
def two_rank_steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One optimizer step on 2 ranks with each wrapper (ddp, fsdp), run once per module."""
    tmp = tmp_path_factory.mktemp("steps")
    results = {}
    for mode in ("ddp", "fsdp"):
        torchrun(str(HERE / "dist_worker.py"), "step", mode, str(tmp / f"{mode}.pt"), cwd=tmp)
        results[mode] = torch.load(tmp / f"{mode}.pt")
        results[mode]["checkpoint"] = tmp / f"checkpoints-{mode}" / "step_000001"
    return results


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_make_the_same_step_as_one_process(mode: str, two_rank_steps: dict) -> None:
    from dapo.training.microbatch import micro_batches

    dist_worker = _dist_worker()
    # The ranks really hold different responses, with truncated ones among them, and
    # different numbers of micro-batches (FSDP pads the shorter rank with zero-loss passes).
    batch = dist_worker.fixed_batch()
    parts = D.balance_by_tokens([s.length for s in batch], 2)
    for part in parts:
        assert len({len(batch[i].response_ids) for i in part}) > 1
    assert any(sum(batch[i].loss_mask) == 0 for i in parts[0]) or any(
        sum(batch[i].loss_mask) == 0 for i in parts[1]
    )
    budget = dist_worker.TOKEN_BUDGET[mode]
    chunks = [micro_batches([batch[i] for i in p], budget) for p in parts]
    if mode == "fsdp":
        assert len(chunks[0]) != len(chunks[1])
    else:  # some micro-batches forward a shared prompt once for several responses
        shared = [
            [len({tuple(batch[part[i]].prompt_ids) for i in c}) < len(c) for c in ch]
            for part, ch in zip(parts, chunks, strict=True)
        ]
        assert any(map(any, shared)) and not all(map(all, shared))
        assert shared[0][-1] != shared[1][-1]
        # and some of those have several prompts: their shared first tokens go once (the
        # workers' PASS_COST is 0), then the prompts' rest, all under DDP's one forward
        assert any(
            1 < len({tuple(batch[part[i]].prompt_ids) for i in c}) < len(c)
            for part, ch in zip(parts, chunks, strict=True)
            for c in ch
        )
    two_ranks = two_rank_steps[mode]
    torch.set_num_threads(1)
    single = dist_worker.one_step("single")
    from dapo.models.tiny import build_model, build_tokenizer

    initial = build_model(len(build_tokenizer()), seed=3).double().state_dict()
    moved = 0.0
    assert set(two_ranks["params"]) == set(single["params"])
    for name, value in single["params"].items():
        torch.testing.assert_close(two_ranks["params"][name], value, atol=1e-5, rtol=0)
        moved = max(moved, float((value - initial[name]).abs().max()))
    assert moved > 1e-4  # the step did change the weights
    # The gradient norm (clipped to 1.0 here) is the global one on every rank.
    assert two_ranks["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-9)
    assert single["grad_norm"] > 1.0
    # The checkpointed optimizer state has the single-process format and values, and the
    # checkpoint loads back into a fresh (wrapped or sharded) model and optimizer.
    assert two_ranks["optimizer"]["param_groups"] == single["optimizer"]["param_groups"]
    assert two_ranks["optimizer"]["state"].keys() == single["optimizer"]["state"].keys()
    for i, state in single["optimizer"]["state"].items():
        for key, value in state.items():
            got = two_ranks["optimizer"]["state"][i][key]
            torch.testing.assert_close(got, value, atol=1e-5, rtol=0)
    assert two_ranks["reload_error"] == 0.0


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_every_loss_variant_makes_the_same_step_on_two_ranks(mode: str, tmp_path: Path) -> None:
    """GSPO and CISPO with masked importance sampling (sequence / token), Clip-Cov, KL-Cov
    with the entropy bonus: one 2-rank step equals the single-process step, selection and
    denominators included (they are global over the mini-batch)."""
    torchrun(str(HERE / "dist_worker.py"), "variants", mode, str(tmp_path / "v.pt"), cwd=tmp_path)
    two_ranks = torch.load(tmp_path / "v.pt")
    dist_worker = _dist_worker()
    torch.set_num_threads(1)
    for name in dist_worker.variant_settings():
        single = dist_worker.variant_step("single", name)
        got = two_ranks[name]
        for key, value in single["params"].items():
            torch.testing.assert_close(got["params"][key], value, atol=1e-5, rtol=0)
        assert got["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-6)
        assert got["loss"] == pytest.approx(single["loss"], rel=1e-6, abs=1e-9)
        assert got["selection"] == single["selection"]
        if "cov" in name:
            assert single["selection"]["actor/cov_selected_frac"] > 0.05


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_lora_step_on_two_ranks_equals_one_process(mode: str, tmp_path: Path) -> None:
    """LoRA under DDP and FSDP2 (frozen base parameters beside trainable adapters in every
    sharded layer): the 2-rank step equals the single-process one, and the checkpointed
    state (adapters and their AdamW moments only) reloads into a fresh wrapped model."""
    torchrun(str(HERE / "dist_worker.py"), "lora", mode, str(tmp_path / "l.pt"), cwd=tmp_path)
    two_ranks = torch.load(tmp_path / "l.pt")
    dist_worker = _dist_worker()
    torch.set_num_threads(1)
    single = dist_worker.one_step("single", lora_rank=4)
    assert set(single["params"]) == set(two_ranks["params"])
    assert single["params"] and all(".lora_" in n for n in single["params"])
    initial = {
        n: p.detach()
        for n, p in dist_worker._model_and_optimizer("single", lora_rank=4)[0].named_parameters()
    }
    for name, value in single["params"].items():
        torch.testing.assert_close(two_ranks["params"][name], value, atol=1e-6, rtol=0)
    assert max(float((v - initial[n]).abs().max()) for n, v in single["params"].items()) > 1e-4
    assert two_ranks["grad_norm"] == pytest.approx(
        single["grad_norm"], rel=1e-6
    )  # float32 gradients: the norm's last bits follow the reduction order
    assert len(single["optimizer"]["state"]) == len(single["params"])
    for i, state in single["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(
                two_ranks["optimizer"]["state"][i][key], value, atol=1e-6, rtol=0
            )
    assert two_ranks["reload_error"] == 0.0
    # The checkpoint holds the adapters (and their AdamW state) only, in either format.
    ckpt = tmp_path / f"checkpoints-lora-{mode}" / "step_000001"
    if mode == "fsdp":  # torch.distributed.checkpoint shards
        from torch.distributed.checkpoint import FileSystemReader

        keys = set(FileSystemReader(ckpt / "model_optim").read_metadata().state_dict_metadata)
        model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
        assert all(".lora_" in k for k in keys if not k.startswith("optim.param_groups")), keys
    else:
        from safetensors.torch import load_file

        model_keys = set(load_file(str(ckpt / "model.safetensors")))
    assert model_keys == set(single["params"])


@pytest.mark.parametrize(("mode", "lora"), [("ddp", False), ("fsdp", False), ("ddp", True)])
def test_packed_steps_on_two_ranks_equal_one_unpacked_process(
    mode: str, lora: bool, tmp_path: Path
) -> None:
    """Packed micro-batches of a token budget, on two ranks under DDP (with and without LoRA)
    and FSDP2: the step of one process that forwards unpacked."""
    argv = ["packed", mode, str(tmp_path / "p.pt"), *(["lora"] if lora else [])]
    torchrun(str(HERE / "dist_worker.py"), *argv, cwd=tmp_path)
    two_ranks = torch.load(tmp_path / "p.pt")
    assert min(two_ranks["packed_rows"]) >= 2  # each rank forwarded packed micro-batches
    dist_worker = _dist_worker()
    torch.set_num_threads(1)
    single = dist_worker.one_step("single", lora_rank=4 if lora else 0)
    assert set(two_ranks["params"]) == set(single["params"])
    for name, value in single["params"].items():
        torch.testing.assert_close(two_ranks["params"][name], value, atol=1e-5, rtol=0)
    assert two_ranks["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-6)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_rank_lora_run_resumes_and_exports_merged(
    mode: str, random_tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    common = [
        *_small_run(random_tiny_model, out),
        "evaluate=false",
        f"train.data_parallel={mode}",
        "model.lora.rank=4",
        "train.lr=1e-2",
        "algorithm.beta=0.01",  # the reference: the base, adapters disabled (FSDP gathers it)
    ]
    torchrun(*common, "train.steps=2", cwd=tmp_path)
    torchrun(*common, "train.steps=3", "resume=true", cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    from transformers import AutoModelForCausalLM

    from dapo.config import LoraConfig
    from dapo.models.lora import apply_lora, merge_state, scalings
    from dapo.training.checkpoint import load_checkpoint

    # The last checkpoint's adapters on the base model, merged, are the exported model.
    model = AutoModelForCausalLM.from_pretrained(random_tiny_model)
    apply_lora(model, LoraConfig(rank=4))
    load_checkpoint(out / "checkpoints" / "step_000003", model)
    final = AutoModelForCausalLM.from_pretrained(out / "final_model").state_dict()
    merged = merge_state(model.state_dict(), scalings(model))
    base = AutoModelForCausalLM.from_pretrained(random_tiny_model).state_dict()
    assert set(final) == set(base)
    for name, value in final.items():
        torch.testing.assert_close(value, merged[name], atol=1e-6, rtol=0)
    assert any(not torch.equal(final[n], base[n]) for n in base)


def test_fsdp_checkpoint_is_written_in_shards_and_loads_into_one_process(
    two_rank_steps: dict,
) -> None:
    """Each FSDP rank wrote its own shards (torch.distributed.checkpoint, nothing gathered);
    a single process without a process group loads them into a plain model and optimizer
    (another world size): exactly the state the two ranks held."""
    ckpt = two_rank_steps["fsdp"]["checkpoint"]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "dapo-manifest.json",
        "model_optim",
        "trainer_state.pt",
    ]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {
        p.name for p in (ckpt / "model_optim").iterdir()
    }
    assert (ckpt.parent.parent / "checkpoints-ddp" / "step_000001" / "model.safetensors").is_file()
    from dapo.models.tiny import build_model, build_tokenizer
    from dapo.parallel.sharding import full_optimizer_state
    from dapo.training.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    model = build_model(len(build_tokenizer()), seed=5).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    assert load_checkpoint(ckpt, model, opt) == {"step": 1}
    saved = two_rank_steps["fsdp"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved["params"][name]), name
    state = full_optimizer_state(model, opt)
    assert state["param_groups"] == saved["optimizer"]["param_groups"]
    for i, s in saved["optimizer"]["state"].items():
        for key, value in s.items():
            assert torch.equal(state["state"][i][key], value), (i, key)


def test_fsdp_shards_the_parameters(two_rank_steps: dict) -> None:
    params = two_rank_steps["fsdp"]["params"]
    full = sum(v.numel() for k, v in params.items() if k != "lm_head.weight")
    local = two_rank_steps["fsdp"]["local_numel"]
    assert sum(local) == full  # each element on exactly one rank (tied head counted once)
    for n in local:
        assert abs(n - full / 2) < 0.01 * full
    ddp = two_rank_steps["ddp"]["local_numel"]
    assert ddp == [full, full]  # DDP replicates


def test_fsdp_generation_and_logprob_passes_match_a_plain_model(two_rank_steps: dict) -> None:
    # Each rank decodes a different number of steps and scores a different number of
    # samples (one rank none): the parameters are gathered once around these passes.
    assert two_rank_steps["fsdp"]["no_grad_passes_match"] == [True, True]


def test_fsdp_bf16_mixed_gathers_bf16_and_keeps_float32_shards(two_rank_steps: dict) -> None:
    """FSDP2's MixedPrecisionPolicy: the layers compute with bf16 copies of the parameters,
    the shards (and so AdamW's state) stay float32, and the gradient (reduced in float32)
    is the single-process float32 one within bf16 rounding."""
    dist_worker = _dist_worker()
    mixed = two_rank_steps["fsdp"]["mixed"]
    assert mixed["computed"] == {torch.bfloat16} and mixed["stored"] == {torch.float32}
    torch.set_num_threads(1)
    from learner_utils import backward

    from dapo.algorithms import LossSettings
    from dapo.models.tiny import build_model, build_tokenizer

    model = build_model(len(build_tokenizer()), seed=3)  # float32, one process
    model.train()
    batch = dist_worker.fixed_batch()
    for s in batch:
        s.old_logprobs = s.old_logprobs.float()
    backward(model, batch, LossSettings(), token_budget=70)
    ref = {n: p.grad for n, p in model.named_parameters()}
    assert ref.keys() == mixed["grads"].keys()
    num = sum(float((mixed["grads"][n] - g).square().sum()) for n, g in ref.items()) ** 0.5
    den = sum(float(g.square().sum()) for g in ref.values()) ** 0.5
    assert 0 < num / den < 3e-2


def test_fsdp_where_it_does_not_work_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dapo.errors import TrainingError
    from dapo.models.data_parallel import wrap_data_parallel
    from dapo.parallel import sharding

    monkeypatch.setattr(sharding, "fsdp_support", lambda info: "no reduce_scatter in gloo")
    with pytest.raises(TrainingError) as err:
        wrap_data_parallel(None, D.DistInfo(0, 2, 0, "gloo"), "fsdp", print)
    assert str(err.value) == (
        "`train.data_parallel` = 'fsdp', but FSDP2 sharding does not work on this platform: "
        "no reduce_scatter in gloo. Use train.data_parallel=ddp (or auto)"
    )


@pytest.mark.parametrize(
    ("reward", "extra"),
    [("by_answer_class", ()), ("rarely_mixed", ("algorithm.max_gen_rounds=1",))],
    ids=["full", "round-cap-short"],
)
def test_dynamic_sampling_is_global_across_ranks(
    reward: str, extra: tuple[str, ...], random_tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    rewards = f"{HERE / 'trainer_rewards.py'}:{reward}"
    torchrun(
        str(HERE / "dist_worker.py"),
        "dynamic",
        str(random_tiny_model),
        str(out),
        rewards,
        *extra,
        cwd=tmp_path,
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [int(m.get("sampling/trained_groups", 4)) for m in metrics]
    assert len(ranks[0]) == len(ranks[1]) == sum(n > 0 for n in trained)
    if extra:  # the round cap cut some batches short, the same way on both ranks
        assert any(0 < n < 4 for n in trained), trained
    for a, b in zip(*ranks, strict=True):
        assert a["uids"] == b["uids"]  # every rank agrees on the batch
        for correct in a["groups"]:
            assert 0 < sum(correct) < len(correct)  # no uniform group trains
        # Together the ranks train every row exactly once.
        assert sorted(a["trained_rows"] + b["trained_rows"]) == list(range(4 * len(a["uids"])))
        assert a["trained_rows"] and b["trained_rows"]


def test_two_ranks_train_multi_turn_episodes_alike(tool_model: Path, tmp_path: Path) -> None:
    """Episodes with an environment under 2 ranks: each rank plays its share, every rank
    sees the same batch, and the ranks together train every episode once."""
    out = tmp_path / "run"
    envs = HERE / "sample_environments.py"
    torchrun(
        str(HERE / "dist_worker.py"),
        "dynamic",
        str(tool_model),
        str(out),
        f"{envs}:half_right",
        "data.train=builtin:calculator",
        f"rollout.environment={envs}:TwoTurns",
        "rollout.max_turns=2",
        "rollout.max_completion_length=80",
        "algorithm.overlong_buffer=8",
        cwd=tmp_path,
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(ranks[0]) == len(ranks[1]) == 3
    assert all(m["env/turns_mean"] > 1 and m["env/token_share"] > 0 for m in metrics)
    for a, b in zip(*ranks, strict=True):
        assert a["uids"] == b["uids"] and len(a["uids"]) == 4
        assert sorted(a["trained_rows"] + b["trained_rows"]) == list(range(16))


def test_prompt_skipping_decides_the_same_on_every_rank(
    random_tiny_model: Path, tmp_path: Path
) -> None:
    """algorithm.skip_uniform_prompts under 2 ranks: both hold the same history and skip
    the same draws; together they generate exactly the prompts not skipped."""
    data = tmp_path / "train.jsonl"  # answers 3..14: a third always right, a third always wrong
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Add {i}+3.\n", "answer": str(i + 3)}) + "\n" for i in range(12)
        )
    )
    out = tmp_path / "run"
    rewards = HERE / "trainer_rewards.py"
    torchrun(
        str(HERE / "dist_worker.py"),
        "skip",
        str(random_tiny_model),
        str(out),
        str(rewards),
        str(data),
        cwd=tmp_path,
    )
    a, b = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert a["skipped"] and a["skipped"] == b["skipped"]
    assert a["taken"] == b["taken"] and a["history"] == b["history"]
    # Each rank generated its share; together, every prompt drawn and not skipped, once.
    assert a["generated"] and b["generated"]
    assert sorted(a["generated"] + b["generated"]) == sorted(a["taken_ids"])


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_rank_run_resumes_from_its_checkpoint(
    mode: str, random_tiny_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from dapo.config import TrainConfig
    from dapo.parallel.sharding import full_optimizer_state
    from dapo.training.checkpoint import load_checkpoint, read_trainer_state
    from dapo.training.optim import make_optimizer

    out = tmp_path / "run"
    common = [
        *_small_run(random_tiny_model, out),
        # A reference model (kept whole under FSDP) and one eval prompt: rank 1 has none.
        "algorithm.beta=0.01",
        "evaluate=true",
        "data.max_eval_prompts=1",
    ]
    # auto picks ddp on CPU (fsdp on GPUs); fsdp must be asked for here.
    first_mode = "fsdp" if mode == "fsdp" else "auto"
    # Under ddp, launched by torchrun itself: the user's command, end to end, once.
    first = torchrun(
        *common,
        "train.steps=2",
        f"train.data_parallel={first_mode}",
        cwd=tmp_path,
        fork=mode != "ddp",
    )
    assert f"data parallel: {mode} (" in first.stdout
    start = AutoModelForCausalLM.from_pretrained(random_tiny_model).state_dict()
    if mode == "fsdp":  # the sharded checkpoint resumes in one process too (another world size)
        one = tmp_path / "one"
        shutil.copytree(out, one)
        args = [a.replace(str(out), str(one)) for a in common]
        proc = forked(
            [*args, "train.steps=3", "resume=true"],
            tmp_path,
            {**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "resumed from" in proc.stdout and "data parallel" not in proc.stdout
        assert (
            "resuming a run of 2 ranks on 1: weights, optimizer state and data position carry "
            "over; sampling seeds are per rank, so from step 2 the run follows a 1-rank "
            "trajectory"
        ) in proc.stdout
        summary = json.loads((one / "summary.json").read_text())
        assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
        assert (one / "checkpoints" / "step_000003" / "model.safetensors").is_file()
        # It continued from the shards' weights and AdamW state, not from fresh ones: the
        # state counts all 6 updates (2 per step) and step 3 moved the weights of step 2.
        at2 = AutoModelForCausalLM.from_pretrained(random_tiny_model)
        load_checkpoint(out / "checkpoints" / "step_000002", at2)
        at3 = AutoModelForCausalLM.from_pretrained(random_tiny_model)
        opt = make_optimizer(at3, TrainConfig())
        load_checkpoint(one / "checkpoints" / "step_000003", at3, opt)
        state = full_optimizer_state(at3, opt)["state"]
        assert {int(st["step"]) for st in state.values()} == {6}

        def distance(a: dict, b: dict) -> float:
            return sum(float((a[n] - b[n]).float().norm() ** 2) for n in a) ** 0.5

        w2, w3 = at2.state_dict(), at3.state_dict()
        assert 0 < distance(w3, w2) < distance(w3, start)
    torchrun(*common, "train.steps=3", "resume=true", f"train.data_parallel={mode}", cwd=tmp_path)
    if mode == "fsdp":  # at either world size step 3 drew the same prompts, none skipped
        at1, at2 = (read_trainer_state(r / "checkpoints" / "step_000003") for r in (one, out))
        assert (at1["world_size"], at2["world_size"]) == (1, 2)
        assert at1["stream"] == at2["stream"] == {"epoch": 0, "pos": 12}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/loss" in r] == [1, 2, 3]
    assert "accuracy_before" in summary and "accuracy_after" in summary
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    # The checkpoint and the final model hold full weights, which load into one process.
    final = AutoModelForCausalLM.from_pretrained(out / "final_model")
    plain = AutoModelForCausalLM.from_pretrained(random_tiny_model)
    load_checkpoint(out / "checkpoints" / "step_000003", plain)
    for name, value in plain.state_dict().items():
        assert torch.equal(final.state_dict()[name], value), name
    assert any(not torch.equal(start[n], v) for n, v in plain.state_dict().items())
    if mode == "fsdp":  # resuming loses nothing: the same state as an uninterrupted run
        whole = tmp_path / "whole"
        torchrun(
            *[a.replace(str(out), str(whole)) for a in common],
            "train.steps=3",
            "train.data_parallel=fsdp",
            cwd=tmp_path,
        )
        states = []
        for run in (out, whole):
            model = AutoModelForCausalLM.from_pretrained(random_tiny_model)
            opt = make_optimizer(model, TrainConfig())
            load_checkpoint(run / "checkpoints" / "step_000003", model, opt)
            states.append((model.state_dict(), full_optimizer_state(model, opt)))
        (m1, o1), (m2, o2) = states
        assert all(torch.equal(m1[k], m2[k]) for k in m1)
        assert o1["param_groups"] == o2["param_groups"] and o1["state"].keys() == o2["state"].keys()
        for i, st in o1["state"].items():
            assert all(torch.equal(v, o2["state"][i][k]) for k, v in st.items())
        assert int(o1["state"][0]["step"]) == 6  # 3 steps x 2 updates


def test_a_vision_model_trains_alike_under_ddp_and_fsdp(tmp_path: Path) -> None:
    """Two steps of examples/vision.yaml on 2 ranks under DDP and under FSDP2: the same
    weights at the end. Under FSDP2 the root's embeddings, connector and vision tower are
    shards outside its forward, so the images are merged inside it (a forward pre-hook);
    DDP merges them before its forward. The connector and the language model moved, the
    frozen vision tower did not."""
    from safetensors.torch import load_file

    from dapo.models import tiny_vlm

    finals = {}
    for mode in ("ddp", "fsdp"):
        out = tmp_path / mode
        args = [
            "-m", "dapo", "train", "examples/vision.yaml", f"output_dir={out}",
            "evaluate=false", "train.steps=2", "train.prompts_per_step=4",
            "rollout.num_generations=4", "train.mini_batch_size=2",
            "algorithm.dynamic_sampling=false", "logging.tensorboard=false",
            "logging.dashboard=false", f"train.data_parallel={mode}",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = forked(args, HERE.parent, env, timeout=600, ranks=2)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"data parallel: {mode} (" in proc.stdout
        (weights,) = (out / "final_model").glob("*.safetensors")
        finals[mode] = load_file(weights)
    (start,) = tiny_vlm.ensure_builtin_vlm(log=lambda _: None).glob("*.safetensors")
    initial = load_file(start)
    assert finals["ddp"].keys() == finals["fsdp"].keys() == initial.keys()
    for name, value in finals["ddp"].items():
        torch.testing.assert_close(finals["fsdp"][name], value, atol=1e-6, rtol=0)

    def moved(part: str) -> float:
        diffs = [(v - initial[n]).abs().max().item() for n, v in finals["fsdp"].items()]
        return max(d for (n, _), d in zip(finals["fsdp"].items(), diffs, strict=True) if part in n)

    assert moved("connector") > 1e-5 and moved("text_model") > 1e-5
    assert moved("vision_model") == 0.0
