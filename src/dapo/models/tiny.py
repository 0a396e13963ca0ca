"""``builtin:tiny``: a character tokenizer and a ~1M-parameter Llama the project warms up itself.

Nothing is downloaded. The model is trained briefly (supervised, loss on the response only)
on noisy worked solutions of the built-in addition task and cached.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dapo.atomic import staged_dir
from dapo.data.tasks.addition import sft_example
from dapo.models.loading import BUILTIN_MODEL, cache_root

NAME = BUILTIN_MODEL
_VERSION = "v3"  # bump when the task, tokenizer, model or warm-up change

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]

# Warm-up settings: chosen so that set-up takes about 2 minutes on 2 CPU cores.
WARMUP_STEPS = 300
WARMUP_BATCH = 64
WARMUP_LR = 3e-3


def build_tokenizer():
    """A character-level fast tokenizer (every printable ASCII character and newline)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *_CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split on every character, keeping spaces and newlines (an empty-string split drops them).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK
    )
    tok.padding_side = "left"
    return tok


def build_model(vocab_size: int, seed: int = 0):
    """A ~1M-parameter Llama (a standard transformers architecture).

    Llama rather than Qwen2: transformers 5 loads a Qwen2 checkpoint's tokenizer as
    ``Qwen2Tokenizer`` whatever its ``tokenizer_config.json`` says, which would silently
    replace the character tokenizer for anyone who loads the saved model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config).float()


# --- the warm-up ---------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where the warmed-up model lives (under ``$DAPO_CACHE`` or ``~/.cache/dapo``)."""
    return cache_root() / f"builtin-tiny-{_VERSION}"


def _sft_batch(tok, rng: random.Random, size: int) -> tuple[torch.Tensor, ...]:
    ids, labels = [], []
    for _ in range(size):
        prompt, solution = sft_example(rng)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(solution, add_special_tokens=False)["input_ids"]
        r = r + [tok.eos_token_id]
        ids.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(map(len, ids))
    input_ids = torch.full((size, width), tok.pad_token_id)
    label_t = torch.full((size, width), -100)
    attn = torch.zeros((size, width), dtype=torch.long)
    for i, (x, y) in enumerate(zip(ids, labels, strict=True)):
        input_ids[i, : len(x)] = torch.tensor(x)
        label_t[i, : len(y)] = torch.tensor(y)
        attn[i, : len(x)] = 1
    return input_ids, attn, label_t


def warm_up(
    out_dir: Path,
    steps: int = WARMUP_STEPS,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Path:
    """Build the tiny model, train it on noisy worked solutions, save it to ``out_dir``.

    The loss is masked to the response: with the prompt in the loss the model spends its
    capacity on the (constant) instructions and barely learns to add.
    """
    tok = build_tokenizer()
    model = build_model(len(tok), seed=seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    rng = random.Random(seed)
    start = time.time()
    for step in range(steps):
        input_ids, attn, labels = _sft_batch(tok, rng, WARMUP_BATCH)
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % max(1, steps // 10) == 0:
            log(f"warm-up {step + 1}/{steps}: loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    model.eval()
    with staged_dir(out_dir) as tmp:  # another process may finish first: then its copy stays
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "builtin.json").write_text(
            json.dumps({"version": _VERSION, "steps": steps, "seed": seed, "seconds": time.time() - start})
        )
    return out_dir


def ensure_builtin_model(log: Callable[[str], None] = print) -> Path:
    """Path of the warmed-up ``builtin:tiny``, building it on first use (about 2 minutes)."""
    path = cache_dir()
    if (path / "builtin.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"building builtin:tiny (first use; cached in {path}) ...")
    torch_threads = torch.get_num_threads()
    try:
        return warm_up(path, log=log)
    finally:
        torch.set_num_threads(torch_threads)
