"""train.precision: fp32, bf16-mixed (float32 weights, bf16 autocast) and pure bf16."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from learner_utils import backward, learner

from dapo.algorithms import LossSettings
from dapo.config import ConfigError, TrainConfig, load_config
from dapo.models.precision import (
    autocast,
    compute_dtype,
    reference_copy,
    resolve_precision,
    set_precision,
)
from dapo.models.tiny import build_model, build_tokenizer
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs
from dapo.training.optim import make_optimizer

PAD = 0
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int = 3) -> torch.nn.Module:
    m = build_model(len(build_tokenizer()), seed=seed)
    m.train()
    return m


def samples(seed: int = 0, groups: int = 4, size: int = 4) -> list[Sample]:
    """Groups of responses of different lengths with signed advantages."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(3, 99) for _ in range(rng.randrange(4, 12))]
        for _ in range(size):
            resp = [rng.randrange(3, 99) for _ in range(rng.randrange(2, 30))]
            out.append(Sample(prompt, resp, rng.choice([-1.2, -0.5, 0.6, 1.3]), [1.0] * len(resp)))
    return out


def grads(model: torch.nn.Module, batch: list[Sample]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    backward(model, batch, LossSettings(), token_budget=400, pad_id=PAD)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_auto_resolves_by_device_and_old_dtype_keys_point_to_precision() -> None:
    assert load_config().train.precision == "auto"
    assert resolve_precision("auto", cuda=True) == "bf16-mixed"
    assert resolve_precision("auto", cuda=False) == "fp32"
    assert resolve_precision("bf16", cuda=False) == "bf16"
    for key in ("model.dtype", "torch_dtype", "bf16"):
        with pytest.raises(ConfigError, match="did you mean `train.precision`"):
            load_config(overrides=[f"{key}=bfloat16"])
    with pytest.raises(ConfigError, match="did you mean `train.logits_chunk_size`"):
        load_config(overrides=["train.entropy_chunk_size=64"])
    with pytest.raises(ConfigError, match="is not one of"):
        load_config(overrides=["train.precision=fp16"])


def test_one_bf16_mixed_update_at_lr_1e6_moves_every_weight_pure_bf16_rounds_it_away() -> None:
    """The paper's learning rate: AdamW moves each weight by about 1e-6. Float32 weights
    (bf16-mixed) take every such step; bf16 weights (spacing ~1/256 of the weight) drop
    almost all of them."""
    batch = samples()
    t = TrainConfig(lr=1e-6, weight_decay=0.0)
    changed = {}
    for precision in ("bf16-mixed", "bf16"):
        model = set_precision(tiny(), precision)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = make_optimizer(model, t)
        hooked: dict[str, torch.Tensor] = {}
        for n, p in model.named_parameters():  # the gradient each parameter received
            p.register_post_accumulate_grad_hook(
                lambda p, n=n, h=hooked: h.__setitem__(n, p.grad.clone())
            )
        result = learner(
            model, LossSettings(), token_budget=400, pad_id=PAD, optimizer=opt, max_grad_norm=1.0
        ).optimizer_step(batch)
        assert result.applied
        moved = total = 0
        for n, p in model.named_parameters():
            assert p.dtype == (torch.float32 if precision == "bf16-mixed" else torch.bfloat16)
            has_grad = hooked[n] != 0
            delta = p.detach() != before[n]
            assert not (delta & ~has_grad).any()  # no gradient, no weight decay: no change
            moved += int((delta & has_grad).sum())
            total += int(has_grad.sum())
        changed[precision] = moved / total
    assert changed["bf16-mixed"] == 1.0  # every weight that has a gradient
    assert changed["bf16"] < 0.10


def test_bf16_mixed_gradients_agree_with_fp32_within_bf16_rounding() -> None:
    batch = samples(seed=1)
    fp32 = tiny()
    mixed = set_precision(copy.deepcopy(fp32), "bf16-mixed")
    g32, g16 = grads(fp32, batch), grads(mixed, batch)
    assert g32.keys() == g16.keys()
    num = sum(float((g16[n] - g32[n]).square().sum()) for n in g32) ** 0.5
    den = sum(float(g32[n].square().sum()) for n in g32) ** 0.5
    assert all(g.dtype == torch.float32 for g in g16.values())  # float32 master gradients
    assert 0 < num / den < 2e-2  # bf16 keeps 8 significant bits: ~0.4% per product
    for n in g32:  # and no tensor is off on its own
        cos = torch.nn.functional.cosine_similarity(g16[n].flatten(), g32[n].flatten(), dim=0)
        assert cos > 0.99, n


def test_bf16_mixed_computes_in_bf16_and_returns_float32_logprobs() -> None:
    model = set_precision(tiny(), "bf16-mixed")
    seen: list[torch.dtype] = []
    layer = model.model.layers[0].mlp.down_proj
    handle = layer.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        logps = compute_logprobs(model, samples(groups=2), ForwardOptions(PAD, 1.0, 400))
    finally:
        handle.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert all(lp.dtype == torch.float32 for lp in logps)
    assert compute_dtype(model) == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32
    # fp32 and a DDP-style wrapper: the wrapper's module carries the precision
    wrapper = torch.nn.Module()
    wrapper.module = model
    assert compute_dtype(tiny()) == torch.float32
    with autocast(wrapper):
        assert torch.is_autocast_enabled("cpu")
    with autocast(tiny()):
        assert not torch.is_autocast_enabled("cpu")


def test_reference_copy_stores_linear_weights_in_bf16_and_matches_the_policy() -> None:
    """Under bf16-mixed autocast casts linear weights to bf16 for every product, so a
    reference model that stores them in bf16 computes the policy's log-probs exactly."""
    policy = set_precision(tiny(), "bf16-mixed")
    ref = reference_copy(policy)
    linear = [m for m in ref.modules() if isinstance(m, torch.nn.Linear)]
    tied = ref.get_input_embeddings().weight
    assert all(m.weight.dtype == torch.bfloat16 for m in linear if m.weight is not tied)
    assert tied.dtype == torch.float32 and not any(p.requires_grad for p in ref.parameters())
    batch = samples(seed=2)
    a = compute_logprobs(policy, batch, ForwardOptions(PAD, 1.0, 400))
    b = compute_logprobs(ref, batch, ForwardOptions(PAD, 1.0, 400))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    size = sum(p.numel() * p.element_size() for p in ref.parameters())
    assert size < 0.8 * sum(p.numel() * p.element_size() for p in policy.parameters())


def test_the_hf_engine_samples_in_the_trainers_precision() -> None:
    """Under bf16-mixed the engine's layers compute in bf16 and its output layer returns
    float32 logits from bf16 products, as the trainer's log-probs are computed."""
    from dapo.rollout import HFEngine, SamplingParams

    seen: dict[str, set[torch.dtype]] = {"layer": set(), "head": set()}
    model = set_precision(tiny(), "bf16-mixed")
    model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, i, o: seen["layer"].add(o.dtype)
    )
    model.lm_head.register_forward_hook(lambda m, i, o: seen["head"].add(o.dtype))
    params = SamplingParams(n=2, max_tokens=6, seed=0)
    groups = HFEngine(model, 1, 0).generate([[5, 6, 7]], params)
    assert seen == {"layer": {torch.bfloat16}, "head": {torch.float32}}
    assert len(groups[0].response_ids) == 2 and not torch.is_autocast_enabled("cpu")
    assert "forward" not in vars(model.lm_head)  # the head is itself again
    # The engine's sampling log-probs and the trainer's forward agree to bf16 rounding.
    response = groups[0].response_ids[0]
    sample = Sample([5, 6, 7], response, 1.0, [1.0] * len(response))
    (trainer,) = compute_logprobs(model, [sample], ForwardOptions(PAD, 1.0, 400))
    gap = (trainer - torch.tensor(groups[0].logprobs[0])).abs().max()
    assert gap < 0.05


