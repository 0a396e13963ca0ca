"""The transformers engine: sampling with the policy module itself, in the training process.

:class:`HFEngine` runs its own decoding loop (:mod:`dapo.rollout.decode`: a static key/value
cache, a decode step of static shapes, continuous batching, CUDA graphs on CUDA), so that it
returns log-probs cheaply and shares one prompt prefill across a group. While it generates,
the model's attention is :func:`~dapo.rollout.attention.decode_attention`: for one new token
per row, a grouped-query attention written as two batched products over the static cache
(each key/value head read once for its group of query heads, a boolean mask for the row's
slots, a prefix all rows share read through its one copy); for prompts, SDPA (on CPU with
``enable_gqa``: transformers' own sdpa attention copies the grouped heads out whenever a
padding mask is given, which made SmolLM2's attention 9x slower). The weights are read in
the dtype the products run in (:class:`~dapo.models.precision.GenerationWeights`); on CUDA,
bf16 copies over :data:`~dapo.rollout.buffers.KEEP_BYTES` are freed after each call for
training's use, as caches over it are on every device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dapo.choices import CUDA_GRAPHS
from dapo.data.images import copy_prompt
from dapo.models.inputs import device_of
from dapo.models.precision import GenerationWeights, autocast
from dapo.models.vision import text_config
from dapo.parallel.sharding import full_params, is_fsdp
from dapo.rollout import buffers
from dapo.rollout.attention import generation_attention
from dapo.rollout.base import Group, SamplingParams
from dapo.rollout.decode import Decoder, Workspaces
from dapo.rollout.sampling import process_logits, sample_next

__all__ = [
    "HFEngine",
    "graphs_fallback",
    "keeps_copies",
    "process_logits",
    "sample_next",
    "unsupported_reason",
]


def unsupported_reason(model: torch.nn.Module, length: int) -> str | None:
    """Why the engine's static cache cannot serve ``model`` for ``length`` tokens (prompt +
    response), or None: every layer must attend to the whole sequence (a sliding window
    shorter than ``length``, or a layer that is not attention, cannot be expressed by one
    mask over one cache)."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no transformers config"
    text = text_config(config)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    if kinds - {"full_attention", "sliding_attention"}:
        return f"its layers are {sorted(kinds)}, not only attention"
    if (
        window is not None
        and window < length
        and ("sliding_attention" in kinds or getattr(text, "layer_types", None) is None)
    ):
        return f"its sliding window ({window}) is shorter than prompt + response ({length})"
    return None


def graphs_fallback(model: torch.nn.Module, setting: str) -> str | None:
    """Why the decode step runs without CUDA graphs under ``rollout.cuda_graphs=setting``
    (None: with them). ``auto`` and ``on`` capture on CUDA; a sharded (FSDP) policy is
    gathered anew at every call, so its weights move and a captured graph would read stale
    memory."""
    if setting == "off":
        return "rollout.cuda_graphs=off"
    if device_of(model).type != "cuda":
        return None if setting == "auto" else f"the model is on {device_of(model).type}, not CUDA"
    if is_fsdp(model):
        return "the policy is FSDP-sharded (its gathered weights move at every call)"
    return None


def keeps_copies(device: torch.device, nbytes: int) -> bool:
    """Whether the bf16 weight copies of generation (``nbytes``) are kept for the next call:
    on CUDA only when small (:data:`~dapo.rollout.buffers.KEEP_BYTES`), since training needs
    the memory; on a CPU always (memory is ample there, and fresh pages for a new copy cost
    ~55 ms a call for SmolLM2's 310 MB, measured)."""
    return device.type != "cuda" or nbytes <= buffers.KEEP_BYTES


