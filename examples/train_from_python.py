"""Train from Python: the built-in model on the built-in addition task, with a lambda reward.

    python examples/train_from_python.py            # about 3 minutes on a laptop CPU
    python examples/train_from_python.py --steps 30 # a shorter run

The data sets are built in memory (a ``datasets.Dataset`` and a list of row dicts), the
reward is a lambda defined here (it is sent to the reward worker process with cloudpickle),
and a callback prints the training accuracy every 25 rollout steps. The run writes
runs/from_python/ (metrics.jsonl, dashboard.png, checkpoints, final_model) and prints its
held-out accuracy before and after training. Under torchrun it runs on every rank alike.
"""

from __future__ import annotations

import argparse
import os
import re

import datasets

import dapo
from dapo.data.tasks import load_task

ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def addition_rows(split: str, n: int) -> list[dict[str, str]]:
    """``n`` problems "Add 17+5 column by column. End with: Answer: <sum>" and their sums."""
    return [
        {"question": r.prompt, "sum": r.ground_truth}
        for r in load_task("builtin:addition", split, n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="rollout steps (default 120)")
    parser.add_argument("--output-dir", default="runs/from_python")
    args = parser.parse_args()
    main_rank = int(os.environ.get("RANK", "0")) == 0

    accuracy: list[float] = []

    def report(step: int, metrics: dict[str, float]) -> None:
        accuracy.append(metrics["reward/acc"])
        if step % 25 == 0 and main_rank:
            recent = accuracy[-25:]
            print(f"step {step}: training accuracy {sum(recent) / len(recent):.1%} (last 25 steps)")

    summary = dapo.train(
        model="builtin:tiny",  # or a loaded transformers model with tokenizer=...
        train_dataset=datasets.Dataset.from_list(addition_rows("train", 5000)),
        eval_dataset=addition_rows("test", 500),
        data={"prompt_key": "question", "answer_key": "sum"},
        # Correct (1) when the last "Answer: N" is the sum, else -1 (no answer counts as wrong).
        reward_funcs=[
            lambda response, ground_truth: (
                1.0 if ANSWER.findall(response)[-1:] == [ground_truth] else -1.0
            )
        ],
        callbacks=[report],
        output_dir=args.output_dir,
        train={"steps": args.steps},
        logging={"console": False, "tensorboard": False},
    )
    if main_rank:
        before, after = summary["accuracy_before"], summary["accuracy_after"]
        gain = (after - before) * 100
        print(
            f"held-out accuracy: {before:.1%} -> {after:.1%} ({gain:+.1f} points) "
            f"in {summary['steps']} rollout steps, {summary['wall_seconds']} s"
        )
        print(
            f"metrics: {args.output_dir}/metrics.jsonl   dashboard: {args.output_dir}/dashboard.png"
        )


if __name__ == "__main__":
    main()
