"""Run under ``torchrun --nproc_per_node 2`` by tests/test_api.py: a script that calls
``dapo.train`` on every rank, with a reward lambda and a callback defined in ``__main__``.

Arguments: MODEL OUT. A callback asks rank 1 alone to stop after rollout step 2 (every rank
must stop there); each rank writes the steps its callback saw and its summary to
OUT/rank{R}.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import dapo
from dapo.data.tasks import load_task


def main(model: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    rows = [
        {"prompt": r.prompt, "answer": r.ground_truth}
        for r in load_task("builtin:addition", "train", 16)
    ]
    seen: list[int] = []

    def stop_on_rank_1(step: int, metrics: dict) -> bool:
        seen.append(step)
        return rank == 1 and step >= 2

    summary = dapo.train(
        model=model,
        output_dir=out,
        train_dataset=rows,
        callbacks=[stop_on_rank_1],
        reward_funcs=[lambda response, ground_truth: 1.0 if len(response) % 2 else -1.0],
        data={"answer_key": "answer"},
        evaluate=False,
        train={"steps": 4, "prompts_per_step": 4, "mini_batch_size": 2},
        rollout={"num_generations": 4, "max_completion_length": 12},
        algorithm={"overlong_buffer": 4},
        reward={"num_workers": 1},
        logging={"tensorboard": False, "dashboard": False, "console": False},
        checkpoint={"save_every": 0, "save_final_model": False},
    )
    Path(out, f"rank{rank}.json").write_text(json.dumps({"seen": seen, "summary": summary}))


if __name__ == "__main__":
    main(*sys.argv[1:])
