"""Driving the learner's optimizer step in tests: the gradient of one step, left in place."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dapo.algorithms import LossSettings
from dapo.config import TrainConfig
from dapo.models import packing
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions
from dapo.training.learner import Learner, StepResult


class KeepGradients:
    """Stands in for the optimizer: ``optimizer_step`` leaves the gradient in ``.grad`` (and a
    second call adds to it)."""

    param_groups: list = []

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def learner(
    model: torch.nn.Module,
    settings: LossSettings,
    *,
    token_budget: int,
    pad_id: int = 0,
    shared_prompt: bool = True,
    optimizer: object = None,
    max_grad_norm: float = 0.0,
    ddp: torch.nn.Module | None = None,
    packed: bool = False,
) -> Learner:
    """A learner of ``model`` with ``settings`` (no gradient clipping unless asked);
    ``packed``: its forwards packed (the model prepared for it)."""
    if packed:
        packing.install(model)
    forward = ForwardOptions(
        pad_id, settings.temperature, token_budget, shared_prompt=shared_prompt, packed=packed
    )
    return Learner(
        model,
        optimizer or KeepGradients(),
        settings,
        forward,
        ddp=ddp,
        train=TrainConfig(max_grad_norm=max_grad_norm),
    )


def backward(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    settings: LossSettings,
    *,
    token_budget: int,
    pad_id: int = 0,
    shared_prompt: bool = True,
    seed: int = 0,
    packed: bool = False,
) -> StepResult:
    """One optimizer step's gradient on ``samples`` (one mini-batch), left in the parameters'
    ``.grad`` unclipped; its statistics."""
    return learner(
        model,
        settings,
        token_budget=token_budget,
        pad_id=pad_id,
        shared_prompt=shared_prompt,
        packed=packed,
    ).optimizer_step(samples, seed=seed)
