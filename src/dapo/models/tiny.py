"""The built-in models: a character tokenizer and a ~1M-parameter Llama the project warms up.

Nothing is downloaded. Each built-in model is the same small Llama trained briefly
(supervised, loss on the response only) on noisy worked solutions of one built-in task, and
cached: ``builtin:tiny`` on ``builtin:addition`` (the default run), ``builtin:tiny-long`` on
``builtin:long_addition`` (the ablation ladder's task), ``builtin:tiny-tool`` on transcripts
of ``builtin:calculator`` episodes (multi-turn, with a chat template of its own; the loss
on the assistant's turns only).

``builtin:tiny`` and ``builtin:tiny-tool`` ship with the package as :func:`warm_up` built
them (``dapo/models/builtin``, 3 MB each), so that a first run does not spend two minutes
building one; ``$DAPO_BUILD_BUILTIN=1`` builds them again instead, and a recipe whose version
differs from the shipped copy's is built on first use.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dapo.atomic import atomic_write, staged_dir
from dapo.data.tasks import addition, calculator, code, long_addition
from dapo.models.cache import BUILTIN_MODEL, BUILTIN_MODELS, cache_root


@dataclass(frozen=True)
class Recipe:
    """How one built-in model is warmed up."""

    # (prompt, noisy worked solution), or a noisy multi-turn transcript (chat messages)
    sft_example: Callable[[random.Random], tuple[str, str] | list[dict[str, str]]]
    version: str  # bump when the task, tokenizer, model or warm-up change
    steps: int  # supervised steps of WARMUP_BATCH examples
    minutes: str  # the warm-up's time on 2 CPU cores, for the log
    length_buckets: int = 1  # >1: batch examples of similar length together (less padding)
    base: str | None = None  # start from this built-in model's weights (None: random ones)
    lr: float = 3e-3  # peak AdamW learning rate (50 warm-up steps, then cosine to 0)
    chat_template: str | None = None  # the tokenizer's; transcripts are rendered with it
    tools: tuple[Callable[..., object], ...] = ()  # the transcripts' tools (their schemas)


RECIPES = {
    BUILTIN_MODEL: Recipe(addition.sft_example, "v3", steps=300, minutes="about 2 minutes"),
    # builtin:tiny already writes column additions; the long sums take it much further in
    # a few minutes than a random start does.
    "builtin:tiny-long": Recipe(
        long_addition.sft_example,
        "v1",
        steps=300,
        minutes="about 3 minutes",
        length_buckets=4,
        base=BUILTIN_MODEL,
    ),
    # Multi-turn: the loss is on the assistant's turns of builtin:calculator transcripts.
    # From builtin:tiny, which already writes digits and the answer format.
    "builtin:tiny-tool": Recipe(
        calculator.sft_example,
        "v1",
        steps=200,
        minutes="about 2.5 minutes",
        base=BUILTIN_MODEL,
        chat_template=calculator.CHAT_TEMPLATE,
        tools=(calculator.add,),
    ),
    # Two-line programs from specifications in words; from builtin:tiny, which already
    # writes digits and arithmetic.
    "builtin:tiny-code": Recipe(
        code.sft_example, "v1", steps=300, minutes="about 2 minutes", base=BUILTIN_MODEL
    ),
}
assert set(RECIPES) == set(BUILTIN_MODELS)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]

WARMUP_BATCH = 64  # examples per warm-up step, for every built-in model


def build_tokenizer(chat_template: str | None = None):
    """A character-level fast tokenizer (every printable ASCII character and newline), with
    ``chat_template`` if given."""
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
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def build_model(vocab_size: int, seed: int = 0):
    """A ~1M-parameter Llama (a standard transformers architecture).

    Llama rather than Qwen2: transformers 5 loads a Qwen2 checkpoint's tokenizer as
    ``Qwen2Tokenizer`` whatever its ``tokenizer_config.json`` says, which would silently
    replace the character tokenizer for anyone who loads the saved model.
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(vocab_size)).float()