def _run(tmp: Path, model_dir: Path, *extra: str) -> tuple[list[dict], list[str]]:
    from dapo.training.trainer import Trainer

    cfg = load_config(
        overrides=[
            f"model.name_or_path={model_dir}",
            f"output_dir={tmp}",
            "train.steps=2",
            "train.prompts_per_step=2",
            "train.mini_batch_size=2",
            "rollout.num_generations=4",
            "rollout.max_completion_length=12",
            "algorithm.overlong_buffer=4",
            "algorithm.dynamic_sampling=false",
            "evaluate=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "checkpoint.save_every=0",
            *extra,
        ]
    )
    lines: list[str] = []
    Trainer(cfg, log=lines.append).run()
    rows = [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]
    return rows, lines


@pytest.mark.slow
def test_bf16_mixed_run_logs_the_engine_mismatch_without_an_extra_pass(
    random_tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dapo.training import learner as learner_module

    passes: list[int] = []
    original = learner_module.compute_logprobs
    monkeypatch.setattr(
        learner_module,
        "compute_logprobs",
        lambda m, s, o: passes.append(len(s)) or original(m, s, o),
    )
    rows, lines = _run(tmp_path / "mixed", random_tiny_model, "train.precision=bf16-mixed")
    assert "precision: bf16-mixed" in lines
    assert passes == []  # one update per step: the training forward gave the comparison
    for row in rows:
        # The engine decodes token by token, the trainer forwards whole responses: in bf16
        # they round differently, by a small amount.
        assert 0 < row["rollout/logprob_mismatch"] < 0.2
    rows, lines = _run(tmp_path / "fp32", random_tiny_model)
    assert "precision: fp32 (auto: no CUDA, a CPU with no native bf16)" in lines
    assert all("rollout/logprob_mismatch" not in r for r in rows)
    rows, lines = _run(
        tmp_path / "pure", random_tiny_model, "train.precision=bf16", "train.lr=1e-6"
    )
    assert any(x.startswith("warning: train.precision=bf16") and "2.6e-04" in x for x in lines)
    assert (tmp_path / "pure" / "final_model").is_dir()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_optimizer_is_torchs_fused_adamw(precision: str) -> None:
    """The fused kernel, not the per-tensor or foreach one: those allocate temporaries the size
    of the largest parameter (or of all of them) at every step, ~1 GB more peak memory on a
    0.5B model (benchmarks/bench_memory.py). Its update is AdamW's, checked by hand."""
    model = set_precision(tiny(), precision)
    t = TrainConfig(lr=1e-3, weight_decay=0.1)
    opt = make_optimizer(model, t)
    assert all(group["fused"] for group in opt.param_groups)
    p = next(p for p in model.parameters() if p.dim() == 2)
    w0 = p.detach().float().clone()
    grads = {q: torch.randn_like(q) for q in model.parameters()}
    for q, g in grads.items():
        q.grad = g
    opt.step()
    g = grads[p].float()
    # AdamW's first step: m = (1-b1) g, v = (1-b2) g^2, bias-corrected to g and g^2.
    expected = w0 * (1 - t.lr * t.weight_decay) - t.lr * g / (g.abs() + 1e-8)
    tol = 1e-6 if precision == "fp32" else 1e-2
    torch.testing.assert_close(p.detach().float(), expected, atol=tol, rtol=tol)


def test_a_checkpoint_of_an_unfused_optimizer_resumes_fused(tmp_path: Path) -> None:
    """Checkpoints written before the fused kernel store AdamW's state with fused=None; the
    resumed optimizer takes that state (the moments) but keeps computing with its own kernel."""
    from dapo.training.checkpoint import load_checkpoint, save_checkpoint

    model = tiny()
    t = TrainConfig(lr=1e-3, weight_decay=0.0)
    old = make_optimizer(model, t)
    for group in old.param_groups:  # what earlier versions built: the default kernel
        group["fused"] = None
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    old.step()
    save_checkpoint(tmp_path, 1, model, old, {"step": 1})
    resumed = tiny()
    opt = make_optimizer(resumed, t)
    load_checkpoint(tmp_path / "step_000001", resumed, opt)
    assert all(group["fused"] for group in opt.param_groups)
    saved = old.state_dict()["state"]
    assert set(opt.state_dict()["state"]) == set(saved)
    for i, st in opt.state_dict()["state"].items():
        assert torch.equal(st["exp_avg"], saved[i]["exp_avg"])


def test_auto_on_a_cpu_follows_native_bf16_and_the_env_override(monkeypatch) -> None:
    from dapo.models import precision

    assert resolve_precision("auto", cuda=False, cpu_bf16=True) == "bf16-mixed"
    assert resolve_precision("auto", cuda=False, cpu_bf16=False) == "fp32"
    assert resolve_precision("auto", cuda=True, cpu_bf16=False) == "bf16-mixed"
    assert resolve_precision("bf16-mixed", cuda=False, cpu_bf16=False) == "bf16-mixed"  # asked
    for value, native in (("1", True), ("0", False)):
        monkeypatch.setenv(precision.CPU_BF16_ENV, value)
        assert precision.cpu_has_native_bf16() is native
        assert resolve_precision("auto", cuda=False) == ("bf16-mixed" if native else "fp32")
    monkeypatch.delenv(precision.CPU_BF16_ENV)
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    assert precision.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        slowdown = precision.bf16_cpu_slowdown(64)
        assert torch.get_num_threads() == 2  # the probe runs on one thread and gives them back
    finally:
        torch.set_num_threads(threads)
    assert slowdown > 0 and math.isfinite(slowdown)


@pytest.mark.slow
def test_bf16_on_a_cpu_without_it_warns_once_with_the_measured_slowdown(
    tmp_path, random_tiny_model, monkeypatch
) -> None:
    from dapo.training import learner as learner_module

    monkeypatch.setattr(learner_module, "bf16_cpu_slowdown", lambda: 118.4)
    _, lines = _run(tmp_path / "slow", random_tiny_model, "train.precision=bf16-mixed")
    warned = [x for x in lines if "without native bf16" in x]
    assert warned == [
        "warning: train.precision=bf16-mixed on a CPU without native bf16 (no AVX-512 BF16 "
        "or AMX): a bf16 matrix product measured 118x slower than float32 here, and every "
        "forward pass and generated token pays it. Use train.precision=auto (fp32 on this CPU) "
        "or fp32."
    ]
    monkeypatch.setattr(learner_module, "bf16_cpu_slowdown", lambda: 1.1)  # it is fast here
    _, lines = _run(tmp_path / "fast", random_tiny_model, "train.precision=bf16-mixed")
    assert not [x for x in lines if "without native bf16" in x]


def test_auto_on_a_native_bf16_cpu_keeps_float32_for_a_small_model(
    tmp_path, random_tiny_model, monkeypatch
) -> None:
    """Under a hidden size of 512 the casts cost more than the faster products save (the
    default run measured 1.9x slower in bf16-mixed on an AVX-512 BF16 + AMX Xeon)."""
    from dapo.models import hidden_size
    from dapo.models.precision import CPU_BF16_MIN_HIDDEN, precision_of, precision_origin
    from dapo.training.learner import Learner

    assert CPU_BF16_MIN_HIDDEN == 512
    for size, expected in ((128, "fp32"), (511, "fp32"), (512, "bf16-mixed"), (None, "bf16-mixed")):
        assert resolve_precision("auto", cuda=False, cpu_bf16=True, hidden_size=size) == expected
    assert resolve_precision("auto", cuda=False, cpu_bf16=False, hidden_size=4096) == "fp32"
    assert resolve_precision("auto", cuda=True, cpu_bf16=False, hidden_size=128) == "bf16-mixed"
    assert resolve_precision("bf16-mixed", cuda=False, cpu_bf16=True, hidden_size=128) == (
        "bf16-mixed"  # asked for: kept
    )
    assert hidden_size(str(random_tiny_model)) == 128
    assert hidden_size(build_model(len(build_tokenizer()))) == 128  # a loaded model: its config
    assert hidden_size(str(tmp_path / "missing")) is None
    assert "hidden size 128 (< 512)" in precision_origin("auto", False, True, 128)

    monkeypatch.setenv("DAPO_CPU_BF16", "1")
    cfg = load_config(overrides=[f"model.name_or_path={random_tiny_model}"])
    lines: list[str] = []
    learned = Learner.from_config(cfg, str(random_tiny_model), 0, lines.append)
    assert precision_of(learned.model) == "fp32"
    assert (
        "precision: fp32 (auto: no CUDA; a CPU with native bf16, but at hidden size 128 "
        "(< 512) float32 is faster)"
    ) in lines


def test_make_test_avx2_runs_as_on_a_cpu_without_native_bf16() -> None:
    """``make test-avx2``'s variables make this x86 CPU compute as an AVX2-only one: ATen
    dispatches AVX2 kernels, bf16 is not detected as native, and the start-up probe measures
    bf16 products many times slower than float32 (emulated), as on an AMD EPYC."""
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    assignment = re.search(r"^AVX2_ONLY := (.+)$", makefile, re.M)
    assert assignment, "the Makefile defines AVX2_ONLY"
    env = dict(os.environ) | dict(x.split("=", 1) for x in assignment.group(1).split())
    code = (
        "import torch; from dapo.models import precision as p; "
        "print(torch.backends.cpu.get_cpu_capability(), p.cpu_has_native_bf16(), "
        "p.bf16_cpu_slowdown())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    if not out[0].startswith("AVX"):
        pytest.skip(f"not an x86 CPU (ATen capability {out[0]})")
    assert out[0] == "AVX2"
    assert out[1] == "False"
    assert float(out[2]) >= 10, f"bf16 measured only {float(out[2]):.1f}x slower"
