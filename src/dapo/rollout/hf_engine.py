"""The transformers engine: sampling with the policy module itself, in the training process.

:class:`HFEngine` runs its own sampling loop, so that it can return log-probs cheaply, share
one prompt prefill across the group, and drop finished sequences from the batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dapo.models.inputs import device_of, left_pad
from dapo.models.precision import autocast
from dapo.parallel.sharding import full_params
from dapo.rollout.base import Group, SamplingParams


def process_logits(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering; removed entries are -inf."""
    if temperature > 0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class HFEngine:
    """Sampling with a transformers causal LM in the training process.

    The engine holds the policy module itself, so after an optimizer step it already
    samples from the new weights; ``load_weights`` copies tensors only when given ones
    that are not its own (e.g. from another process).
    """

    def __init__(
        self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int, batch_size: int = 256
    ) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights too
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"load_weights: the engine's model has no parameter {name!r}")
                if tensor is not params[name] and params[name].data_ptr() != tensor.data_ptr():
                    params[name].copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        """Sample ``params.n`` responses per prompt.

        An FSDP-sharded model is gathered once for the whole call, as each rank runs its
        own number of decoding steps: every rank must call this, with any number of prompts.
        """
        gen = torch.Generator(device=device_of(self.model)).manual_seed(params.seed)
        per_call = max(1, self.batch_size // max(1, params.n))
        groups: list[Group] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with full_params(self.model), autocast(self.model):  # the trainer's precision
                for start in range(0, len(prompts), per_call):
                    groups.extend(self._generate(prompts[start : start + per_call], params, gen))
        finally:
            self.model.train(was_training)
        return groups

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, gen: torch.Generator
    ) -> list[Group]:
        from transformers import DynamicCache

        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        n = params.n
        ids, attn = left_pad(prompts, self.pad_token_id)
        device = device_of(self.model)
        ids, attn = ids.to(device), attn.to(device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True
        )
        # One prefill per prompt, shared by its n responses.
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)
        attn = attn.repeat_interleave(n, dim=0)
        next_pos = pos[:, -1].repeat_interleave(n, dim=0) + 1

        total = len(prompts) * n
        tokens: list[list[int]] = [[] for _ in range(total)]
        logps: list[list[float]] = [[] for _ in range(total)]
        finished = [False] * total
        active = torch.arange(total, device=device)  # rows of the full batch still generating
        for step in range(params.max_tokens):
            if params.temperature == 0:
                tok = logits.argmax(-1)
                logp = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
            else:
                proc = process_logits(logits, params.temperature, params.top_p, params.top_k)
                logp_all = torch.log_softmax(proc, -1)
                tok = torch.multinomial(logp_all.exp(), 1, generator=gen).squeeze(-1)
                logp = logp_all.gather(-1, tok[:, None]).squeeze(-1)
            done_now = tok == self.eos_token_id
            for row, t, lp, d in zip(active.tolist(), tok.tolist(), logp.tolist(), done_now.tolist(), strict=True):
                tokens[row].append(t)
                logps[row].append(lp)
                finished[row] = d
            if step == params.max_tokens - 1:
                break
            keep = (~done_now).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            if keep.numel() < active.numel():  # finished rows stop costing compute
                cache.batch_select_indices(keep)
                active, tok, attn, next_pos = active[keep], tok[keep], attn[keep], next_pos[keep]
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=-1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1].float()
            next_pos = next_pos + 1

        groups = []
        for i, p in enumerate(prompts):
            g = Group(prompt_ids=list(p))
            for row in range(i * n, (i + 1) * n):
                g.response_ids.append(tokens[row])
                g.logprobs.append(logps[row])
                g.truncated.append(not finished[row])
            groups.append(g)
        return groups
