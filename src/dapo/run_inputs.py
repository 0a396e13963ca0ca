"""What a run can be given as Python objects instead of config strings (``dapo.train``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RunInputs:
    """Python objects that stand in for (or add to) config strings; all optional."""

    model: torch.nn.Module | None = None  # a loaded transformers model (else model.name_or_path)
    tokenizer: Any = None  # its tokenizer (else model.tokenizer / model.name_or_path's)
    processor: Any = None  # a vision-language model's processor (else the model directory's)
    train_dataset: Any = None  # a datasets.Dataset, a list of row dicts, ... (else data.train)
    eval_dataset: Any = None  # (else data.eval)
    reward_funcs: list[Any] = field(default_factory=list)  # callables, or (callable, weight)
    environment: Any = None  # an environment class or factory (else rollout.environment)
    tools: list[Any] = field(default_factory=list)  # tool functions, added to rollout.tools
    agent: Any = None  # an agent function (client, record) -> reward | None (else rollout.agent)
    # Functions fn(step, metrics) or objects with on_step / on_evaluate / on_save (above).
    callbacks: list[Any] = field(default_factory=list)
