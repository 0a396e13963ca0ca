"""Run under ``python -m torch.distributed.run --nproc_per_node 2`` by tests/test_distributed.py.

Modes:
  step DP OUT       one optimizer step on a fixed mini-batch with DP (ddp or fsdp; single:
                    no wrapper); rank 0 saves the parameters and each rank's share of them
  dynamic MODEL OUT REWARD [OVERRIDES...]
                    a short training run with uniform groups; each rank records what it trained
  variants DP OUT   one step per loss variant (VARIANTS) with DP; rank 0 saves the parameters
  lora DP OUT       as step, with LoRA adapters (rank 4): the checkpointed (adapter) state
  packed DP OUT [lora]  as step, with packed forwards (and LoRA adapters)
  vllm DP MODEL OUT two rollout steps with a vLLM engine per rank; each rank compares its
                    engine's log-probs with its trainer's (DP+lora: a LoRA policy)
  skip MODEL OUT REWARDS DATA  a run with algorithm.skip_uniform_prompts; each rank records the
                    prompts it drew, skipped and generated, and its prompt history
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dapo.parallel import distributed as D
from dapo.training.checkpoint import full_state


def fixed_batch():
    """Responses of very different lengths, two of them masked as truncated, and groups of
    responses to one prompt (trained with the shared prompt pass). Every prompt starts with
    the same two tokens: the workers forward them once per micro-batch (``PASS_COST`` 0)."""
    import random

    from dapo.training.batch import Sample

    rng = random.Random(0)
    gen = torch.Generator().manual_seed(1)
    lengths = [(5, 40), (12, 1), (3, 17), (9, 60), (7, 2), (4, 33), (6, 25), (8, 9)]
    groups = [(10, [1, 30, 52, 30]), (4, [22, 5, 14])]  # (prompt length, response lengths)
    samples = []
    for lp, lrs in [(lp, [lr]) for lp, lr in lengths] + groups:
        prompt = [7, 8] + [rng.randrange(3, 99) for _ in range(lp)]
        for lr in lrs:
            resp = [rng.randrange(3, 99) for _ in range(lr)]
            mask = [0.0 if len(samples) in (3, 6) else 1.0] * lr
            s = Sample(prompt, resp, rng.choice([-1.3, -0.4, 0.7, 1.1]), mask)
            s.old_logprobs = -4.6 + 0.5 * torch.randn(lr, generator=gen, dtype=torch.float64)
            samples.append(s)
    return samples


# Micro-batch token budgets. fsdp: the ranks get different numbers of micro-batches (6 and
# 5; FSDP pads the shorter rank). ddp: some micro-batches share a prompt pass and some do
# not, and the ranks' last ones differ (DDP's one forward per micro-batch must still match).
TOKEN_BUDGET = {"fsdp": 70, "ddp": 150, "single": 70}


def _model_and_optimizer(data_parallel: str, lora_rank: int = 0, packed: bool = False):
    """The seed-3 builtin model in float64 (with LoRA adapters of ``lora_rank`` > 0, their B
    set to small random values; ``packed``: prepared for packed forwards), wrapped for
    ``data_parallel``, and its AdamW."""
    from dapo.models import packing
    from dapo.models.tiny import build_model, build_tokenizer
    from dapo.parallel import sharding

    model = build_model(len(build_tokenizer()), seed=3).double()
    if packed:
        packing.install(model)
    if lora_rank:
        from dapo.config import LoraConfig
        from dapo.models.lora import apply_lora

        apply_lora(model, LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank))
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.train()
    ddp = None
    if data_parallel == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    elif data_parallel == "fsdp":
        sharding.shard_model(model, D.current())
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1
    )
    return model, ddp, opt


def one_step(
    data_parallel: str,
    checkpoints: Path | None = None,
    lora_rank: int = 0,
    packed: bool = False,
) -> dict:
    """One optimizer step; the full parameters and optimizer state after it (on rank 0
    under FSDP) and the number of parameter elements this rank holds.

    With ``checkpoints`` the state is also saved there as a checkpoint (FSDP: sharded, each
    rank writes its part) and loaded back into a fresh model and optimizer: ``reload_error``
    is the largest difference.
    """
    from learner_utils import learner
    from torch.distributed.tensor import DTensor

    from dapo.algorithms import LossSettings
    from dapo.training.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    model, ddp, opt = _model_and_optimizer(data_parallel, lora_rank, packed)
    local = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
    )
    result = learner(
        model,
        LossSettings(loss_agg="token-mean"),
        token_budget=TOKEN_BUDGET[data_parallel],
        optimizer=opt,
        max_grad_norm=1.0,
        ddp=ddp,
        packed=packed,
    ).optimizer_step(fixed_batch())
    assert result.applied
    full = full_state(model, opt)
    out = {
        "params": full.weights,
        "optimizer": full.optimizer,
        "local_numel": local,
        "grad_norm": result.grad_norm,
    }
    if checkpoints is not None:  # every rank saves (FSDP: its own shards)
        save_checkpoint(checkpoints, 1, model, opt, {"step": 1})
        D.barrier()
        fresh, _, fresh_opt = _model_and_optimizer(data_parallel, lora_rank)
        assert load_checkpoint(checkpoints / "step_000001", fresh, fresh_opt) == {"step": 1}
        again = full_state(fresh, fresh_opt)
        if D.current().is_main:
            diffs = [(again.weights[k] - v).abs().max() for k, v in full.weights.items()]
            for i, state in full.optimizer["state"].items():
                loaded = again.optimizer["state"][i]
                diffs += [(loaded[k] - v).abs().max() for k, v in state.items()]
            assert again.optimizer["param_groups"] == full.optimizer["param_groups"]
            out["reload_error"] = float(max(diffs))
    return out


def variant_settings():
    """The loss variants, corrections and entropy controls checked for rank-invariance."""
    from dapo.algorithms import LossSettings

    return {
        "gspo+is-sequence-mask": LossSettings(
            policy_loss="gspo",
            clip_low=0.05,
            clip_high=0.08,
            loss_agg="seq-mean-token-mean",
            is_cap=1.5,
            is_level="sequence",
            is_mode="mask",
        ),
        "cispo+is-token-mask": LossSettings(
            policy_loss="cispo",
            clip_low=1.0,
            clip_high=0.3,
            is_cap=1.3,
            is_level="token",
            is_mode="mask",
        ),
        "clip_cov": LossSettings(
            entropy_control="clip_cov",
            clip_low=1.0,
            clip_high=1.0,
            clip_cov_ratio=0.1,
            clip_cov_low=0.05,
            clip_cov_high=5.0,
        ),
        "kl_cov+entropy": LossSettings(
            entropy_control="kl_cov", kl_cov_ratio=0.1, entropy_coef=0.05
        ),
    }


def variant_step(data_parallel: str, name: str) -> dict:
    """One optimizer step with the variant ``name`` on the fixed batch, whose engine
    log-probs differ from the old ones; the full parameters after it and the selection."""
    from learner_utils import learner

    from dapo.training.token_weights import attach_is_weights

    torch.set_num_threads(1)
    settings = variant_settings()[name]
    model, ddp, opt = _model_and_optimizer(data_parallel)
    batch = fixed_batch()
    gen = torch.Generator().manual_seed(2)
    for s in batch:
        s.sampling_logprobs = s.old_logprobs + 0.2 * torch.randn(
            len(s.response_ids), generator=gen, dtype=torch.float64
        )
    attach_is_weights(batch, settings)
    result = learner(
        model,
        settings,
        token_budget=TOKEN_BUDGET[data_parallel],
        optimizer=opt,
        max_grad_norm=1.0,
        ddp=ddp,
    ).optimizer_step(batch, seed=17)
    assert result.applied
    return {
        "params": full_state(model, opt).weights,
        "selection": result.selection,
        "grad_norm": result.grad_norm,
        "loss": result.stats.parts["loss"],
    }


def mixed_precision_grads(data_parallel: str) -> dict:
    """The full gradient of one bf16-mixed step on the fixed batch (the seed-3 builtin model
    in float32; FSDP with bf16 parameters and float32 reduction), the dtypes the sharded
    parameters are stored in and the dtypes a layer computes with."""
    from learner_utils import learner
    from torch.distributed.tensor import DTensor

    from dapo.algorithms import LossSettings
    from dapo.models.precision import mixed_precision_dtype, set_precision
    from dapo.models.tiny import build_model, build_tokenizer
    from dapo.parallel import sharding

    torch.set_num_threads(1)
    model = set_precision(build_model(len(build_tokenizer()), seed=3), "bf16-mixed")
    model.train()
    if data_parallel == "fsdp":
        sharding.shard_model(model, D.current(), param_dtype=mixed_precision_dtype(model))
    computed: set[torch.dtype] = set()
    layer = model.model.layers[0].mlp.down_proj
    handle = layer.register_forward_pre_hook(lambda m, a: computed.add(m.weight.dtype))
    captured: dict[str, torch.Tensor] = {}

    class Capture:  # stands in for the optimizer: keeps the (clipped) gradient
        def step(self) -> None:
            for name, p in model.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                captured[name] = g.detach().clone()

        def zero_grad(self, set_to_none: bool = True) -> None:
            model.zero_grad(set_to_none=set_to_none)

    batch = fixed_batch()
    for s in batch:
        s.old_logprobs = s.old_logprobs.float()
    learner(
        model, LossSettings(), token_budget=TOKEN_BUDGET["fsdp"], optimizer=Capture()
    ).optimizer_step(batch)
    handle.remove()
    stored = {p.dtype for p in model.parameters()}
    return {"grads": captured, "stored": stored, "computed": computed}


def no_grad_passes_match(data_parallel: str) -> bool:
    """Generation and log-prob passes of the wrapped model equal those of a plain copy.

    The ranks sample different numbers of decoding steps and score different numbers of
    samples (rank 1 none), which FSDP's per-layer all-gathers could not survive.
    """
    from dapo.rollout import HFEngine, SamplingParams
    from dapo.training.forward import ForwardOptions, compute_logprobs

    rank = D.current().rank
    model, _, _ = _model_and_optimizer(data_parallel)
    plain, _, _ = _model_and_optimizer("single")
    params = SamplingParams(n=2, max_tokens=4 + 9 * rank, seed=rank)
    prompts = [[5, 6, 7], [8, 9]][: 2 - rank]
    groups = [HFEngine(m, 1, 0).generate(prompts, params) for m in (model, plain)]
    same = all(
        a.response_ids == b.response_ids and a.logprobs == b.logprobs
        for a, b in zip(*groups, strict=True)
    )
    samples = fixed_batch()[: 3 * (1 - rank)]
    logps = [compute_logprobs(m, samples, ForwardOptions(0, 1.0, 40)) for m in (model, plain)]
    return same and all(torch.equal(a, b) for a, b in zip(*logps, strict=True))


def vllm_colocated(data_parallel: str, model_path: str, out: Path, lora: bool = False) -> dict:
    """Two rollout steps with a vLLM engine per rank (2 updates each, weights pushed after
    each step); then every rank samples its own prompts with its engine and compares the
    engine's log-probs with its trainer's, and with those of the initial weights. ``lora``:
    a LoRA policy (rank 4), whose engines get the merged weights."""
    from transformers import AutoModelForCausalLM

    from dapo.config import load_config
    from dapo.training.batch import Sample
    from dapo.training.forward import ForwardOptions, compute_logprobs
    from dapo.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(
        overrides=[
            f"model.name_or_path={model_path}",
            f"output_dir={out}",
            "rollout.engine=vllm",
            f"train.data_parallel={data_parallel}",
            "train.steps=2",
            "train.prompts_per_step=4",
            "train.mini_batch_size=2",
            "rollout.num_generations=4",
            "rollout.max_completion_length=12",
            "algorithm.overlong_buffer=4",
            "algorithm.dynamic_sampling=false",
            "evaluate=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "logging.console=false",
            "checkpoint.save_every=0",
            *(["model.lora.rank=4", "train.lr=3e-2"] if lora else ["train.lr=3e-3"]),
        ]
    )
    trainer = Trainer(cfg, log=lambda _: None)
    try:
        steps = [trainer.train_step()[0] for _ in range(2)]
        rank = trainer.dist.rank
        # this rank's own prompts
        groups = trainer.rollouts.generate(list(range(rank, 8, 2)), step=99, round_no=0)
        samples = [
            Sample(g.prompt_ids, r, 0.0, [1.0] * len(r)) for g in groups for r in g.response_ids
        ]
        forward = ForwardOptions(trainer.tokenizer.pad_token_id, 1.0, 4096)
        trained = compute_logprobs(trainer.model, samples, forward)
        initial = AutoModelForCausalLM.from_pretrained(model_path).float()
        before = compute_logprobs(initial, samples, forward)
        engine = [torch.tensor(lp) for g in groups for lp in g.logprobs]
        return {
            "rank": rank,
            "engine_vs_trainer": max(
                float((e - t).abs().max()) for e, t in zip(engine, trained, strict=True)
            ),
            "engine_vs_initial": max(
                float((e - b).abs().max()) for e, b in zip(engine, before, strict=True)
            ),
            "responses": [g.response_ids for g in groups],
            "mismatch": [m.get("rollout/logprob_mismatch") for m in steps],
            "synced": ["perf/weight_sync_s" in m for m in steps],
            "updates": [m["actor/updates"] for m in steps],
        }
    finally:
        trainer.close()


def skip_run(model: str, out: str, rewards: str, data: str, rank: int) -> None:
    from dapo.config import load_config
    from dapo.training.trainer import Trainer

    cfg = load_config(
        overrides=[
            f"model.name_or_path={model}",
            f"output_dir={out}",
            f"data.train={data}",
            "data.answer_key=answer",
            "train.steps=6",
            "train.prompts_per_step=4",
            "train.mini_batch_size=2",
            "rollout.num_generations=4",
            "rollout.max_completion_length=8",
            "algorithm.overlong_buffer=2",
            "evaluate=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "logging.console=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            f"reward.functions=[{{name: '{rewards}:by_answer_class'}}]",
            "algorithm.skip_uniform_prompts=true",
        ]
    )
    trainer = Trainer(cfg, log=lambda _: None)
    seen: dict = {"taken": [], "skipped": [], "generated": []}
    next_prompts, generate = trainer.rollouts.prompts.next, trainer.rollouts.engine.generate

    def record_prompts(k, skipped):
        before = len(skipped)
        taken = next_prompts(k, skipped)
        seen["taken"] += taken
        seen["skipped"] += skipped[before:]
        return taken

    def record_generate(prompt_ids, params):
        seen["generated"] += [list(p) for p in prompt_ids]
        return generate(prompt_ids, params)

    trainer.rollouts.prompts.next, trainer.rollouts.engine.generate = (
        record_prompts,
        record_generate,
    )
    trainer.run()
    seen["taken_ids"] = [trainer.rollouts.train_ids[i] for i in seen["taken"]]
    seen["history"] = trainer.rollouts.prompts.history.state_dict()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(seen))


def mark(rank: int, stage: str) -> None:
    """Record the stage this rank reached (tests/ranks.py reports it when a rank dies)."""
    Path(f".rank{rank}.stage").write_text(stage)


def main() -> None:
    mode = sys.argv[1]
    info = D.init_distributed()
    assert info.world_size == 2, info
    mark(info.rank, "running")
    if mode == "step":
        from dapo.models import inputs

        inputs.PASS_COST = 0  # the prompts' two shared tokens are forwarded once (fixed_batch)
        dp = sys.argv[2]
        match = D.all_gather_objects(no_grad_passes_match(dp))
        out = one_step(dp, Path(sys.argv[3]).parent / f"checkpoints-{dp}")
        if dp == "fsdp":
            out["mixed"] = mixed_precision_grads(dp)
        local = D.all_gather_objects(out["local_numel"])
        if info.is_main:
            torch.save({**out, "local_numel": local, "no_grad_passes_match": match}, sys.argv[3])
    elif mode == "packed":  # one step with packed forwards (and LoRA with "lora")
        from dapo.training import forward

        dp, lora_rank = sys.argv[2], 4 if sys.argv[4:] == ["lora"] else 0
        rows, real = [], forward.packed_states
        forward.packed_states = lambda model, row, *a: rows.append(row) or real(model, row, *a)
        out = one_step(dp, lora_rank=lora_rank, packed=True)
        out["packed_rows"] = D.all_gather_objects(len(rows))
        if info.is_main:
            torch.save(out, sys.argv[3])
    elif mode == "lora":
        dp = sys.argv[2]
        out = one_step(dp, Path(sys.argv[3]).parent / f"checkpoints-lora-{dp}", lora_rank=4)
        if info.is_main:
            torch.save(out, sys.argv[3])
    elif mode == "variants":
        dp = sys.argv[2]
        out = {name: variant_step(dp, name) for name in variant_settings()}
        if info.is_main:
            torch.save(out, sys.argv[3])
    elif mode == "dynamic":
        from dapo.config import load_config
        from dapo.training.trainer import Trainer

        model, out, rewards = sys.argv[2], Path(sys.argv[3]), sys.argv[4]
        cfg = load_config(
            overrides=[
                f"model.name_or_path={model}",
                f"output_dir={out}",
                "train.steps=3",
                "train.prompts_per_step=4",
                "train.mini_batch_size=2",
                "rollout.num_generations=4",
                "rollout.max_completion_length=12",
                "algorithm.overlong_buffer=4",
                "evaluate=false",
                "logging.tensorboard=false",
                "logging.dashboard=false",
                "logging.console=false",
                "checkpoint.save_every=0",
                f"reward.functions=[{{name: '{rewards}'}}]",
                *sys.argv[5:],
            ]
        )
        trainer = Trainer(cfg, log=lambda _: None)
        seen: list[dict] = []
        original_build, original_step = trainer.build_samples, trainer.learner.optimizer_step
        rows: dict[int, int] = {}  # id of a sample of this step -> its row

        def record(groups):
            seen.append(
                {
                    "step": trainer.step,
                    "groups": [list(map(bool, x.correct)) for x in groups],
                    "trained_rows": [],
                    "uids": [x.record.uid for x in groups],
                }
            )
            samples = original_build(groups)
            rows.clear()
            rows.update({id(s): i for i, s in enumerate(samples)})
            return samples

        def step(batch, *, share, **kw):  # the rows of each planned update that this rank trains
            mine = {rows[id(batch[j])] for j in share}
            seen[-1]["trained_rows"] = sorted(set(seen[-1]["trained_rows"]) | mine)
            return original_step(batch, share=share, **kw)

        trainer.learner.optimizer_step = step
        trainer.build_samples = record
        trainer.run()
        (out / f"rank{info.rank}.json").write_text(json.dumps(seen))
    elif mode == "vllm":
        out = Path(sys.argv[4])
        dp, _, lora = sys.argv[2].partition("+")  # e.g. fsdp+lora
        result = vllm_colocated(dp, sys.argv[3], out, lora=lora == "lora")
        (out / f"rank{info.rank}.json").write_text(json.dumps(result))
    elif mode == "skip":
        skip_run(*sys.argv[2:6], rank=info.rank)
    mark(info.rank, "finished, leaving the process group")
    D.destroy()
    mark(info.rank, "left the process group")


if __name__ == "__main__":
    main()
    from dapo.process_exit import exit_now

    exit_now(0)
