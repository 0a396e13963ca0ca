"""A model given as an object (``dapo.train(model=...)``), and the callbacks
:meth:`Trainer.run <dapo.training.trainer.Trainer.run>` calls.

A callback is either a plain function ``fn(step, metrics)``, called after every rollout step,
or an object with any of the hooks below (others are not needed):

- ``on_step(step, metrics)``: after every rollout step (after its logging and checkpoint);
  ``metrics`` is the step's dict (``val/acc`` in it on evaluation steps). Returning ``True``
  stops the run cleanly: the final evaluation, checkpoint and summary are written.
- ``on_evaluate(step, metrics)``: after each held-out evaluation (before training at step 0,
  every ``logging.eval_every`` steps, at the end), with ``val/acc`` and ``val/n`` (samples).
- ``on_save(step, path)``: after each checkpoint is written (``path``: its directory).

``step`` counts the rollout steps done. Return values other than ``on_step``'s are ignored.
A callback that raises stops the run as ``True`` would, then :class:`TrainingError` names it
(the exception chained). Under ``torchrun`` every rank calls its callbacks; a stop on any rank
stops all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dapo.errors import ConfigError, TrainingError
from dapo.models.activation_checkpointing import checkpoint_layers
from dapo.models.vision import freeze_vision_tower
from dapo.parallel import distributed as D

HOOKS = ("on_step", "on_evaluate", "on_save")


def prepare_given_model(
    model: torch.nn.Module,
    dtype: str,
    gradient_checkpointing: bool,
    log: Callable[[str], None],
    train_vision: bool = False,
) -> torch.nn.Module:
    """A model given as an object made what :func:`dapo.models.load_policy` makes of a path,
    in place: weights in ``dtype`` (``load_dtype`` of train.precision: float32, bfloat16 for
    bf16), the decoder layers checkpointed for model.gradient_checkpointing, the cache on, a
    vision-language model's vision encoder frozen unless ``train_vision``."""
    want = getattr(torch, dtype)
    have = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if have - {want}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in have))
        log(f"the given model's {names} weights are cast to {dtype} (train.precision)")
        model.to(want)
    if gradient_checkpointing and not checkpoint_layers(model):
        model.gradient_checkpointing_enable()  # no decoder layers found: transformers' own
    if getattr(model, "config", None) is not None:
        model.config.use_cache = True
    freeze_vision_tower(model, train_vision)
    return model


def check_callbacks(callbacks: Sequence[Any]) -> None:
    """Refuse what is neither a function nor an object with a hook, before anything runs."""
    for i, cb in enumerate(callbacks):
        if not callable(cb) and not any(callable(getattr(cb, h, None)) for h in HOOKS):
            raise ConfigError(
                f"callbacks[{i}] = {cb!r} is neither a function fn(step, metrics) nor an object "
                f"with any of {', '.join(HOOKS)}; pass one of those"
            )


def _name(cb: Any) -> str:
    return getattr(cb, "__qualname__", None) or type(cb).__qualname__


class Callbacks:
    """Calls a run's callbacks; collects their requests to stop and their first error."""

    def __init__(self, callbacks: Sequence[Any]) -> None:
        check_callbacks(callbacks)
        self.callbacks = list(callbacks)
        self.error: BaseException | None = None  # the first exception a callback raised here
        self.error_text = ""  # what the first failing callback raised, on any rank
        self.requested = ""  # why the run stops early ("" while it does not)

    def _hook(self, cb: Any, hook: str) -> Callable[..., Any] | None:
        """``cb``'s ``hook``: its method, or ``cb`` itself for a plain function's on_step."""
        if any(callable(getattr(cb, h, None)) for h in HOOKS):
            return getattr(cb, hook, None)
        return cb if hook == "on_step" else None

    def _call(self, hook: str, step: int, arg: Any) -> bool:
        stop = False
        for cb in self.callbacks:
            fn = self._hook(cb, hook)
            if fn is None:
                continue
            try:  # a copy: a callback that changes its dict changes nothing else
                stop |= bool(fn(step, dict(arg) if isinstance(arg, dict) else arg))
            except Exception as exc:
                if self.error is None:
                    self.error = exc
                    self.error_text = (
                        f"callback {_name(cb)!r} raised {type(exc).__name__}: {exc} "
                        f"in {hook} at rollout step {step}"
                    )
                stop = True
        return stop

    def on_step(self, step: int, metrics: dict[str, float]) -> bool:
        """Every callback's ``on_step``; whether every rank stops now (a collective)."""
        stop = self._call("on_step", step, metrics) or self.error is not None
        votes = D.all_gather_objects((stop, self.error_text))
        if not any(v for v, _ in votes):
            return False
        self.error_text = self.error_text or next((t for _, t in votes if t), "")
        self.requested = self.error_text or f"a callback asked to stop after rollout step {step}"
        return True

    def on_evaluate(self, step: int, evaluation: dict[str, Any]) -> None:
        self._call("on_evaluate", step, {f"val/{k}": v for k, v in evaluation.items()})

    def on_save(self, step: int, path: Path) -> None:
        self._call("on_save", step, path)

    def raise_error(self) -> None:
        """After a clean stop, on every rank (a collective): the error a callback raised on
        any rank, if one did."""
        self.error_text = next((t for t in D.all_gather_objects(self.error_text) if t), "")
        if self.error_text:
            raise TrainingError(
                f"{self.error_text}; the run stopped there, with its final checkpoint and "
                "summary written (continue it with resume=true). Fix the callback."
            ) from self.error
