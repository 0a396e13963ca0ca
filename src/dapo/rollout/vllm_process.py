"""What running vLLM inside the trainer's process takes: telling whether this process is one
rank of a group, keeping that group alive through vLLM's shutdown, undoing what building an
engine does to torch process-wide, dropping vLLM's expected warnings, and refreshing a tied
output layer after a weight load (inside the engine's worker)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch


def in_process_group() -> bool:
    """Whether this process is one rank of several in an initialised process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def keep_default_group(distributed: bool) -> Iterator[None]:
    """Let vLLM's shutdown tear down its own groups but not the trainer's process group.

    Under ``torchrun`` vLLM joins the process group the trainer made, and its shutdown
    (``EngineCore.shutdown`` -> ``destroy_distributed_environment``) would destroy that
    default group too; here it destroys vLLM's world group only.
    """
    if not distributed:
        yield
        return
    from vllm.distributed import parallel_state

    original = parallel_state.destroy_distributed_environment

    def destroy_vllm_world() -> None:
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = destroy_vllm_world
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original


def refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Rebuild the prepared form of a tied ``lm_head`` from the (updated) embedding.

    ``reload_weights`` never loads a tied ``lm_head`` by name (the checkpoint has no such
    tensor), so backends that prepare the output projection after loading (the CPU backend
    prepacks it) would keep the old one. Runs inside the engine's worker.
    """
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and method is not None:
        method.process_weights_after_loading(head)


@contextlib.contextmanager
def preserve_torch_settings() -> Iterator[None]:
    """Undo what building a vLLM engine does to torch process-wide.

    vLLM's CPU worker replaces ``torch.set_num_threads`` with a function that refuses to
    change the thread count, vLLM sets one intra-op thread for serving, and its workers set
    the float32 matmul precision (``VLLM_FLOAT32_MATMUL_PRECISION``); the trainer shares
    this process and keeps its own settings.
    """
    set_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    default_dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    matmul_precision = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_default_dtype(default_dtype)
        torch.set_grad_enabled(grad)
        torch.set_float32_matmul_precision(matmul_precision)


class _DropMessages(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_log(logger_name: str, text: str) -> Iterator[None]:
    """Drop one expected, harmless vLLM message (e.g. no chat template without a tokenizer)."""
    log = logging.getLogger(logger_name)
    flt = _DropMessages(text)
    log.addFilter(flt)
    try:
        yield
    finally:
        log.removeFilter(flt)
