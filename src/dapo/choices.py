"""The names of every enumerated option, one ``Literal`` each: the single source of truth.

Torch-free and import-free, so that :mod:`dapo.config` (whose fields are typed with these
``Literal``s, which is how it checks the names) and the modules that act on them
(:mod:`dapo.algorithms`, :mod:`dapo.rollout`, ...) can all import it without a cycle and
without loading torch for ``dapo presets`` or ``--help-config``. The tuples are read from
the ``Literal``s (``get_args``), so no name is written twice.
"""

from __future__ import annotations

from typing import Literal, get_args

AdvantageScale = Literal["group", "batch", "none"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3"]
RoundCap = Literal["train", "stop"]
PolicyLoss = Literal["ppo", "gspo", "cispo"]
ISLevel = Literal["token", "sequence", "geometric"]
ISMode = Literal["truncate", "mask"]
# algorithm.proximal_logprobs: the decoupled objective's proximal log-probs
ProximalLogprobs = Literal["recompute", "loglinear"]
EntropyControl = Literal["none", "clip_cov", "kl_cov"]
Engine = Literal["hf", "vllm", "vllm-server"]
# auto resolves to one of the others at start-up (dapo.models.precision)
Precision = Literal["auto", "fp32", "bf16-mixed", "bf16"]
LRSchedule = Literal["constant", "cosine"]
DataParallelMode = Literal["auto", "fsdp", "ddp"]
DynamicSamplingMetric = Literal["auto", "acc", "reward"]
Curriculum = Literal["none", "easy_first"]
# rollout.vllm_quantization: vLLM quantizes the served weights (fp8: online, per tensor)
VLLMQuantization = Literal["none", "fp8"]
HealthKind = Literal[
    "all",
    "truncation",
    "constant_reward",
    "near_greedy",
    "uniform_groups",
    "entropy_collapse",
    "entropy_blowup",
    "length_to_limit",
    "zero_gradients",
    "engine_mismatch",
]
# train.packing: auto packs where it is exact (dapo.models.packing.unpackable)
Packing = Literal["auto", True, False]
CudaGraphs = Literal["auto", "on", "off"]  # rollout.cuda_graphs (the hf engine on CUDA)
# checkpoint.on_signal: stop at a safe point and save, or die at once as by default
OnSignal = Literal["save", "exit"]
# checkpoint.stop_signals: what schedulers send before a kill (SIGINT, Ctrl-C, always counts)
StopSignal = Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU"]

# reward.code.sandbox: how the code scorer isolates programs (dapo.rewards.sandbox)
CodeSandbox = Literal["bubblewrap", "none"]

ADVANTAGE_SCALES: tuple[str, ...] = get_args(AdvantageScale)  # algorithm.advantage_scale
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)  # algorithm.loss_agg
KL_KINDS: tuple[str, ...] = get_args(KLKind)  # algorithm.kl_estimator
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)  # algorithm.policy_loss
IS_LEVELS: tuple[str, ...] = get_args(ISLevel)  # algorithm.is_level
IS_MODES: tuple[str, ...] = get_args(ISMode)  # algorithm.is_mode
PROXIMAL_LOGPROBS: tuple[str, ...] = get_args(ProximalLogprobs)  # algorithm.proximal_logprobs
ENTROPY_CONTROLS: tuple[str, ...] = get_args(EntropyControl)  # algorithm.entropy_control
ENGINES: tuple[str, ...] = get_args(Engine)  # rollout.engine: dapo.rollout.make_engine
PRECISIONS: tuple[str, ...] = get_args(Precision)  # train.precision: dapo.models.precision
LR_SCHEDULES: tuple[str, ...] = get_args(LRSchedule)  # train.lr_schedule
DATA_PARALLEL_MODES: tuple[str, ...] = get_args(DataParallelMode)  # train.data_parallel
# algorithm.dynamic_sampling_metric
DYNAMIC_SAMPLING_METRICS: tuple[str, ...] = get_args(DynamicSamplingMetric)
ROUND_CAP_ACTIONS: tuple[str, ...] = get_args(RoundCap)  # algorithm.round_cap
CURRICULA: tuple[str, ...] = get_args(Curriculum)  # data.curriculum: dapo.data.curriculum
VLLM_QUANTIZATIONS: tuple[str, ...] = get_args(VLLMQuantization)  # rollout.vllm_quantization
PACKING: tuple[str | bool, ...] = get_args(Packing)  # train.packing: dapo.models.packing
CUDA_GRAPHS: tuple[str, ...] = get_args(CudaGraphs)  # rollout.cuda_graphs: dapo.rollout.hf_engine
ON_SIGNAL: tuple[str, ...] = get_args(OnSignal)  # checkpoint.on_signal
STOP_SIGNALS: tuple[str, ...] = get_args(StopSignal)  # checkpoint.stop_signals
CODE_SANDBOXES: tuple[str, ...] = get_args(CodeSandbox)  # reward.code.sandbox
