"""Verified checkpoints: every checkpoint and the final model carry a manifest (each file's
size and CRC-32, written last); resuming checks the newest checkpoint against it before
loading anything and falls back to the newest intact one; ``dapo verify`` checks a run.

The damage is real: random bytes written over the middle of a file, one flipped bit in a
weight, a truncated or deleted file, on real checkpoints written by ``save_checkpoint`` and
by ``Trainer(cfg).run()``.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import dapo.training.record
from dapo.cli import main
from dapo.config import load_config
from dapo.errors import CheckpointError, CheckpointWarning
from dapo.training.checkpoint import latest_intact_checkpoint, load_checkpoint, save_checkpoint
from dapo.training.manifest import MANIFEST, verify_manifest
from dapo.training.trainer import Trainer

HERE = Path(__file__).parent
REWARDS = HERE / "reliability_rewards.py"
WHOLE = ["model.safetensors", "optimizer.pt", "trainer_state.pt"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two torch threads on two busy cores are ~100x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_dashboard(monkeypatch):
    monkeypatch.setattr(dapo.training.record, "plot_dashboard", lambda *a, **k: None)


def damage(path: Path, seed: int = 0) -> None:
    """4 KB of random bytes written over the middle of ``path`` (its size unchanged)."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2 - 2048
    assert start > 0, f"{path} is too small to damage in the middle"
    data[start : start + 4096] = random.Random(seed).randbytes(4096)
    path.write_bytes(data)


def tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def small_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ~100 KB of weights after one AdamW step (other seeds: other weights)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def two_checkpoints(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints of steps 1 and 2 with different weights under ``root``; their weights."""
    weights = {}
    for step in (1, 2):
        model, opt = small_state(seed=step)
        save_checkpoint(root, step, model, opt, {"step": step})
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def recorded_warnings(fn: Any, *args: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return result, [str(w.message) for w in caught if w.category is CheckpointWarning]


# --------------------------------------------------------------------------- the manifest


def test_a_checkpoint_lists_every_file_with_its_size_and_crc32(tmp_path):
    root = tmp_path / "checkpoints"
    two_checkpoints(root)
    for path in sorted(root.iterdir()):
        manifest = json.loads((path / MANIFEST).read_text())
        assert sorted(manifest["files"]) == WHOLE  # every file but the manifest itself
        for name, entry in manifest["files"].items():
            data = (path / name).read_bytes()
            assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        assert verify_manifest(path) == []
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002"]  # no temp


def test_one_flipped_bit_in_a_weight_is_detected(tmp_path):
    """One bit of one weight: safetensors loads the file without complaint (a silently
    different model); the manifest names it and resuming takes the previous checkpoint."""
    root = tmp_path / "checkpoints"
    weights = two_checkpoints(root)
    file = root / "step_000002" / "model.safetensors"
    data = bytearray(file.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    data[8 + header + (len(data) - 8 - header) // 2] ^= 0x10  # in the middle of the tensors
    file.write_bytes(data)
    loaded = load_file(str(file))
    assert sum(not torch.equal(loaded[k], weights[2][k]) for k in loaded) == 1
    [problem] = verify_manifest(root / "step_000002")
    assert problem.startswith("model.safetensors: contents changed (CRC-32 ")
    found, said = recorded_warnings(latest_intact_checkpoint, root)
    assert found == root / "step_000001"
    assert said == [
        f"{root / 'step_000002'} is damaged ({problem}); resuming from {found}, the newest "
        "intact checkpoint (nothing was deleted)"
    ]


def test_a_damaged_trainer_state_is_detected(tmp_path):
    root = tmp_path / "checkpoints"
    two_checkpoints(root)
    state = root / "step_000002" / "trainer_state.pt"
    size = state.stat().st_size
    state.write_bytes(state.read_bytes()[: size // 2])  # truncated, as by a full disk or copy
    assert verify_manifest(root / "step_000002") == [
        f"trainer_state.pt: {size // 2} bytes, the manifest says {size}"
    ]
    found, said = recorded_warnings(latest_intact_checkpoint, root)
    assert found == root / "step_000001" and "trainer_state.pt" in said[0]


@pytest.mark.parametrize("fault", ["missing-file", "garbage-manifest", "manifest-of-a-list"])
def test_a_missing_file_or_an_invalid_manifest_is_damage(tmp_path, fault):
    root = tmp_path / "checkpoints"
    two_checkpoints(root)
    path = root / "step_000002"
    if fault == "missing-file":
        (path / "optimizer.pt").unlink()
        expected = "optimizer.pt: missing"
    elif fault == "garbage-manifest":
        (path / MANIFEST).write_bytes(b"\x00garbage")
        expected = f"{MANIFEST}: unreadable or invalid (JSONDecodeError: "
    else:
        (path / MANIFEST).write_text("[1, 2]")
        expected = f"{MANIFEST}: unreadable or invalid (ValueError: not a dapo manifest)"
    [problem] = verify_manifest(path)
    assert problem.startswith(expected), problem
    assert latest_intact_checkpoint(root, warn=lambda _: None) == root / "step_000001"


def test_every_checkpoint_damaged_is_an_error_naming_the_files_and_deletes_nothing(tmp_path):
    root = tmp_path / "checkpoints"
    two_checkpoints(root)
    damage(root / "step_000002" / "model.safetensors")
    damage(root / "step_000001" / "optimizer.pt")
    before = tree(root)
    with pytest.raises(CheckpointError) as info:
        latest_intact_checkpoint(root)
    msg = str(info.value)
    assert msg.startswith(f"no intact checkpoint to resume from in {root}: ")
    assert f"{root / 'step_000002'} is damaged (model.safetensors: contents changed" in msg
    assert f"{root / 'step_000001'} is damaged (optimizer.pt: contents changed" in msg
    assert msg.endswith(
        f"Restore the damaged files (e.g. from a backup), or delete {root} to start the run "
        "again; nothing was deleted."
    )
    assert tree(root) == before


def test_a_checkpoint_without_manifest_loads_with_a_notice(tmp_path):
    """As an older release wrote it: taken as it is, said in one line; not damage."""
    root = tmp_path / "checkpoints"
    weights = two_checkpoints(root)
    (root / "step_000002" / MANIFEST).unlink()
    assert verify_manifest(root / "step_000002") is None
    found, said = recorded_warnings(latest_intact_checkpoint, root)
    assert found == root / "step_000002"
    assert said == [
        f"{found} has no {MANIFEST} (written by an older dapo): its files cannot be verified; "
        "loading it as it is"
    ]
    model, opt = small_state(seed=7)
    assert load_checkpoint(found, model, opt) == {"step": 2}
    assert all(torch.equal(v, weights[2][k]) for k, v in model.state_dict().items())


def test_no_checkpoint_is_none(tmp_path):
    assert latest_intact_checkpoint(tmp_path / "checkpoints") is None


# --------------------------------------------------------------------------- dapo verify


def test_dapo_verify_says_ok_damaged_or_unverified_and_exits_by_what_it_found(tmp_path, capsys):
    run = tmp_path / "run"
    two_checkpoints(run / "checkpoints")
    ckpts = run / "checkpoints"
    assert main(["verify", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"OK         {ckpts / 'step_000001'}",
        f"OK         {ckpts / 'step_000002'}",
    ]
    damage(ckpts / "step_000002" / "optimizer.pt")
    (ckpts / "step_000001" / MANIFEST).unlink()
    assert main(["verify", str(run)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"UNVERIFIED {ckpts / 'step_000001'}: no {MANIFEST} (written by an older dapo)"
    )
    assert lines[1].startswith(
        f"DAMAGED    {ckpts / 'step_000002'}: optimizer.pt: contents changed (CRC-32 "
    )
    assert len(lines) == 2


@pytest.mark.parametrize("where", ["empty-dir", "missing", "a-file", "run-without-checkpoints"])
def test_dapo_verify_of_a_path_that_is_not_a_run_exits_2(tmp_path, capsys, where):
    path = tmp_path / "x"
    if where == "empty-dir":
        path.mkdir()
    elif where == "a-file":
        path.write_text("x")
    elif where == "run-without-checkpoints":
        path.mkdir()
        (path / "config.yaml").write_text("seed: 1\n")
    assert main(["verify", str(path)]) == 2
    err = capsys.readouterr().err
    if where == "run-without-checkpoints":
        assert err == (
            f"dapo verify: {path} is a run directory without a checkpoint or final model yet: "
            "nothing to verify\n"
        )
    else:
        assert err == (
            f"dapo verify: {path} is not a run directory: it holds no checkpoints/step_* and no "
            "final_model/; give the output_dir of a dapo train run\n"
        )


# --------------------------------------------------------------------------- through the trainer


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Compute {i} + {i + 3}. End with Answer: N"}],
            "reward_model": {"ground_truth": str(2 * i + 3)},
        }
        for i in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"model.name_or_path={model}",
        f"data.train={data}",
        f"output_dir={out}",
        "seed=3",
        "train.steps=3",
        "train.prompts_per_step=2",
        "train.mini_batch_size=1",
        "rollout.num_generations=4",
        "rollout.max_completion_length=24",
        "algorithm.overlong_buffer=4",
        "algorithm.dynamic_sampling=false",
        "evaluate=false",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "logging.console=false",
        "checkpoint.save_every=2",
        "checkpoint.keep_last=2",
        "reward.num_workers=1",
        f"reward.functions=[{{name: '{REWARDS}:mixed'}}]",
        *extra,
    ]


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def trained(random_tiny_model, train_file, tmp_path_factory) -> Path:
    """A 3-step run saving every 2 steps: checkpoints of steps 2 and 3 (the last one written
    at the end, by ``_save_final``) and a final model."""
    out = tmp_path_factory.mktemp("trained") / "run"
    cfg = load_config(overrides=overrides(random_tiny_model, train_file, out))
    Trainer(cfg, log=quiet).run()
    return out


@pytest.mark.slow
def test_the_final_model_has_a_manifest_that_transformers_ignores(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = trained / "final_model"
    listed = json.loads((final / MANIFEST).read_text())["files"]
    assert set(listed) == {p.name for p in final.iterdir()} - {MANIFEST}
    assert {"config.json", "model.safetensors"} <= set(listed)
    assert verify_manifest(final) == []
    AutoModelForCausalLM.from_pretrained(final)
    AutoTokenizer.from_pretrained(final)


@pytest.mark.slow
@pytest.mark.parametrize("file", ["model.safetensors", "optimizer.pt"])
def test_damage_in_the_newest_checkpoint_resumes_from_the_previous_one(
    trained, random_tiny_model, train_file, tmp_path, file
):
    """4 KB of random bytes in the newest checkpoint's weights or optimizer state: named in
    one warning, and the run resumes from step 2 with exactly step 2's weights and optimizer
    state (before: "resumed from ... (step 3)", then an unrelated error or a step trained on
    the damaged state). Going on, it trains step 3 again to exactly the weights it had, and
    saves it at the end over the damaged step_000003 (which holds no state of this run)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    ckpts = out / "checkpoints"
    step3_file = ckpts / "step_000003" / "model.safetensors"
    step3_before = {k: v.clone() for k, v in load_file(str(step3_file)).items()}  # not mmap-ed
    damage(ckpts / "step_000003" / file)
    damaged = (ckpts / "step_000003" / file).read_bytes()
    args = overrides(
        random_tiny_model, train_file, out, "resume=true", "checkpoint.save_final_model=false"
    )

    with warnings.catch_warnings(record=True) as caught:  # said as the trainer is built
        warnings.simplefilter("always")
        trainer = Trainer(load_config(overrides=[*args, "train.steps=2"]), log=quiet)
        summary = trainer.run()
    [said] = [str(w.message) for w in caught if w.category is CheckpointWarning]
    assert said.startswith(f"{ckpts / 'step_000003'} is damaged ({file}: contents changed")
    assert said.endswith(
        f"resuming from {ckpts / 'step_000002'}, the newest intact checkpoint (nothing was deleted)"
    )
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 2
    step2 = load_file(str(ckpts / "step_000002" / "model.safetensors"))
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, step2[name]), name
    saved_opt = torch.load(ckpts / "step_000002" / "optimizer.pt", weights_only=False)
    loaded_opt = trainer.learner.optimizer.state_dict()
    for i, state in saved_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded_opt["state"][i][key], value), (i, key)
    assert (ckpts / "step_000003" / file).read_bytes() == damaged  # nothing deleted or mended

    summary = Trainer(load_config(overrides=args), log=quiet).run()
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    assert verify_manifest(ckpts / "step_000003") == []  # saved again, intact
    step3 = load_file(str(step3_file))
    assert all(torch.equal(step3[k], v) for k, v in step3_before.items())


