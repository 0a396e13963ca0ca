"""The names of every enumerated option, one tuple each: the single source of truth.

Torch-free and import-free, so that :mod:`dapo.config` (which validates the names) and the
modules that act on them (:mod:`dapo.algorithms`, :mod:`dapo.rollout`, ...) can all import
it without a cycle and without loading torch for ``dapo presets`` or ``--help-config``.
Where a function's signature takes one of these, its ``Literal`` type is defined here too
and the tuple is read from it (``get_args``), so no name is written twice.
"""

from __future__ import annotations

from typing import Literal, get_args

AdvantageScale = Literal["group", "batch", "none"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3"]
RoundCap = Literal["train", "stop"]
PolicyLoss = Literal["ppo", "gspo", "cispo"]
ISLevel = Literal["token", "sequence"]
ISMode = Literal["truncate", "mask"]
EntropyControl = Literal["none", "clip_cov", "kl_cov"]

ADVANTAGE_SCALES: tuple[str, ...] = get_args(AdvantageScale)  # algorithm.advantage_scale
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)  # algorithm.loss_agg
KL_KINDS: tuple[str, ...] = get_args(KLKind)  # algorithm.kl_estimator
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)  # algorithm.policy_loss
IS_LEVELS: tuple[str, ...] = get_args(ISLevel)  # algorithm.is_level
IS_MODES: tuple[str, ...] = get_args(ISMode)  # algorithm.is_mode
ENTROPY_CONTROLS: tuple[str, ...] = get_args(EntropyControl)  # algorithm.entropy_control
ENGINES: tuple[str, ...] = ("hf", "vllm", "vllm-server")  # rollout.engine: dapo.rollout.make_engine
# train.precision: dapo.models.precision (auto resolves to one of the others at start-up)
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16-mixed", "bf16")
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")  # train.lr_schedule
DATA_PARALLEL_MODES: tuple[str, ...] = ("auto", "fsdp", "ddp")  # train.data_parallel
DYNAMIC_SAMPLING_METRICS: tuple[str, ...] = ("acc", "reward")  # algorithm.dynamic_sampling_metric
ROUND_CAP_ACTIONS: tuple[str, ...] = get_args(RoundCap)  # algorithm.round_cap
CURRICULA: tuple[str, ...] = ("none", "easy_first")  # data.curriculum: dapo.data.curriculum
