"""Rollout-step throughput of ``dapo train`` against TRL's ``GRPOTrainer`` on identical work.

Both sides train the same model (``builtin:tiny``) with the same tokenizer on the same
plain-text ``builtin:addition`` prompts (no chat template on either side): per rollout step
``--prompts`` prompts x ``--generations`` responses of at most ``--max-completion-length``
tokens, sampled at temperature 1.0, scored by the same ``dapo_math`` scorer plus the same
soft overlong punishment, truncated responses masked out of the loss, the token-level DAPO
loss with clip 0.2 / 0.28 and beta 0, and exactly one optimizer update per rollout step (so
neither side recomputes old log-probs). Dynamic sampling is off on our side so that every
step does the same amount of work; learning rate, warm-up, weight decay, Adam betas and
gradient clipping come from our resolved config on both sides.

- ours: the real ``dapo train`` (``dapo.cli.main``); seconds per step from ``perf/step_s``
  in ``metrics.jsonl`` (rollout + update).
- TRL: ``GRPOTrainer`` with ``loss_type="dapo"``, ``per_device_train_batch_size`` = one
  rollout (prompts x generations), ``gradient_accumulation_steps = steps_per_generation =
  num_iterations = 1``; seconds per step from a callback (``on_step_begin`` to
  ``on_step_end``: generation, scoring and the update).

Each run is a fresh subprocess (this script with ``--worker``) on the same number of
threads; the sides alternate (ours, TRL, ours, TRL, ...) for ``--rounds`` rounds of
``--steps`` steps. The first step of every run is dropped as warm-up. The table gives the
median seconds per rollout step over the kept steps, the split into rollout (generation +
scoring) and update, the peak RSS of the training process (``ru_maxrss``) and, sampled, of
the training process together with its helper processes (our reward-scoring worker), and
the throughput ratio: TRL's median s/step over ours. The figures are written as JSON.

    python benchmarks/bench_trl.py [--steps 6] [--rounds 2] [--threads N]
        [--output benchmarks/results/trl.json]

TRL is a benchmark-only dependency: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _in_process import in_process, run_here  # benchmarks/_in_process.py
from _report import (  # benchmarks/_report.py (run as a script)
    package_version,
    provenance,
    write_report,
)

SIDES = ("ours", "trl")


# --- shared settings ------------------------------------------------------------------------


def our_overrides(args: argparse.Namespace, output_dir: Path) -> list[str]:
    """The ``dapo train`` overrides of one benchmark run (the TRL side mirrors them)."""
    return [
        "preset=dapo",
        "algorithm.dynamic_sampling=false",
        f"algorithm.overlong_buffer={overlong_buffer(args.max_completion_length)}",
        f"train.prompts_per_step={args.prompts}",
        f"train.mini_batch_size={args.prompts}",  # one optimizer update per rollout step
        "train.epochs=1",
        f"train.steps={args.steps}",
        f"rollout.num_generations={args.generations}",
        f"rollout.max_completion_length={args.max_completion_length}",
        "evaluate=false",
        "logging.console=false",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
        "checkpoint.save_final_model=false",
        f"output_dir={output_dir}",
    ]


def overlong_buffer(max_completion_length: int) -> int:
    """Our default soft-punishment buffer (16 tokens), kept below the maximum length."""
    return min(16, max(1, max_completion_length // 4))


def peak_rss_mb() -> float:
    """Peak RSS of this process in MB (``ru_maxrss`` is in KB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class TreeRss(threading.Thread):
    """Samples the summed RSS of this process and its descendants (e.g. our reward worker).

    Linux only (``/proc``); elsewhere the peak stays 0. Sampled, so a spike shorter than
    the interval can be missed; ``ru_maxrss`` of the training process itself is exact.
    """

    def __init__(self, interval_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self._stop_event = threading.Event()
        self._page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 0.0

    def _descendants(self, pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for task in Path(f"/proc/{p}/task").iterdir():
                    todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
        return out

    def _sample(self) -> float:
        total = 0.0
        for pid in self._descendants(os.getpid()):
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * self._page_mb
            except (OSError, IndexError, ValueError):
                continue
        return total

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.peak_mb = max(self.peak_mb, self._sample())

    def stop(self) -> float:
        self._stop_event.set()
        self.join()
        return max(self.peak_mb, self._sample())


# --- workers (one fresh process per run) ----------------------------------------------------


def worker_ours(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One ``dapo train`` run in this process; per-step times from its metrics.jsonl."""
    import torch

    from dapo.cli import main as dapo_main

    torch.set_num_threads(args.threads)
    out = workdir / "ours"
    code = dapo_main(["train", *our_overrides(args, out)])
    if code != 0:
        raise RuntimeError(f"dapo train exited with {code}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r]
    return {
        "step_s": [r["perf/step_s"] for r in rows],
        "rollout_s": [r["perf/gen_s"] + r["perf/score_s"] for r in rows],
        "update_s": [r["perf/train_s"] for r in rows],
        "gen_s": [r["perf/gen_s"] for r in rows],
        "score_s": [r["perf/score_s"] for r in rows],
    }


def trl_reward(max_completion_length: int, buffer: int) -> Callable[..., list[float]]:
    """A TRL reward function: ``dapo_math_score`` plus our soft overlong punishment."""
    from dapo.rewards import dapo_math_score, soft_overlong_punishment

    def dapo_math_reward(
        completions: list[str],
        completion_ids: list[list[int]],
        ground_truth: list[str],
        **_: Any,
    ) -> list[float]:
        return [
            dapo_math_score(text, truth)
            + soft_overlong_punishment(len(ids), max_completion_length, buffer)
            for text, ids, truth in zip(completions, completion_ids, ground_truth, strict=True)
        ]

    return dapo_math_reward


def worker_trl(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One ``GRPOTrainer`` run in this process with the settings of our resolved config."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dapo.config import load_config
    from dapo.data import encode_prompts, load_prompt_set
    from dapo.models import load_policy, load_tokenizer, resolve_model_path

    torch.set_num_threads(args.threads)
    cfg = load_config(overrides=our_overrides(args, workdir / "unused"))
    a, r, t = cfg.algorithm, cfg.rollout, cfg.train
    path = resolve_model_path(cfg.model.name_or_path, log=lambda _: None)
    tokenizer = load_tokenizer(path)
    model = load_policy(path)
    # The same prompt set as ours: the same records, the same length filter (none is dropped).
    records, _, _ = encode_prompts(
        load_prompt_set(cfg.data, "train"), tokenizer, cfg.data.max_prompt_length
    )
    dataset = Dataset.from_dict(
        {"prompt": [x.prompt for x in records], "ground_truth": [x.ground_truth for x in records]}
    )
    per_step = t.prompts_per_step * r.num_generations
    config = GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        bf16=False,
        seed=cfg.seed,
        max_steps=t.steps,
        per_device_train_batch_size=per_step,  # completions: the whole rollout in one update
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=r.num_generations,
        max_completion_length=r.max_completion_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        loss_type="dapo",
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        beta=a.beta,
        scale_rewards="group",
        mask_truncated_completions=a.overlong_filter,
        learning_rate=t.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        max_grad_norm=t.max_grad_norm,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class StepTimer(TrainerCallback):
        """Wall clock of each optimizer step (one rollout step here)."""

        def __init__(self) -> None:
            self.step_s: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_s.append(time.perf_counter() - self._start)

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward(r.max_completion_length, a.overlong_buffer),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    # Split each step into rollout (generation + scoring) and update, as ours logs it.
    rollout_s: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(inputs: Any) -> Any:
        start = time.perf_counter()
        out = generate_and_score(inputs)
        rollout_s.append(time.perf_counter() - start)
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    trainer.train()
    if len(timer.step_s) != t.steps or len(rollout_s) != t.steps:
        raise RuntimeError(
            f"expected {t.steps} steps with one generation each, got {len(timer.step_s)} steps "
            f"and {len(rollout_s)} generations"
        )
    return {
        "step_s": timer.step_s,
        "rollout_s": rollout_s,
        "update_s": [s - g for s, g in zip(timer.step_s, rollout_s, strict=True)],
    }


def run_worker(args: argparse.Namespace) -> None:
    """Entry point of ``--worker``: run one side, write its figures to ``--result``."""
    tree = TreeRss()
    tree.start()
    with tempfile.TemporaryDirectory(prefix=f"bench-trl-{args.worker}-") as tmp:
        start = time.perf_counter()
        fn = worker_ours if args.worker == "ours" else worker_trl
        result = fn(args, Path(tmp))
        result["wall_s"] = time.perf_counter() - start
    result["peak_rss_mb"] = peak_rss_mb()
    result["tree_peak_rss_mb"] = tree.stop()
    Path(args.result).write_text(json.dumps(result))


# --- the driver -----------------------------------------------------------------------------


def spawn(side: str, args: argparse.Namespace, tmp: Path, run_no: int) -> dict[str, Any]:
    """Run one side in a fresh process (in this one under ``DAPO_BENCH_IN_PROCESS=1``); its
    figures, or an error with the end of its log."""
    result = tmp / f"{side}-{run_no}.json"
    log = tmp / f"{side}-{run_no}.log"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        side,
        "--result",
        str(result),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--prompts",
        str(args.prompts),
        "--generations",
        str(args.generations),
        "--max-completion-length",
        str(args.max_completion_length),
    ]
    if in_process():  # the smoke test: this process (its peak RSS is the process's so far)
        status = run_here(lambda: main(cmd[2:]), args.threads, log)
    else:
        threads = str(args.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        env["TOKENIZERS_PARALLELISM"] = "false"
        with log.open("w") as fh:
            cmd_run = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        status = cmd_run.returncode
    if status != 0 or not result.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"the {side} worker failed (exit {status}):\n{tail}")
    return json.loads(result.read_text())


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over the kept steps (the first of each run dropped) and the peak RSS."""
    kept = {k: [x for run in runs for x in run[k][1:]] for k in ("step_s", "rollout_s", "update_s")}
    return {
        "median_step_s": statistics.median(kept["step_s"]),
        "median_rollout_s": statistics.median(kept["rollout_s"]),
        "median_update_s": statistics.median(kept["update_s"]),
        "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
        "tree_peak_rss_mb": max(run["tree_peak_rss_mb"] for run in runs),
        "kept_steps": len(kept["step_s"]),
        "runs": runs,
    }


def print_table(results: dict[str, dict[str, Any]], ratio: float) -> None:
    head = (
        f"{'side':<5} {'median s/step':>13} {'rollout s':>10} {'update s':>9} "
        f"{'peak RSS MB':>12} {'with helpers MB':>16} {'steps':>6}"
    )
    print(head)
    for side, r in results.items():
        print(
            f"{side:<5} {r['median_step_s']:>13.3f} {r['median_rollout_s']:>10.3f} "
            f"{r['median_update_s']:>9.3f} {r['peak_rss_mb']:>12.0f} "
            f"{r['tree_peak_rss_mb']:>16.0f} {r['kept_steps']:>6}"
        )
    print(f"throughput ratio (TRL s/step / ours): {ratio:.2f}x")


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        for round_no in range(args.rounds):
            for side in SIDES:  # alternate, so that drifting machine load hits both sides
                t0 = time.perf_counter()
                runs[side].append(spawn(side, args, Path(tmp), round_no))
                print(
                    f"round {round_no + 1}/{args.rounds} {side}: {time.perf_counter() - t0:.0f} s"
                )
    results = {side: summarise(runs[side]) for side in SIDES}
    ratio = results["trl"]["median_step_s"] / results["ours"]["median_step_s"]
    return {
        **provenance(trl=package_version("trl"), accelerate=package_version("accelerate")),
        "settings": {
            "model": "builtin:tiny",
            "prompts_per_step": args.prompts,
            "generations": args.generations,
            "max_completion_length": args.max_completion_length,
            "overlong_buffer": overlong_buffer(args.max_completion_length),
            "updates_per_step": 1,
            "steps_per_run": args.steps,
            "rounds": args.rounds,
            "threads": args.threads,
            "warmup_steps_dropped_per_run": 1,
        },
        "results": results,
        "throughput_ratio": ratio,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="rollout steps per run (>= 2)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternated")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout step")
    parser.add_argument("--generations", type=int, default=8, help="responses per prompt")
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--output", default="benchmarks/results/trl.json")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step of each run is dropped)")
    if args.rounds < 1 or args.threads < 1 or args.prompts < 1 or args.generations < 2:
        parser.error("--rounds, --threads, --prompts need >= 1 and --generations >= 2")
    if args.worker and not args.result:
        parser.error("--worker needs --result")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    if importlib.util.find_spec("trl") is None:
        sys.exit("trl is not installed; it is a benchmark-only extra: pip install -e '.[bench]'")
    report = run_benchmark(args)
    print_table(report["results"], report["throughput_ratio"])
    write_report(args.output, report)


if __name__ == "__main__":
    main()
