"""Peak memory of one rollout step (generation + update): dapo's precisions against TRL.

The model is a Llama with the shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2
key/value heads, MLP 4864, vocabulary 151,936, tied embeddings; ~494M parameters) and random
weights, built once and saved; the tokenizer is dapo's character tokenizer (the prompts are
``builtin:addition``'s, the responses random tokens of the model's vocabulary). Each side
runs one rollout step in a fresh process: ``--prompts`` prompts x ``--generations``
responses of at most ``--max-completion-length`` tokens (a random model over 151,936 tokens
samples EOS with probability ~1e-5 per token, so every response has the full length: the
JSON records the lengths), then one optimizer update (AdamW; DAPO loss, beta 0, no dynamic
sampling, no overlong filtering):

- ``fp32``, ``bf16-mixed``, ``bf16-mixed+ckpt`` (``model.gradient_checkpointing=true``): our
  ``Trainer.train_step()`` with ``train.precision`` set so;
- ``trl``: TRL's ``GRPOTrainer`` with bf16 autocast (``bf16=True``), gradient checkpointing,
  the whole rollout in one update (``per_device_train_batch_size`` = prompts x generations).

Memory: on CUDA ``torch.cuda.max_memory_allocated`` over the step (weights and optimizer
state included); on CPU the process's peak resident memory during the step (``VmHWM`` after
resetting it through ``/proc/self/clear_refs`` once the model is loaded, so a transient of
loading does not count), and also the resident memory before the step. A table and JSON.

    python benchmarks/bench_memory.py [--prompts 2] [--generations 4] [--max-completion-length 32]
        [--sides fp32,bf16-mixed,bf16-mixed+ckpt,trl] [--output benchmarks/results/memory.json]

On a GPU, a Qwen2.5-0.5B-sized rollout step: ``--prompts 32 --generations 8 --max-completion-length 256``.

``--long-responses 1024,2048,4096,8192`` measures instead one update on long responses per
side and length (``benchmarks/_long_responses.py``): the JSON's ``long`` lists records with
``side`` (``dapo`` or ``trl``), ``tokens``, ``peak_mb`` and ``seconds``. Use few layers:
``--layers 4``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _long_responses as long  # benchmarks/_long_responses.py
from _in_process import in_process, run_here  # benchmarks/_in_process.py
from _report import package_version, provenance, write_report  # benchmarks/_report.py
from bench_trl import overlong_buffer, trl_reward  # the TRL side's reward, shared

SIDES = ("fp32", "bf16-mixed", "bf16-mixed+ckpt", "trl")
QWEN_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "mlp": 4864, "vocab": 151936}


# --- memory probes ---------------------------------------------------------------------------


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    return 0.0


class StepMemory:
    """Peak memory of the code between :meth:`start` and :meth:`stop`: CUDA allocations, or the
    process's resident set (Linux: peak reset through ``clear_refs``)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def start(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / 2**20
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.before = _status_mb("VmRSS")
        return self.before

    def stop(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**20
        # The kernel's RSS counters lag by a few pages per thread: a VmHWM read after the
        # step was 8 kB under the VmRSS read before it (CI, 2026-11-28). The peak of the
        # step includes its start.
        return max(_status_mb("VmHWM"), self.before)


# --- the model --------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, path: Path) -> None:
    """A Llama of the configured shape with random weights (seed 0), saved with dapo's
    character tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dapo.models.tiny import build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, 64 + max(args.long_responses, default=0)),
        rope_theta=1e6,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)


# --- workers (one fresh process per side) -----------------------------------------------------


def worker_ours(args: argparse.Namespace, model_dir: Path, side: str, tmp: Path) -> dict[str, Any]:
    import torch

    from dapo.config import load_config
    from dapo.training.trainer import Trainer

    precision = "fp32" if side == "fp32" else "bf16-mixed"
    cfg = load_config(
        overrides=[
            f"model.name_or_path={model_dir}",
            f"output_dir={tmp / 'run'}",
            "preset=dapo",
            "algorithm.dynamic_sampling=false",
            "algorithm.overlong_filter=false",
            f"algorithm.overlong_buffer={overlong_buffer(args.max_completion_length)}",
            f"train.prompts_per_step={args.prompts}",
            f"train.mini_batch_size={args.prompts}",
            f"rollout.num_generations={args.generations}",
            f"rollout.max_completion_length={args.max_completion_length}",
            f"train.precision={precision}",
            f"model.gradient_checkpointing={str(side.endswith('+ckpt')).lower()}",
            "train.steps=1",
            "evaluate=false",
            "reward.num_workers=0",
            "logging.console=false",
            "logging.tensorboard=false",
            "checkpoint.save_every=0",
        ]
    )
    trainer = Trainer(cfg, log=lambda _: None)
    probe = StepMemory(torch.cuda.is_available())
    before = probe.start()
    start = time.perf_counter()
    metrics, groups = trainer.train_step()
    seconds = time.perf_counter() - start
    peak = probe.stop()
    trainer.close()
    lengths = [len(x) for g in groups for x in g.response_ids]
    return {
        "before_mb": before,
        "peak_mb": peak,
        "step_s": seconds,
        "lengths": lengths,
        "grad_norm": metrics["actor/grad_norm"],
    }


def worker_trl(args: argparse.Namespace, model_dir: Path, side: str, tmp: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from dapo.config import load_config
    from dapo.data import encode_prompts, load_prompt_set
    from dapo.models import load_tokenizer

    cuda = torch.cuda.is_available()
    cfg = load_config(overrides=[f"model.name_or_path={model_dir}"])
    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    records, _, _ = encode_prompts(
        load_prompt_set(cfg.data, "train"), tokenizer, cfg.data.max_prompt_length
    )
    dataset = Dataset.from_dict(
        {"prompt": [x.prompt for x in records], "ground_truth": [x.ground_truth for x in records]}
    )
    a, t = cfg.algorithm, cfg.train
    config = GRPOConfig(
        output_dir=str(tmp / "trl"),
        use_cpu=not cuda,
        bf16=True,
        gradient_checkpointing=True,
        seed=cfg.seed,
        max_steps=1,
        per_device_train_batch_size=args.prompts * args.generations,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        top_p=1.0,
        loss_type="dapo",
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        beta=0.0,
        scale_rewards="group",
        mask_truncated_completions=False,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    buffer = overlong_buffer(args.max_completion_length)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward(args.max_completion_length, buffer),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    lengths: list[int] = []
    score = trainer._generate_and_score_completions

    def record(inputs: Any) -> Any:
        out = score(inputs)
        lengths.extend(out["completion_mask"].sum(-1).tolist())
        return out

    trainer._generate_and_score_completions = record
    probe = StepMemory(cuda)
    before = probe.start()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    return {"before_mb": before, "peak_mb": probe.stop(), "step_s": seconds, "lengths": lengths}


def run_worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix=f"bench-memory-{args.worker}-") as tmp:
        probe = StepMemory(torch.cuda.is_available())
        if args.worker == "long-dapo":
            result = long.worker_dapo(args, Path(args.model_dir), probe)
        elif args.worker == "long-trl":
            result = long.worker_trl(args, Path(args.model_dir), probe, Path(tmp))
        else:
            fn = worker_trl if args.worker == "trl" else worker_ours
            result = fn(args, Path(args.model_dir), args.worker, Path(tmp))
    Path(args.result).write_text(json.dumps(result))


def run_long(args: argparse.Namespace) -> dict[str, Any]:
    """One update per side and response length (``_long_responses``), smallest first."""
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-long-") as tmp:
        model_dir = Path(tmp) / "model"
        _python(args, Path(tmp) / "build.log", "--build", str(model_dir))
        for tokens in sorted(args.long_responses):
            for side in ("dapo", "trl"):
                predicted = long.predicted_peak(long.measured(records, side), tokens)
                if predicted is not None and predicted > args.long_limit_mb:
                    records.append(
                        {
                            "side": side,
                            "tokens": tokens,
                            "peak_mb": None,
                            "skipped": f"predicted {predicted:.0f} MB > "
                            f"--long-limit-mb {args.long_limit_mb:.0f}",
                        }
                    )
                    continue
                result = Path(tmp) / f"{side}-{tokens}.json"
                _python(
                    args,
                    Path(tmp) / f"{side}-{tokens}.log",
                    "--worker",
                    f"long-{side}",
                    "--tokens",
                    str(tokens),
                    "--result",
                    str(result),
                    "--model-dir",
                    str(model_dir),
                )
                records.append({"side": side, "tokens": tokens, **json.loads(result.read_text())})
                r = records[-1]
                print(f"{side} {tokens}: peak {r['peak_mb']:.0f} MB, {r['seconds']:.1f} s")
    return {
        **provenance(trl=package_version("trl")),
        "settings": {
            "model": {**{k: getattr(args, k) for k in QWEN_05B}, "parameters": _parameters(args)},
            "responses": args.long_count,
            "prompt_tokens": long.PROMPT,
            "micro_batch_tokens": args.long_micro_batch_tokens,
            "logits_chunk_size": args.long_logits_chunk,
            "budget_mb": args.long_budget_mb,
            "threads": args.threads,
        },
        "long": records,
        "summary": long.summarise(records, args.long_budget_mb),
    }


def print_long(report: dict[str, Any]) -> None:
    print("| side | response tokens | peak MB | update s |")
    print("|---|---|---|---|")
    for r in report["long"]:
        if r["peak_mb"] is None:
            print(f"| {r['side']} | {r['tokens']} | not run: {r['skipped']} | |")
        else:
            print(f"| {r['side']} | {r['tokens']} | {r['peak_mb']:.0f} | {r['seconds']:.1f} |")
    s = report["summary"]
    for side in ("dapo", "trl"):
        per = ", ".join(f"{x:.0f}" for x in s[side]["mb_per_1k_tokens"])
        fit = s[side]["longest_fit"]
        fits = f"{fit:.0f}" if fit else "n/a"
        print(
            f"{side}: MB per 1,000 more tokens {per}; longest fit in "
            f"{report['settings']['budget_mb']:.0f} MB: {fits} tokens"
        )
    if "peak_4096_over_trl" in s:
        print(f"peak at 4096 tokens, dapo / TRL: {s['peak_4096_over_trl']:.2f}")
    if "longest_fit_over_trl" in s:
        print(f"longest fit, dapo / TRL: {s['longest_fit_over_trl']:.1f}x")


# --- the driver -----------------------------------------------------------------------------


def _python(args: argparse.Namespace, log: Path, *argv: str) -> None:
    """This script with ``argv`` (and the model's shape) in a fresh process, or with
    ``DAPO_BENCH_IN_PROCESS=1`` in this one (the peak is still the step's own: ``StepMemory``
    resets the process's peak before it)."""
    if in_process():
        status = run_here(lambda: main([*argv, *shape_argv(args)]), args.threads, log)
        if status != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"{' '.join(argv[:2])} failed (exit {status}):\n{tail}")
        return
    threads = str(args.threads)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
    }
    if args.long_responses:  # see _long_responses.py: freed blocks go back to the system
        env["MALLOC_MMAP_THRESHOLD_"] = str(long.MMAP_THRESHOLD)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, *shape_argv(args)]
    with log.open("w") as fh:
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{' '.join(argv[:2])} failed (exit {proc.returncode}):\n{tail}")


