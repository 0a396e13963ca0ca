"""How far AReaL's log-linear proximal policy is from the recomputed one, on a real run.

A streaming run (``rollout.max_staleness``, the decoupled correction with the recomputed
proximal policy) is trained for ``--steps`` rollout steps; at every optimizer update, before
it is applied, the update's samples get both proximal estimates: the recomputed one (the
forward pass at the start of the step, what the run trains with) and the log-linear one
(``dapo.algorithms.loglinear_proximal`` from the behaviour log-probs, the versions and this
update's weights, one extra forward pass here for the measurement). Reported per update
index within a step (the first is exact by construction): the mean |log-linear - recompute|
over the sampled loss tokens, against the mean |recompute - behaviour| (the gap the
correction corrects), and the relative error of the importance weight pi_prox / pi_behave.

    python benchmarks/measure_proximal.py --model builtin:smollm2 --task builtin:chat_addition
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from dapo.algorithms import loglinear_proximal
from dapo.config import load_config
from dapo.training.forward import compute_logprobs
from dapo.training.trainer import Trainer


def measure(args: argparse.Namespace) -> dict:
    cfg = load_config(
        args.config,
        [
            f"model.name_or_path={args.model}",
            f"data.train={args.task}",
            f"output_dir={args.output_dir}",
            f"rollout.max_staleness={args.max_staleness}",
            "algorithm.is_cap=5",
            "algorithm.is_mode=truncate",
            f"train.steps={args.steps}",
            f"train.prompts_per_step={args.prompts}",
            f"train.mini_batch_size={args.prompts // args.updates}",
            f"rollout.num_generations={args.generations}",
            f"rollout.max_completion_length={args.max_length}",
            f"algorithm.overlong_buffer={args.max_length // 4}",
            "evaluate=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            *args.extra,
        ],
    )
    trainer = Trainer(cfg, log=lambda _: None)
    learner = trainer.learner
    real = learner.optimizer_step
    rows: list[dict] = []

    def optimizer_step(batch, **kwargs):  # type: ignore[no-untyped-def]
        stale = [s for s in batch if s.versions is not None and s.sampling_logprobs is not None]
        if stale:
            current = compute_logprobs(learner.model, stale, learner.forward)
            err, gap, weight = [], [], []
            for s, lp in zip(stale, current, strict=True):
                mask = torch.tensor(s.loss_mask) > 0
                approx = loglinear_proximal(
                    s.sampling_logprobs, lp, s.versions, kwargs["version"], kwargs["progress"]
                )
                exact, behave = s.old_logprobs, s.sampling_logprobs
                err += (approx - exact).abs()[mask].tolist()
                gap += (exact - behave).abs()[mask].tolist()
                w_exact = torch.exp(exact - behave)
                weight += ((torch.exp(approx - behave) - w_exact).abs() / w_exact)[mask].tolist()
            rows.append(
                {
                    "version": kwargs["version"],
                    "progress": kwargs["progress"],
                    "abs_error": statistics.fmean(err) if err else 0.0,
                    "gap": statistics.fmean(gap) if gap else 0.0,
                    "weight_rel_error": statistics.fmean(weight) if weight else 0.0,
                    "tokens": len(err),
                }
            )
        return real(batch, **kwargs)

    learner.optimizer_step = optimizer_step
    try:
        for _ in range(args.steps):
            trainer.train_step()
    finally:
        trainer.close()
    by_progress: dict[float, list[dict]] = {}
    for r in rows:
        by_progress.setdefault(round(r["progress"], 4), []).append(r)
    table = [
        {
            "progress": p,
            "abs_error": statistics.fmean(x["abs_error"] for x in rs),
            "gap": statistics.fmean(x["gap"] for x in rs),
            "weight_rel_error": statistics.fmean(x["weight_rel_error"] for x in rs),
            "updates": len(rs),
        }
        for p, rs in sorted(by_progress.items())
    ]
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "extra"},
        "rows": rows,
        "table": table,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a YAML config to start from")
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--task", default="builtin:chat_addition")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--updates", type=int, default=4, help="optimizer updates per step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--output-dir", default="runs/measure_proximal")
    parser.add_argument("--output", default="benchmarks/results/proximal.json")
    parser.add_argument("extra", nargs="*", help="more key.path=value overrides")
    args = parser.parse_args(argv)
    result = measure(args)
    print(
        "| update's place in the step | mean abs(loglinear - recompute) | mean abs(recompute - behaviour) | weight's relative error | updates |"
    )
    print("|---|---|---|---|---|")
    for r in result["table"]:
        print(
            f"| {r['progress']:.2f} | {r['abs_error']:.2e} | {r['gap']:.2e} | "
            f"{r['weight_rel_error']:.2%} | {r['updates']} |"
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