def llama_config(vocab_size: int):
    """The built-in models' Llama: 4 layers of width 128, tied embeddings, the character
    tokenizer's pad (0) and EOS (1) ids; also ``builtin:tiny-vlm``'s text model."""
    from transformers import LlamaConfig

    return LlamaConfig(
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


# --- the warm-up ---------------------------------------------------------------------------


SHIPPED = Path(__file__).parent / "builtin"  # the warmed-up models shipped with the package
BUILD_ENV = "DAPO_BUILD_BUILTIN"  # "1": build the built-in models, ignoring the shipped ones


def shipped_model(name: str) -> Path | None:
    """The shipped copy of built-in model ``name`` when it was built by the current recipe
    (name, version, steps, seed 0), else None."""
    path = SHIPPED / cache_dir(name).name
    try:
        meta = json.loads((path / "builtin.json").read_text())
    except (OSError, ValueError):
        return None
    recipe = RECIPES[name]
    made = (meta.get("name"), meta.get("version"), meta.get("steps"), meta.get("seed"))
    return path if made == (name, recipe.version, recipe.steps, 0) else None


def cache_dir(name: str = BUILTIN_MODEL) -> Path:
    """Where a warmed-up model lives (``$DAPO_CACHE`` or ``~/.cache/dapo``), e.g.
    ``builtin-tiny-v3`` for ``builtin:tiny``."""
    return cache_root() / f"{name.replace(':', '-')}-{RECIPES[name].version}"


def _sft_examples(recipe: Recipe, rng: random.Random) -> Iterator[list[tuple[str, str]]]:
    """Endless warm-up batches of (prompt, solution) pairs. With ``length_buckets`` B > 1,
    B batches are drawn at once, cut by length and visited in random order: tasks whose
    solutions vary several-fold in length waste most of a batch on padding otherwise."""
    while True:
        pool = [recipe.sft_example(rng) for _ in range(WARMUP_BATCH * recipe.length_buckets)]
        if recipe.length_buckets > 1:
            pool.sort(key=lambda ex: len(ex[0]) + len(ex[1]))
        batches = [pool[i : i + WARMUP_BATCH] for i in range(0, len(pool), WARMUP_BATCH)]
        if recipe.length_buckets > 1:
            rng.shuffle(batches)
        yield from batches


def _sft_batch(tok, examples: list, renderer=None) -> tuple[torch.Tensor, ...]:
    """Padded ids, attention mask and labels; the loss is on the solutions, or on the
    assistant's turns of transcripts (rendered token-in/token-out as episodes are)."""
    ids, labels = [], []
    size = len(examples)
    for example in examples:
        if isinstance(example, list):
            x, mask = renderer.transcript(example)
            ids.append(x)
            labels.append([t if m else -100 for t, m in zip(x, mask, strict=True)])
            continue
        prompt, solution = example
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
    name: str = BUILTIN_MODEL,
    steps: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Path:
    """Build the tiny model, train it on the noisy worked solutions of ``name``'s task for
    ``steps`` (default: the recipe's), save it to ``out_dir``.

    The loss is masked to the response: with the prompt in the loss the model spends its
    capacity on the (constant) instructions and barely learns to add.
    """
    recipe = RECIPES[name]
    steps = recipe.steps if steps is None else steps
    tok = build_tokenizer(recipe.chat_template)
    renderer = None
    if recipe.chat_template is not None:
        from dapo.environments.rendering import ChatRenderer
        from dapo.environments.tools import tool_schema

        schemas = [tool_schema(fn, f"{name} tools") for fn in recipe.tools]
        renderer = ChatRenderer(tok, schemas)
    if recipe.base is None:
        model = build_model(len(tok), seed=seed)
    else:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(ensure_builtin_model(recipe.base, log=log))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    batches = _sft_examples(recipe, random.Random(seed))
    every = max(1, steps // 10)
    progress = progress_path(out_dir)
    run = {"name": name, "version": recipe.version, "steps": steps, "seed": seed}
    first = _resume(progress, run, model, opt, sched)
    if first:
        log(f"resuming the warm-up of {name} at step {first}/{steps} (saved progress)")
    for _ in range(first):  # the batches of the steps done: the data stream is seeded
        next(batches)
    start = time.time()
    for step in range(first, steps):
        input_ids, attn, labels = _sft_batch(tok, next(batches), renderer)
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % every == 0:
            if step + 1 < steps:  # an interrupted build goes on from here
                state = {"run": run, "step": step + 1, "model": model.state_dict()}
                state |= {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
                atomic_write(progress, lambda f, state=state: torch.save(state, f))
            log(f"warm-up {step + 1}/{steps}: loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    model.eval()
    with staged_dir(out_dir) as tmp:  # another process may finish first: then its copy stays
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        meta = {
            "name": name,
            "version": recipe.version,
            "steps": steps,
            "seed": seed,
            "seconds": time.time() - start,
        }
        (tmp / "builtin.json").write_text(json.dumps(meta))
    progress.unlink(missing_ok=True)
    return out_dir


def progress_path(out_dir: Path) -> Path:
    """Where the warm-up of ``out_dir`` keeps its progress until the model is saved."""
    return out_dir.with_name(f".{out_dir.name}.progress.pt")


def _resume(progress: Path, run: dict, model: Any, opt: Any, sched: Any) -> int:
    """Load the saved progress of the same warm-up (``run``: name, version, steps, seed)
    into the model, optimizer and schedule; the step to go on from (0: none usable)."""
    if not progress.is_file():
        return 0
    try:
        state = torch.load(progress, map_location="cpu", weights_only=True)
        if state.get("run") != run:
            return 0
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
    except Exception:  # noqa: BLE001 - a torn or stale file: build from the start
        return 0
    return int(state["step"])


def ensure_builtin_model(name: str = BUILTIN_MODEL, log: Callable[[str], None] = print) -> Path:
    """Path of the warmed-up built-in model ``name``: the shipped copy, or one built on first
    use (:data:`BUILD_ENV`, or no shipped copy of the recipe's version)."""
    shipped = shipped_model(name) if os.environ.get(BUILD_ENV, "").strip() != "1" else None
    if shipped is not None:
        return shipped
    path = cache_dir(name)
    if (path / "builtin.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time: a second process waits for the first and uses its model.
    with path.with_name(f".{path.name}.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process building {name} (cached in {path}) ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "builtin.json").is_file():
            return path
        log(f"building {name} (first use, {RECIPES[name].minutes}; cached in {path}) ...")
        torch_threads = torch.get_num_threads()
        try:
            return warm_up(path, name, log=log)
        finally:
            torch.set_num_threads(torch_threads)