def shape_argv(args: argparse.Namespace) -> list[str]:
    out = [
        "--threads",
        str(args.threads),
        "--prompts",
        str(args.prompts),
        "--generations",
        str(args.generations),
        "--max-completion-length",
        str(args.max_completion_length),
    ]
    for key in QWEN_05B:
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out += [
        "--long-count",
        str(args.long_count),
        "--long-micro-batch-tokens",
        str(args.long_micro_batch_tokens),
        "--long-logits-chunk",
        str(args.long_logits_chunk),
    ]
    if args.long_responses:
        out += ["--long-responses", ",".join(map(str, args.long_responses))]
    return out


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        model_dir = Path(tmp) / "model"
        _python(args, Path(tmp) / "build.log", "--build", str(model_dir))
        for side in args.sides:
            t0 = time.perf_counter()
            result = Path(tmp) / f"{side}.json"
            _python(
                args,
                Path(tmp) / f"{side}.log",
                "--worker",
                side,
                "--result",
                str(result),
                "--model-dir",
                str(model_dir),
            )
            results[side] = json.loads(result.read_text())
            print(f"{side}: {time.perf_counter() - t0:.0f} s")
    import torch

    cuda = torch.cuda.is_available()
    ratio = None
    if "trl" in results and "bf16-mixed+ckpt" in results:
        ratio = results["bf16-mixed+ckpt"]["peak_mb"] / results["trl"]["peak_mb"]
    params = _parameters(args)
    return {
        **provenance(trl=package_version("trl"), accelerate=package_version("accelerate")),
        "settings": {
            "model": {**{k: getattr(args, k) for k in QWEN_05B}, "parameters": params},
            "prompts": args.prompts,
            "generations": args.generations,
            "max_completion_length": args.max_completion_length,
            "threads": args.threads,
            "memory": "torch.cuda.max_memory_allocated" if cuda else "peak RSS (VmHWM) of the step",
        },
        "results": results,
        "ckpt_over_trl": ratio,
    }