@pytest.mark.slow
def test_no_intact_checkpoint_stops_the_run_naming_the_files(
    trained, random_tiny_model, train_file, tmp_path
):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    ckpts = out / "checkpoints"
    damage(ckpts / "step_000003" / "model.safetensors")
    damage(ckpts / "step_000002" / "trainer_state.pt", seed=1)
    before = tree(out)
    cfg = load_config(overrides=overrides(random_tiny_model, train_file, out, "resume=true"))
    with pytest.raises(CheckpointError) as info:
        Trainer(cfg, log=quiet).run()
    msg = str(info.value)
    assert "step_000003 is damaged (model.safetensors: contents changed" in msg
    assert "step_000002 is damaged (trainer_state.pt: contents changed" in msg
    assert f"or delete {ckpts} to start the run again; nothing was deleted." in msg
    assert tree(out) == before  # not a byte changed: nothing trained, nothing written


@pytest.mark.slow
def test_dapo_verify_of_a_trained_run(trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    assert main(["verify", str(out)]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["OK"] * 3
    damage(out / "final_model" / "model.safetensors")
    assert main(["verify", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        f"OK         {out / 'checkpoints' / 'step_000002'}",
        f"OK         {out / 'checkpoints' / 'step_000003'}",
    ]
    assert lines[2].startswith(
        f"DAMAGED    {out / 'final_model'}: model.safetensors: contents changed (CRC-32 "
    )


# --------------------------------------------------------------------------- FSDP, two ranks

TWO_RANKS = """
import json, os, random, sys
from pathlib import Path
import torch
from dapo.errors import CheckpointError
from dapo.models.tiny import build_model, build_tokenizer
from dapo.parallel import distributed as D
from dapo.parallel import sharding
from dapo.training.checkpoint import checkpoint_to_resume, save_checkpoint

torch.set_num_threads(1)
info = D.init_distributed()
root = Path("checkpoints")
model = build_model(len(build_tokenizer()), seed=3)
sharding.shard_model(model, info)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in (1, 2):
    model(torch.tensor([[5, 6, 7, 8]])).logits.sum().backward()
    opt.step()
    save_checkpoint(root, step, model, opt, {"step": step})
D.barrier()

def damage(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = random.Random(0).randbytes(4096)
    path.write_bytes(data)

def choose():
    try:
        return str(checkpoint_to_resume(root, warn=said.append))
    except CheckpointError as exc:
        return f"error: {exc}"

said, chosen = [], []
if info.is_main:  # rank 1's shard of the newest checkpoint
    damage(root / "step_000002" / "model_optim" / "__1_0.distcp")
D.barrier()
chosen.append(choose())
if info.is_main:
    damage(root / "step_000001" / "model_optim" / "__0_0.distcp")
D.barrier()
chosen.append(choose())
Path(f"rank{info.rank}.json").write_text(json.dumps({"chosen": chosen, "said": said}))
"""


@pytest.mark.slow
def test_fsdp_manifest_covers_every_ranks_shards_and_all_ranks_resume_alike(tmp_path):
    """Two FSDP ranks write their shards; rank 0's manifest lists them all. With rank 1's
    shard of the newest checkpoint damaged, both ranks pick the previous one (rank 0 checks,
    and warns); with every checkpoint damaged, both stop with rank 0's error."""
    from ranks import torchrun  # tests/ranks.py

    torchrun("-c", TWO_RANKS, cwd=tmp_path)
    ckpts = tmp_path / "checkpoints"
    step1 = ckpts / "step_000001"
    listed = json.loads((step1 / MANIFEST).read_text())["files"]
    shards = {p.relative_to(step1).as_posix() for p in step1.rglob("*.distcp")}
    assert {"model_optim/__0_0.distcp", "model_optim/__1_0.distcp"} <= shards
    assert set(listed) == shards | {"model_optim/.metadata", "trainer_state.pt"}
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["chosen"] == results[1]["chosen"]
    first, second = results[0]["chosen"]
    assert first == "checkpoints/step_000001"
    assert second.startswith("error: no intact checkpoint to resume from in checkpoints: ")
    assert "step_000002 is damaged (model_optim/__1_0.distcp: contents changed" in second
    assert "step_000001 is damaged (model_optim/__0_0.distcp: contents changed" in second
    assert len(results[0]["said"]) == 1 and "model_optim/__1_0.distcp" in results[0]["said"][0]
    assert results[1]["said"] == []  # only rank 0 checks and speaks


@pytest.mark.slow
def test_the_cost_measurement_runs(tmp_path, capsys):
    """benchmarks/measure_checkpoint_integrity.py (its figures are in the checkpoints guide),
    at 4 MiB."""
    from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

    report = import_benchmark("measure_checkpoint_integrity").main(
        ["--mb", "4", "--dir", str(tmp_path)]
    )
    assert set(report["checksum_MiB_per_s"]) >= {"zlib.crc32", "sha256", "blake2b"}
    for kind in ("builtin:tiny", "synthetic"):
        assert report[kind]["MB"] > 1 and report[kind]["verify_cached_s"] >= 0
