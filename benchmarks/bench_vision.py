"""What images cost in a rollout step: the same step with and without them, timed alone.

The warmed-up ``builtin:tiny-vlm`` takes ``--prompts`` problems of ``builtin:colour_count``
with ``--n`` responses each through the parts of a rollout step, twice:

- **visual**: the prompts as the trainer has them (their image tokens stand for the images'
  features: the image processor's pixels, the vision encoder and the connector run in the
  engine's prefill and in every training forward's prompt pass);
- **text**: the same token ids with every image token replaced by a text token and no image
  (the language model does exactly the same work; nothing of the vision side runs).

Each part is timed ``--repeats`` times (medians): ``generate`` (the engine, sampling
``--max-tokens`` tokens), ``old_logprobs`` (a no-grad forward of the step's samples) and
``update`` (the policy's forward and backward). The pixels are computed afresh for every
repeat (the image processor's cost counts too). ``--engine vllm`` generates with the vLLM
engine instead (the vllm extra): its caches of image features and of processed images are
dropped before every repeat, as a weight sync and new prompts drop them in training. Prints a table and ``--json OUT`` writes
``{"settings", "results": {part: {"visual_s", "text_s", "median_visual_s",
"median_text_s", "ratio"}}, "step": {...}}`` (``ratio``: visual over text).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm-up: first-call allocations, kernel selection
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="for generate")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from dapo.data.images import ImagePrompt, encode_with_images, render_with_images
    from dapo.data.tasks import colour_count
    from dapo.models import load_policy, resolve_model_path
    from dapo.models.vision import load_processor, pixel_cache
    from dapo.rollout.base import SamplingParams, close_engine
    from dapo.rollout.hf_engine import HFEngine
    from dapo.training.batch import Sample
    from dapo.training.forward import ForwardOptions, compute_logprobs, response_logprobs
    from dapo.training.microbatch import collate

    path = resolve_model_path("builtin:tiny-vlm")
    processor = load_processor(path)
    model = load_policy(path)
    tok = processor.tokenizer
    records = colour_count.colour_count_records("test", n=args.prompts)
    texts = [render_with_images(r.prompt, processor) for r in records]
    visual = encode_with_images(
        texts, [r.images for r in records], processor, pixel_cache(processor)
    )
    image_token = model.config.image_token_id
    filler = tok.convert_tokens_to_ids("x")
    text = [[filler if t == image_token else t for t in p] for p in visual]
    if args.engine == "vllm":
        from dapo.rollout.vllm_engine import VLLMEngine

        engine: Any = VLLMEngine(
            model, tok.eos_token_id, max_model_len=256, processor=processor,
            mm_processor_cache_gb=0,  # no cache of processed images across repeats
        )  # fmt: skip
    else:
        engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    opts = ForwardOptions(tok.pad_token_id)

    def fresh(prompts: list) -> list:
        """The prompts with their pixels to compute again (each repeat pays for them)."""
        if not isinstance(prompts[0], ImagePrompt):
            return prompts
        cache = pixel_cache(processor)
        if args.engine == "vllm":
            engine.reset_caches()  # its image features, as after a weight sync
        return [ImagePrompt(list(p), p.images, cache, p.digest, p.spans, p.raw) for p in prompts]

    def samples_of(prompts: list) -> list:
        groups = engine.generate(prompts, params)
        return [
            Sample(g.prompt_ids, r, 1.0, [1.0] * len(r)) for g in groups for r in g.response_ids
        ]

    def update(samples: list) -> None:
        batch = collate(samples, tok.pad_token_id)
        logp, _ = response_logprobs(model, batch, opts)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)

    results: dict[str, dict[str, Any]] = {}
    for name, prompts in (("visual", visual), ("text", text)):
        samples = samples_of(prompts)
        kept = [s.response_ids for s in samples]  # both sides train on the same responses

        def with_fresh(prompts: list = prompts, kept: list = kept) -> list:
            ps = fresh(prompts)
            return [Sample(ps[i // args.n], r, 1.0, [1.0] * len(r)) for i, r in enumerate(kept)]

        timings = {
            "generate": _timed(lambda p=prompts: engine.generate(fresh(p), params), args.repeats),
            "old_logprobs": _timed(
                lambda: compute_logprobs(model, with_fresh(), opts), args.repeats
            ),
            "update": _timed(lambda: update(with_fresh()), args.repeats),
        }
        for part, times in timings.items():
            results.setdefault(part, {})[f"{name}_s"] = times
    for r in results.values():
        r["median_visual_s"] = statistics.median(r["visual_s"])
        r["median_text_s"] = statistics.median(r["text_s"])
        r["ratio"] = r["median_visual_s"] / r["median_text_s"]
    step = {k: sum(r[f"median_{k}_s"] for r in results.values()) for k in ("visual", "text")}
    step["ratio"] = step["visual"] / step["text"]
    report = {
        "settings": {
            "model": "builtin:tiny-vlm",
            "engine": args.engine,
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "prompt_tokens": len(visual[0]),
            "image_tokens": sum(t == image_token for t in visual[0]),
        },
        "results": results,
        "step": step,
    }
    print(f"| part ({args.prompts} x {args.n}) | visual (s) | text (s) | visual / text |")
    print("|---|---|---|---|")
    for part, r in results.items():
        print(
            f"| {part} | {r['median_visual_s']:.4f} | {r['median_text_s']:.4f} | "
            f"{r['ratio']:.2f}x |"
        )
    print(f"| step | {step['visual']:.4f} | {step['text']:.4f} | {step['ratio']:.2f}x |")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    close_engine(engine)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