def _parameters(args: argparse.Namespace) -> int:
    h, kv = args.hidden, args.hidden // args.heads * args.kv_heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * args.mlp + 2 * h
    return args.vocab * h + args.layers * layer + h  # tied embeddings


def print_table(report: dict[str, Any]) -> None:
    print(f"{'side':<16} {'before MB':>10} {'peak MB':>10} {'step s':>8}")
    for side, r in report["results"].items():
        print(f"{side:<16} {r['before_mb']:>10.0f} {r['peak_mb']:>10.0f} {r['step_s']:>8.1f}")
    if report["ckpt_over_trl"] is not None:
        print(f"bf16-mixed+ckpt peak / TRL peak: {report['ckpt_over_trl']:.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}"
    )
    for key, value in QWEN_05B.items():
        parser.add_argument(
            f"--{key.replace('_', '-')}",
            type=int,
            default=value,
            help="model shape (default: Qwen2.5-0.5B's)",
        )
    parser.add_argument(
        "--long-responses",
        default="",
        help="comma-separated response lengths: one update per side and length, dapo "
        "(packed, chunked head, activation checkpointing) against TRL; see _long_responses.py",
    )
    parser.add_argument("--long-count", type=int, default=2, help="responses per update")
    parser.add_argument("--long-micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--long-logits-chunk", type=int, default=256)
    parser.add_argument("--long-budget-mb", type=float, default=16000.0)
    parser.add_argument("--long-limit-mb", type=float, default=18000.0)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--output", default="benchmarks/results/memory.json")
    parser.add_argument("--build", help=argparse.SUPPRESS)
    parser.add_argument(
        "--worker", choices=[*SIDES, "long-dapo", "long-trl"], help=argparse.SUPPRESS
    )
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    args.long_responses = [int(x) for x in args.long_responses.split(",") if x]
    if unknown := set(args.sides) - set(SIDES):
        parser.error(f"unknown sides {sorted(unknown)}; choose from {', '.join(SIDES)}")
    if args.prompts < 1 or args.generations < 2 or args.max_completion_length < 2:
        parser.error("--prompts >= 1, --generations >= 2, --max-completion-length >= 2")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.build:
        build_model(args, Path(args.build))
        return
    if args.worker:
        run_worker(args)
        return
    needs_trl = "trl" in args.sides or args.long_responses
    if needs_trl and importlib.util.find_spec("trl") is None:
        sys.exit("trl is not installed; it is a benchmark-only extra: pip install -e '.[bench]'")
    if args.long_responses:
        report = run_long(args)
        print_long(report)
        write_report(args.output, report)
        return
    report = run_benchmark(args)
    print_table(report)
    write_report(args.output, report)


if __name__ == "__main__":
    main()