class HFEngine:
    """Sampling with a transformers causal LM in the training process.

    The engine holds the policy module itself, so after an optimizer step it already
    samples from the new weights; ``load_weights`` copies tensors only when given ones
    that are not its own (e.g. from another process). ``batch_size``: rows decoded together;
    ``cuda_graphs``: ``auto`` (on CUDA), ``on`` or ``off``; ``direct``: decode Llama-family
    models through :class:`~dapo.rollout.llama_step.LlamaStep` (False: the model's forward).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_id: int,
        pad_token_id: int,
        batch_size: int = 256,
        cuda_graphs: str = "auto",
        log: Any = print,
        direct: bool = True,
    ) -> None:
        if cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs={cuda_graphs!r}: choose one of {', '.join(CUDA_GRAPHS)}")
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        self.cuda_graphs = cuda_graphs
        self.direct = direct
        self.log = log
        self.weights = GenerationWeights()
        self.workspaces = Workspaces()
        self._told: set[str] = set()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights too
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"load_weights: the engine's model has no parameter {name!r}")
                if tensor is not params[name] and params[name].data_ptr() != tensor.data_ptr():
                    params[name].copy_(tensor)

    def _tell(self, line: str) -> None:
        if line not in self._told:
            self._told.add(line)
            self.log(line)

    def uses_graphs(self) -> bool:
        """Whether the decode step is replayed from CUDA graphs (says why not, once, on CUDA
        or where they were asked for with ``on``)."""
        reason = graphs_fallback(self.model, self.cuda_graphs)
        cuda = device_of(self.model).type == "cuda"
        if reason is None and cuda:
            return not self.workspaces.capture_failed
        if reason is not None and self.cuda_graphs != "off" and (cuda or self.cuda_graphs == "on"):
            self._tell(f"rollout.cuda_graphs: decoding without CUDA graphs: {reason}")
        return False

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        """Sample ``params.n`` responses per prompt.

        An FSDP-sharded model is gathered once for the whole call, as each rank runs its
        own number of decoding steps: every rank must call this, with any number of prompts.
        """
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if not prompts or params.n < 1 or params.max_tokens < 1:  # nothing to generate
            return [
                Group(
                    prompt_ids=copy_prompt(p),
                    response_ids=[[] for _ in range(max(params.n, 0))],
                    logprobs=[[] for _ in range(max(params.n, 0))],
                    truncated=[True] * max(params.n, 0),
                )
                for p in prompts
            ]
        length = max(map(len, prompts)) + params.max_tokens
        reason = unsupported_reason(self.model, length)
        if reason is not None:
            raise ValueError(
                f"rollout.engine=hf cannot generate with this model: {reason}. Use "
                "rollout.engine=vllm, or shorter prompts and rollout.max_completion_length."
            )
        device = device_of(self.model)
        gen = torch.Generator(device=device).manual_seed(params.seed)
        graphs = self.uses_graphs()
        was_training = self.model.training
        self.model.eval()
        try:
            with (
                full_params(self.model),
                autocast(self.model, cache=not graphs),
                self.weights.applied(self.model),
                generation_attention(self.model),
            ):
                decoder = Decoder(
                    self.model,
                    prompts,
                    params,
                    rows=self.batch_size,
                    eos_token_id=self.eos_token_id,
                    pad_token_id=self.pad_token_id,
                    gen=gen,
                    device=device,
                    workspaces=self.workspaces,
                    graphs=graphs,
                    direct=self.direct,
                    log=self._tell,
                )
                out = decoder.run()
        finally:
            self.model.train(was_training)
            if not keeps_copies(device, self.weights.nbytes()):
                # Graphs captured on the copies would read freed memory: they go too.
                self.weights.release()
                with self.workspaces.lock:
                    self.workspaces.drop_idle()
        tokens, logps, lengths, eos = (
            x.tolist() for x in (out.tokens, out.logps, out.lengths, out.eos)
        )
        groups = []
        for i, p in enumerate(prompts):
            g = Group(prompt_ids=copy_prompt(p))
            for row in range(i * params.n, (i + 1) * params.n):
                g.response_ids.append(tokens[row][: lengths[row]])
                g.logprobs.append(logps[row][: lengths[row]])
                g.truncated.append(not eos[row])
            groups.append(g)
        return groups
