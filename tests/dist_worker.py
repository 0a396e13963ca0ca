"""Run under ``python -m torch.distributed.run --nproc_per_node 2`` by tests/test_distributed.py.

Modes:
  step OUT          one optimizer step on a fixed mini-batch; rank 0 saves the parameters
  dynamic MODEL OUT a short training run with uniform groups; each rank records what it trained
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dapo import distributed as D


def fixed_batch():
    """Responses of very different lengths, two of them masked as truncated, and groups of
    responses to one prompt (trained with the shared prompt pass)."""
    import random

    from dapo.update import Sample

    rng = random.Random(0)
    gen = torch.Generator().manual_seed(1)
    lengths = [(5, 40), (12, 1), (3, 17), (9, 60), (7, 2), (4, 33), (6, 25), (8, 9)]
    groups = [(10, [1, 30, 52, 30]), (4, [22, 5, 14])]  # (prompt length, response lengths)
    samples = []
    for lp, lrs in [(lp, [lr]) for lp, lr in lengths] + groups:
        prompt = [rng.randrange(3, 99) for _ in range(lp)]
        for lr in lrs:
            resp = [rng.randrange(3, 99) for _ in range(lr)]
            mask = [0.0 if len(samples) in (3, 6) else 1.0] * lr
            s = Sample(prompt, resp, rng.choice([-1.3, -0.4, 0.7, 1.1]), mask)
            s.old_logprobs = -4.6 + 0.5 * torch.randn(lr, generator=gen, dtype=torch.float64)
            samples.append(s)
    return samples


def one_step(use_ddp: bool) -> dict[str, torch.Tensor]:
    from dapo.builtin import build_model, build_tokenizer
    from dapo.update import LossSettings, optimizer_step

    torch.set_num_threads(1)
    model = build_model(len(build_tokenizer()), seed=3).double()
    model.train()
    ddp = torch.nn.parallel.DistributedDataParallel(model) if use_ddp else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    result = optimizer_step(
        model, opt, fixed_batch(), LossSettings(loss_agg="token-mean"),
        pad_id=0, token_budget=150, max_grad_norm=1.0, ddp=ddp,
    )
    assert result.applied
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    mode = sys.argv[1]
    info = D.init_distributed()
    assert info.world_size == 2, info
    if mode == "step":
        params = one_step(use_ddp=True)
        if info.is_main:
            torch.save(params, sys.argv[2])
    elif mode == "dynamic":
        from dapo.config import load_config
        from dapo.trainer import Trainer

        model, out, rewards = sys.argv[2], Path(sys.argv[3]), sys.argv[4]
        cfg = load_config(overrides=[
            f"model.name_or_path={model}", f"output_dir={out}", "train.steps=3",
            "train.prompts_per_step=4", "train.mini_batch_size=2", "rollout.num_generations=4",
            "rollout.max_completion_length=12", "algorithm.overlong_buffer=4", "evaluate=false",
            "logging.tensorboard=false", "logging.console=false", "checkpoint.save_every=0",
            f"reward.functions=[{{name: '{rewards}:by_answer_class'}}]",
        ])
        trainer = Trainer(cfg, log=lambda _: None)
        seen: list[dict] = []
        original = trainer.update

        def record(groups, step):
            samples = trainer.build_samples(groups)
            g = groups[0].size
            trained = sorted({i for k in range(0, len(samples), g * cfg.train.mini_batch_size)
                              for i in trainer._my_share(samples, list(range(k, k + g * cfg.train.mini_batch_size)))})
            seen.append({
                "step": step,
                "groups": [list(map(bool, x.correct)) for x in groups],
                "trained_rows": trained,
                "uids": [x.record.uid for x in groups],
            })
            return original(groups, step)

        trainer.update = record
        trainer.run()
        (out / f"rank{info.rank}.json").write_text(json.dumps(seen))
    D.destroy()


if __name__ == "__main__":
    main()
