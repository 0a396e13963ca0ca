"""The learner: the policy, its optimizer and the update (verl's actor, torchtune's recipe).

:class:`Learner` owns the policy module and its data-parallel wrapping (DDP or FSDP2), LoRA
adapters, the reference model (``beta > 0``), the optimizer and learning-rate schedule, the
loss settings and the forward options. :meth:`Learner.update` reads top to bottom: plan
the mini-batches, this rank's share of each, old and reference log-probs, importance
weights, then epochs x mini-batches of :meth:`Learner.optimizer_step`, each a loop over
micro-batches normalised by the mini-batch's global denominator (exact under any split).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dapo import algorithms as alg
from dapo.algorithms import LossSettings
from dapo.config import Config, TrainConfig
from dapo.errors import TrainingError
from dapo.models import context_length, hidden_size, load_policy, lora, packing
from dapo.models.data_parallel import wrap_data_parallel
from dapo.models.inputs import device_of
from dapo.models.precision import (
    bf16_cpu_slowdown,
    bf16_rounding_warning,
    cpu_bf16_warning,
    cpu_has_native_bf16,
    load_dtype,
    precision_origin,
    reference_copy,
    resolve_precision,
    set_precision,
)
from dapo.parallel import distributed as D
from dapo.parallel import sharding
from dapo.seeding import Stream, stream_seed
from dapo.training.batch import Sample
from dapo.training.forward import (
    ForwardOptions,
    compute_logprobs,
    prompt_cache,
    response_states,
    token_logprobs,
    zero_backward,
)
from dapo.training.inputs import prepare_given_model
from dapo.training.microbatch import (
    collate,
    loss_denominator,
    micro_batches,
    n_updates,
    plan_updates,
)
from dapo.training.optim import lr_at, make_optimizer
from dapo.training.token_weights import attach_is_weights, cov_selection, logprob_mismatch

if TYPE_CHECKING:
    from dapo.training.teacher import Teacher


def loss_settings(cfg: Config) -> LossSettings:
    """The loss knobs of a run: the ``algorithm`` fields of the same names, the sampling
    temperature and L_max (``rollout.max_completion_length``)."""
    shared = {
        f.name: getattr(cfg.algorithm, f.name)
        for f in dataclasses.fields(LossSettings)
        if hasattr(cfg.algorithm, f.name)
    }
    return LossSettings(
        **shared, temperature=cfg.rollout.temperature, max_len=cfg.rollout.max_completion_length
    )


class UpdateStats:
    """What :func:`dapo.algorithms.compute_loss` returns, accumulated over the micro-batches of
    one optimizer step: its loss parts (``LOSS_PARTS``, already normalised by the mini-batch's
    global denominator) summed, every other statistic weighted by the micro-batch's loss
    tokens. No name is listed here: whatever the loss reports is logged."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}  # token-weighted sums
        self.weights: dict[str, float] = {}  # their token counts
        self.parts: dict[str, float] = {"loss": 0.0}  # the loss and its parts, summed

    def add(self, terms: dict[str, torch.Tensor], loss: float, tokens: float) -> None:
        self.parts["loss"] += loss
        for key, value in terms.items():
            if key in alg.LOSS_PARTS:
                self.parts[key] = self.parts.get(key, 0.0) + float(value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * tokens
                self.weights[key] = self.weights.get(key, 0.0) + tokens

    def means(self) -> dict[str, float]:
        """The token-weighted means, as ``actor/<name>`` metrics."""
        return {f"actor/{k}": v / max(self.weights[k], 1.0) for k, v in self.sums.items()}

    def all_reduce(self) -> None:
        """Sum over data-parallel ranks; a rank that trained nothing lacks keys."""
        names = sorted({k for keys in D.all_gather_objects(sorted(self.sums)) for k in keys})
        parts = sorted({k for keys in D.all_gather_objects(sorted(self.parts)) for k in keys})
        values = [self.sums.get(k, 0.0) for k in names] + [self.weights.get(k, 0.0) for k in names]
        totals = D.all_reduce_sum(values + [self.parts.get(k, 0.0) for k in parts])
        n = len(names)
        self.sums = dict(zip(names, totals[:n], strict=True))
        self.weights = dict(zip(names, totals[n : 2 * n], strict=True))
        self.parts = dict(zip(parts, totals[2 * n :], strict=True))


@dataclass
class StepResult:
    """One optimizer step: its statistics (summed over ranks) and whether it was applied."""

    stats: UpdateStats
    grad_norm: float
    applied: bool
    selection: dict[str, float] = field(default_factory=dict)  # actor/cov_selected_frac
    # This forward's log-probs of the samples that came without old ones (the ratio is 1
    # for them), by their index in the mini-batch: the trainer compares them with the engine's.
    fresh: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class PreparedBatch:
    """A rollout step's samples ready for the update loop (:meth:`Learner.prepare`)."""

    samples: list[Sample]
    plan: list[tuple[int, list[int]]]  # (epoch, sample indices) of every optimizer update
    shares: list[list[int]]  # this rank's positions in each update's mini-batch
    metrics: dict[str, float]  # what preparing measured (IS weights, ...)
    # The old log-probs computed before the update, for the engine comparison.
    recomputed: list[tuple[Sample, torch.Tensor]] = field(default_factory=list)


class NonFiniteUpdates(TrainingError):
    """``train.max_nonfinite_updates`` updates in a row had a non-finite loss or gradient."""

    def __init__(self, count: int, result: StepResult, applied_any: bool) -> None:
        super().__init__(
            f"{count} updates in a row had a non-finite loss or gradient (loss "
            f"{result.stats.parts['loss']}, gradient norm {result.grad_norm})"
        )
        self.applied_any = applied_any  # whether an update of this rollout step was applied


class Learner:
    """The policy being trained, its optimizer and the update.

    Built from parts (tests, benchmarks) or from a run's config (:meth:`from_config`).
    ``train`` (the ``train`` config section) is needed by :meth:`update` only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        settings: LossSettings,
        forward: ForwardOptions,
        *,
        train: TrainConfig | None = None,
        ddp: torch.nn.Module | None = None,
        ref_model: torch.nn.Module | None = None,
        peft: Any = None,
        seed: int = 0,
    ) -> None:
        self.model, self.optimizer, self.settings, self.forward = (
            model,
            optimizer,
            settings,
            forward,
        )
        self.train = train or TrainConfig()
        self.ddp, self.ref_model, self.peft, self.seed = ddp, ref_model, peft, seed
        self.dist = D.current()
        self.nonfinite_in_a_row = 0
        self.parameter_counts = lora.parameter_counts(model)  # (trainable, total)
        # Compare this forward's log-probs with the engine's (rollout/logprob_mismatch): set
        # by the trainer when the engine is separate or computes in another precision.
        self.compare_engine = False
        # The ratio's old log-probs are computed before the update even with one update per
        # step (the importance correction and Clip-Cov / KL-Cov need them first).
        self.needs_old_logprobs = settings.is_cap is not None or settings.entropy_control != "none"
        self.teacher: Teacher | None = None  # on-policy distillation; see use_teacher

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        model_path: str,
        pad_id: int,
        log: Callable[[str], None],
        model: torch.nn.Module | None = None,
    ) -> Learner:
        """The policy of ``cfg`` (loaded from ``model_path``, unless ``model`` is given) with
        its precision, LoRA adapters, reference copy, data-parallel wrapping and optimizer."""
        t = cfg.train
        cuda = torch.cuda.is_available()
        native_bf16 = cpu_has_native_bf16()  # read once: the choice, the line, the warning
        source = model if model is not None else model_path
        size = hidden_size(source, trust_remote_code=cfg.model.trust_remote_code)
        precision = resolve_precision(t.precision, cuda, native_bf16, size)
        log(f"precision: {precision}{precision_origin(t.precision, cuda, native_bf16, size)}")
        if precision == "bf16":
            log(bf16_rounding_warning(t.lr))
        if not cuda and precision != "fp32" and not native_bf16:
            slowdown = bf16_cpu_slowdown()
            if slowdown >= 2:  # measured: the flags may miss a CPU that does it well
                log(cpu_bf16_warning(precision, slowdown))
        if model is None:
            model = load_policy(
                model_path,
                dtype=load_dtype(precision),
                trust_remote_code=cfg.model.trust_remote_code,
                gradient_checkpointing=cfg.model.gradient_checkpointing,
                train_vision=cfg.model.train_vision,
            )
        else:  # given as an object (dapo.train(model=...)): made what load_policy makes
            model = prepare_given_model(
                model,
                load_dtype(precision),
                cfg.model.gradient_checkpointing,
                log,
                cfg.model.train_vision,
            )
        set_precision(model, precision)
        peft = lora.apply_lora(model, cfg.model.lora) if cfg.model.lora.rank > 0 else None
        counts = lora.parameter_counts(model)  # before sharding
        if peft is not None:
            trainable, total = counts
            log(
                f"LoRA: rank {cfg.model.lora.rank}, alpha {cfg.model.lora.alpha:g}, layers "
                f"{', '.join(cfg.model.lora.target_modules)}: {trainable:,} of {total:,} "
                f"parameters trained ({trainable / total:.2%})"
            )
        model.train()
        dist = D.current()
        if torch.cuda.is_available():  # one GPU per rank; the CPU path is the tested one
            model.to(f"cuda:{dist.local_rank}")
        # beta = 0 (DAPO): no reference. A plain copy on every rank, taken before the policy is
        # sharded; with LoRA the reference is the base model (the adapters disabled).
        ref_model = reference_copy(model) if cfg.algorithm.beta > 0 and peft is None else None
        ddp = wrap_data_parallel(model, dist, t.data_parallel, log)[1] if dist.enabled else None
        if not dist.enabled and t.data_parallel == "fsdp":
            log(
                "train.data_parallel=fsdp: one process, nothing to shard; the model trains whole "
                "(launch with torchrun --nproc_per_node N to shard it over N ranks)"
            )
        whole_rows = sharding.is_fsdp(model) or prompt_cache(model) is None
        packed, line = packing.choose(
            t.packing, model, whole_rows=whole_rows or not t.shared_prompt_forward
        )
        log(line)
        if packed and ref_model is not None:
            packing.install(ref_model)
        ctx = context_length(model)
        need = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
        if ctx is not None and need > ctx:
            raise TrainingError(
                f"data.max_prompt_length ({cfg.data.max_prompt_length}) + "
                f"rollout.max_completion_length ({cfg.rollout.max_completion_length}) = {need} "
                f"exceeds the model's context of {ctx} positions; lower one of them"
            )
        forward = ForwardOptions(
            pad_id,
            cfg.rollout.temperature,
            t.micro_batch_tokens,
            t.logits_chunk_size,
            t.shared_prompt_forward,
            packed,
        )
        learner = cls(
            model,
            make_optimizer(model, t),
            loss_settings(cfg),
            forward,
            train=t,
            ddp=ddp,
            ref_model=ref_model,
            peft=peft,
            seed=cfg.seed,
        )
        learner.parameter_counts = counts
        return learner

    # --- the update ----------------------------------------------------------------------

    def count_updates(self, n_samples: int, group_size: int | list[int]) -> int:
        """Optimizer updates :meth:`update` makes on ``n_samples`` responses."""
        t = self.train
        n_groups = n_samples // group_size if isinstance(group_size, int) else len(group_size)
        return n_updates(n_groups, t.mini_batch_size) * t.epochs

    def prepare(
        self, samples: list[Sample], step: int, group_size: int | list[int]
    ) -> PreparedBatch:
        """Everything the update loop needs, attached once before it: the plan of
        mini-batches, this rank's share of each, and on this rank's samples the ratio's old
        (proximal) log-probs, the reference's (``beta > 0``), the teacher's per-token
        advantages and the importance weights against the behaviour policy."""
        t = self.train
        plan = plan_updates(
            len(samples),
            group_size,
            t.prompts_per_step,
            t.mini_batch_size,
            t.epochs,
            seed=stream_seed(self.seed, Stream.UPDATE_PLAN, step),
        )
        # This rank's share of each mini-batch (positions in it): token-balanced over ranks.
        shares = [D.token_share([samples[i].length for i in idx], self.dist) for _, idx in plan]
        mine = [
            samples[i]
            for i in sorted({idx[j] for (_, idx), sh in zip(plan, shares, strict=True) for j in sh})
        ]
        metrics: dict[str, float] = {}
        loglinear = self.settings.proximal_logprobs == "loglinear"
        recomputed: list[tuple[Sample, torch.Tensor]] = []
        if (len(plan) > 1 or self.needs_old_logprobs) and not loglinear:
            # The ratio is taken against the policy at the start of the update (the proximal
            # policy): this one, now, unless a sample brings the behaviour policy's as its own.
            # (loglinear: approximated inside the loop, optimizer_step.) The first update's
            # own forward runs at these weights, so its samples get theirs there (a quarter
            # of this pass with four updates per step) unless they are needed before it.
            first: set[int] = set()  # all needed before the update (IS weights, selection)
            if not self.needs_old_logprobs:
                first = {id(samples[plan[0][1][j]]) for j in shares[0]}
            todo = [s for s in mine if s.old_logprobs is None and id(s) not in first]
            old = compute_logprobs(self.model, todo, self.forward)
            for s, lp in zip(todo, old, strict=True):
                s.old_logprobs = lp
            recomputed = list(zip(todo, old, strict=True))
        if self.settings.beta > 0:
            with self.reference() as reference:
                ref = compute_logprobs(reference, mine, self.forward)
            for s, lp in zip(mine, ref, strict=True):
                s.ref_logprobs = lp
        if self.teacher is not None:  # per-token advantages from the teacher's log-probs
            metrics.update(self.teacher.attach(mine))
        if not loglinear:
            metrics.update(attach_is_weights(mine, self.settings))
        return PreparedBatch(samples, plan, shares, metrics, recomputed)

    def update(
        self, samples: list[Sample], step: int, group_size: int | list[int]
    ) -> dict[str, float]:
        """:meth:`prepare`, then :meth:`optimize`: a rollout step's samples (groups of
        ``group_size`` consecutive responses, or of each listed size) trained on; the
        step's metrics."""
        return self.optimize(self.prepare(samples, step, group_size), step)

    def optimize(self, batch: PreparedBatch, step: int) -> dict[str, float]:
        """Mini-batches x epochs of exact-normalised optimizer updates on a prepared batch;
        the step's metrics."""
        t = self.train
        lr = lr_at(step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        samples, plan, shares = batch.samples, batch.plan, batch.shares
        metrics = dict(batch.metrics)
        per_update: dict[str, list[float]] = {"pg_loss": [], "loss": [], "grad_norm": []}
        totals = UpdateStats()
        fresh: list[tuple[Sample, torch.Tensor]] = []
        skipped = 0
        for n, ((epoch, idx), share) in enumerate(zip(plan, shares, strict=True)):
            result = self.optimizer_step(
                [samples[i] for i in idx],
                share=share,
                with_entropy=epoch == 0,
                seed=stream_seed(self.seed, Stream.COV_DRAW, step, n),
                version=step,
                progress=n / len(plan),
            )
            if n == 0 and len(plan) > 1:  # its forward ran at the start weights: the old
                for j, lp in result.fresh.items():  # log-probs of later epochs' updates
                    samples[idx[j]].old_logprobs = lp
            fresh.extend((samples[idx[j]], lp) for j, lp in result.fresh.items())
            if not result.applied:  # skipped: the weights stay at the last good state
                skipped += 1
                self.nonfinite_in_a_row += 1
                if self.nonfinite_in_a_row >= t.max_nonfinite_updates:
                    raise NonFiniteUpdates(
                        self.nonfinite_in_a_row, result, bool(per_update["loss"])
                    )
                continue
            self.nonfinite_in_a_row = 0
            for key, value in {
                **result.stats.parts,
                **result.selection,
                "grad_norm": result.grad_norm,
            }.items():
                per_update.setdefault(key.removeprefix("actor/"), []).append(value)
            for key, value in result.stats.sums.items():
                totals.sums[key] = totals.sums.get(key, 0.0) + value
                totals.weights[key] = totals.weights.get(key, 0.0) + result.stats.weights[key]
        if self.compare_engine:  # the trainer's log-probs at the sampling weights
            pairs = batch.recomputed + fresh
            metrics.update(logprob_mismatch([s for s, _ in pairs], [lp for _, lp in pairs]))
        metrics.update(totals.means())
        metrics.update({f"actor/{k}": sum(v) / len(v) if v else 0.0 for k, v in per_update.items()})
        metrics["actor/updates"] = float(len(per_update["loss"]))
        metrics["actor/skipped_updates"] = float(skipped)
        metrics["actor/lr"] = lr
        metrics["train/loss_tokens"] = float(sum(sum(s.loss_mask) for s in samples))
        return metrics

    def optimizer_step(
        self,
        batch: Sequence[Sample],
        *,
        share: list[int] | None = None,
        with_entropy: bool = True,
        seed: int = 0,
        version: int = 0,
        progress: float = 0.0,
    ) -> StepResult:
        """One exact optimizer step on a mini-batch, on one process or across data-parallel ranks.

        Every rank passes the whole mini-batch and trains ``share`` of it (positions; default:
        the token-balanced share). The loss denominator is the all-reduced global count, and
        the loss is scaled by the world size because DDP and FSDP average gradients over
        ranks: the summed gradient is the one a single process computes on the whole
        mini-batch. Non-finite gradients are not applied (``applied=False``). ``seed`` draws
        Clip-Cov's random token choice (:func:`~dapo.training.token_weights.cov_selection`).
        ``version`` and ``progress`` (this update's place among the step's, in [0, 1)) place
        the weights for the log-linear proximal policy (``algorithm.proximal_logprobs``).

        With DDP only the last micro-batch's backward synchronises gradients, so each rank
        all-reduces exactly once whatever its number of micro-batches; a rank with no samples
        contributes a zero gradient. An FSDP-sharded model gathers parameters in every forward
        and backward, so every rank runs as many passes as the rank with the most
        micro-batches (the missing ones are zero-loss passes), each a whole-sequence forward
        (a shared prompt would add a forward on some ranks only).
        """
        info, s, opts = self.dist, self.settings, self.forward
        share = D.token_share([x.length for x in batch], info) if share is None else share
        mine = [batch[j] for j in share]
        selected, selection = cov_selection(mine, share, s, seed=seed)
        (denominator,) = D.all_reduce_sum([loss_denominator(mine, s)])
        chunks = micro_batches(mine, opts.token_budget, packed=opts.packed)
        ddp = self.ddp if info.enabled else None
        fsdp = sharding.is_fsdp(self.model) and info.enabled
        passes = D.all_reduce_max(len(chunks)) if fsdp else len(chunks)
        stats, fresh = UpdateStats(), {}
        if ddp is not None and not chunks:
            zero_backward(ddp, opts.pad_id)
        for n in range(passes):
            if n >= len(chunks):
                zero_backward(self.model, opts.pad_id)
                continue
            loglinear = s.proximal_logprobs == "loglinear"
            mb = collate(
                [mine[i] for i in chunks[n]],
                opts.pad_id,
                [selected[i] for i in chunks[n]],
                behaviour=loglinear,
            )
            mb = mb.to(device_of(self.model))
            sync = ddp is None or n == len(chunks) - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                states = response_states(
                    self.model,
                    mb,
                    shared_prompt=opts.shared_prompt and (opts.packed or not fsdp),
                    ddp=ddp,
                    packed=opts.packed,
                )
                logp, entropy = token_logprobs(
                    self.model,
                    states,
                    mb,
                    temperature=opts.temperature,
                    chunk_size=opts.logits_chunk_size,
                )
                old = logp.detach()  # ratio 1 for rows without old log-probs: this forward's
                is_w = mb.is_weights
                if loglinear and mb.behaviour_logprobs is not None and mb.versions is not None:
                    old = alg.loglinear_proximal(
                        mb.behaviour_logprobs, old, mb.versions, version, progress
                    )
                    assert s.is_cap is not None  # the config requires it with loglinear
                    is_w = torch.exp((old - mb.behaviour_logprobs).clamp(max=20.0)).clamp(
                        max=s.is_cap
                    )
                elif mb.old_logprobs is not None:
                    old = torch.where(mb.has_old[:, None], mb.old_logprobs, old)
                loss, terms = alg.compute_loss(
                    logp,
                    old,
                    mb.advantages,
                    mb.loss_mask,
                    s,
                    denominator=denominator,
                    is_weights=is_w,
                    selected=mb.selected,
                    ref_logprobs=mb.ref_logprobs,
                    entropy=entropy if s.entropy_coef > 0 else None,
                )
                (loss * float(info.world_size)).backward()
            terms["gen_prob"] = alg.gen_prob(logp.detach(), mb.loss_mask)
            if with_entropy:
                terms["entropy"] = alg.masked_mean(entropy.detach(), mb.loss_mask)
            stats.add(terms, loss.item(), mb.loss_mask.sum().item())
            for j, i in enumerate(chunks[n]):
                if not mb.has_old[j]:
                    fresh[share[i]] = logp[j, : len(mine[i].response_ids)].detach().clone()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = sharding.grad_norm(params, self.train.max_grad_norm)
        if info.enabled:
            stats.all_reduce()
        applied = bool(torch.isfinite(norm)) and math.isfinite(stats.parts["loss"])
        if applied:
            sharding.reshard(self.model)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(stats, float(norm), applied, selection, fresh)

    def use_teacher(self, teacher: Teacher | None) -> None:
        """Distil from ``teacher`` (None: no teacher): its signal is measured against the
        log-probs of the policy that sampled the batch, so those are computed first."""
        self.teacher = teacher
        self.needs_old_logprobs |= teacher is not None

    # --- what the rest of the run needs from the policy -----------------------------------

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy: the initial model, or LoRA's base (adapters disabled)."""
        if self.peft is not None:
            with self.peft.disable_adapter():
                yield self.model
        else:
            assert self.ref_model is not None
            yield self.ref_model

    def engine_weights(self, separate: bool) -> Any:
        """``(name, tensor)`` of the whole policy for a separate rollout engine (every rank
        iterates them: with FSDP they are gathered; see ``full_named_parameters``), or for a
        LoRA policy the merged ``W + (alpha/r) B A`` under the base names (an engine loads
        base-model checkpoints; the policy is not changed)."""
        if self.peft is not None and separate:
            return lora.merged_parameters(self.model, sharding.full_named_parameters(self.model))
        return sharding.full_named_parameters(self.model)

    def pretrained_weights(self) -> dict[str, torch.Tensor] | None:
        """The final model's weights in transformers' format (LoRA merged); every rank must
        call this (FSDP gathers), rank 0 gets them (None: the module's own state dict)."""
        weights = sharding.pretrained_state(self.model)
        if self.peft is not None:  # a plain transformers model: the merged weights
            state = self.model.state_dict() if weights is None else weights
            weights = lora.merge_state(state, lora.scalings(self.model))
        return weights
