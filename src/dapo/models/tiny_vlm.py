"""``builtin:tiny-vlm``: a vision-language model of transformers' Idefics3 class at tiny size.

A SigLIP-style vision tower (2 layers, width 64, 8-pixel patches over a 32x32 image), the
Idefics3 pixel-shuffle connector (4 patches per image token: 4 image tokens per image) and
``builtin:tiny``'s ~1M-parameter Llama with its character tokenizer and the four tokens the
Idefics3 processor needs. The processor is transformers' own Idefics3Processor with its PIL
image processor (no image splitting). Built offline like ``builtin:tiny``, then warmed up
(:func:`warm_up`) on noisy answers of ``builtin:colour_count``.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dapo.atomic import staged_dir
from dapo.data.tasks import colour_count

NAME = "builtin:tiny-vlm"
VERSION = "v1"
IMAGE_SIZE = 32
PATCH = 8
SCALE = 1  # the connector's pixel shuffle: SCALE x SCALE patches per image token
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
SPECIAL = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>")
WARMUP_STEPS = 600
WARMUP_BATCH = 64


def build_processor() -> Any:
    """The character tokenizer with the Idefics3 tokens, and a 32x32 image processor."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    from dapo.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    edge = {"longest_edge": IMAGE_SIZE}
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size=edge, max_image_size=edge, do_resize=True
    )
    return Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=IMAGE_TOKENS)


def build_model(processor: Any, seed: int = 0) -> torch.nn.Module:
    """A random-initialised tiny Idefics3ForConditionalGeneration for ``processor``."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    from dapo.models.tiny import llama_config

    tok = processor.tokenizer
    torch.manual_seed(seed)
    text = llama_config(len(tok))
    assert (text.pad_token_id, text.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
    )
    config = Idefics3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        scale_factor=SCALE,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )
    return Idefics3ForConditionalGeneration(config).float()


def sft_batch(processor: Any, examples: list[tuple[str, Any, str]]) -> dict[str, torch.Tensor]:
    """Model inputs and labels of ``(prompt, image, answer)`` examples; the loss on the answer
    (and the EOS token) only."""
    tok = processor.tokenizer
    ids, labels, images = [], [], []
    for prompt, image, answer in examples:
        p = processor(text=[prompt], images=[[image]], add_special_tokens=False)["input_ids"][0]
        p = list(p)
        r = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids.append(p + r)
        labels.append([-100] * len(p) + r)
        images.append([image])
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tok.pad_token_id)
    label_t = torch.full((len(ids), width), -100)
    attn = torch.zeros((len(ids), width), dtype=torch.long)
    for i, (x, y) in enumerate(zip(ids, labels, strict=True)):
        input_ids[i, : len(x)], label_t[i, : len(y)], attn[i, : len(x)] = (
            torch.tensor(x),
            torch.tensor(y),
            1,
        )
    pixels = processor.image_processor(images=images, return_tensors="pt")
    return {
        "input_ids": input_ids,
        "attention_mask": attn,
        "labels": label_t,
        "pixel_values": pixels["pixel_values"],
        "pixel_attention_mask": pixels["pixel_attention_mask"],
    }


def warm_up(
    out_dir: Path, steps: int = WARMUP_STEPS, seed: int = 0, log: Callable[[str], None] = print
) -> Path:
    """Build the model, train it (supervised, loss on the answer) on noisy answers of
    ``builtin:colour_count`` for ``steps`` batches, save it with its processor."""
    processor = build_processor()
    model = build_model(processor, seed=seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    rng = random.Random(seed)
    start = time.time()
    every = max(1, steps // 10)
    for step in range(steps):
        batch = sft_batch(processor, [colour_count.sft_example(rng) for _ in range(WARMUP_BATCH)])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % every == 0:
            log(f"warm-up {step + 1}/{steps}: loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    model.eval()
    with staged_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        meta = {"name": NAME, "version": VERSION, "steps": steps, "seed": seed}
        (tmp / "builtin.json").write_text(json.dumps(meta | {"seconds": time.time() - start}))
    return out_dir


SHIPPED = Path(__file__).parent / "builtin" / f"builtin-tiny-vlm-{VERSION}"


def ensure_builtin_vlm(log: Callable[[str], None] = print) -> Path:
    """The warmed-up ``builtin:tiny-vlm``: the shipped copy, else one built once into the
    dapo cache (``$DAPO_BUILD_BUILTIN=1`` builds it again)."""
    import fcntl
    import os

    from dapo.models.cache import cache_root
    from dapo.models.tiny import BUILD_ENV

    if os.environ.get(BUILD_ENV, "").strip() != "1" and (SHIPPED / "builtin.json").is_file():
        return SHIPPED
    path = cache_root() / SHIPPED.name
    if (path / "builtin.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.with_name(f".{path.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others use its model
        if not (path / "builtin.json").is_file():
            log(f"building {NAME} (first use, about 2 minutes; cached in {path}) ...")
            warm_up(path, log=log)
    return path
