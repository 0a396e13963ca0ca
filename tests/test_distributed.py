"""Data-parallel training with torch.distributed: 2 gloo ranks on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo import distributed as D

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_balance_by_tokens_spreads_the_load() -> None:
    parts = D.balance_by_tokens([100, 1, 50, 50, 2, 97], 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    loads = [sum([100, 1, 50, 50, 2, 97][i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 4


def test_two_ranks_make_the_same_step_as_one_process(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    try:
        import dist_worker
    finally:
        sys.path.remove(str(HERE))
    # The ranks really hold different responses, with truncated ones among them.
    batch = dist_worker.fixed_batch()
    parts = D.balance_by_tokens([s.length for s in batch], 2)
    for part in parts:
        assert len({len(batch[i].response_ids) for i in part}) > 1
    assert any(sum(batch[i].loss_mask) == 0 for i in parts[0]) or any(
        sum(batch[i].loss_mask) == 0 for i in parts[1]
    )
    # Some micro-batches forward a shared prompt once for several responses (the DDP forward
    # is the prompt pass), others every sequence whole; the ranks' last ones differ so.
    from dapo.update import micro_batches

    shared = [
        [len({tuple(batch[part[i]].prompt_ids) for i in c}) < len(c)
         for c in micro_batches([batch[i] for i in part], 150)]
        for part in parts
    ]
    assert any(map(any, shared)) and not all(map(all, shared))
    assert shared[0][-1] != shared[1][-1]
    out = tmp_path / "ddp.pt"
    torchrun(str(HERE / "dist_worker.py"), "step", str(out), cwd=tmp_path)
    two_ranks = torch.load(out)
    torch.set_num_threads(1)
    single = dist_worker.one_step(use_ddp=False)
    from dapo.builtin import build_model, build_tokenizer

    initial = build_model(len(build_tokenizer()), seed=3).double().state_dict()
    moved = 0.0
    for name, value in single.items():
        torch.testing.assert_close(two_ranks[name], value, atol=1e-5, rtol=0)
        moved = max(moved, float((value - initial[name]).abs().max()))
    assert moved > 1e-4  # the step did change the weights


def test_dynamic_sampling_is_global_across_ranks(random_tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rewards = HERE / "trainer_rewards.py"
    torchrun(str(HERE / "dist_worker.py"), "dynamic", str(random_tiny_model), str(out), str(rewards), cwd=tmp_path)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 3
    for a, b in zip(*ranks, strict=True):
        assert a["uids"] == b["uids"]  # every rank agrees on the batch
        for correct in a["groups"]:
            assert 0 < sum(correct) < len(correct)  # no uniform group trains
        # Together the ranks train every row exactly once.
        assert sorted(a["trained_rows"] + b["trained_rows"]) == list(range(4 * 4))
        assert a["trained_rows"] and b["trained_rows"]


def test_two_rank_run_resumes_from_its_checkpoint(random_tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    common = [
        "-m", "dapo", "train", f"model.name_or_path={random_tiny_model}", f"output_dir={out}",
        "train.prompts_per_step=4", "train.mini_batch_size=2", "rollout.num_generations=4",
        "rollout.max_completion_length=12", "algorithm.overlong_buffer=4",
        "algorithm.dynamic_sampling=false", "evaluate=false", "logging.tensorboard=false",
        "checkpoint.save_every=1",
    ]
    torchrun(*common, "train.steps=2", cwd=tmp_path)
    torchrun(*common, "train.steps=3", "resume=true", cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
