"""The ``gpu`` tier (``pytest -m gpu``; ``make test-gpu`` on a GPU machine) and the CPU
stand-ins of the CUDA branches it covers.

Tier tests are marked ``gpu`` and skip, with the reason, where CUDA is absent (and the vLLM
ones where vLLM is absent or a CPU build). Each checks one CUDA path against a reference, with
the tolerance stated in the test:

- training numerics: a bf16-mixed update against the float32 one, chunked log-probs and
  entropies against whole logits, checkpointed layers with the shared-prompt forward against
  the plain forward (same gradient), FSDP2 over NCCL (``tests/gpu_fsdp_worker.py``);
- generation: the ``hf`` engine's sampling log-probs against the trainer's forward, the
  default run's usual gain;
- the rollout server's weight channel to a stand-in server in another process
  (``tests/gpu_weight_receiver.py``; NCCL needs a second GPU), and with vLLM: the colocated
  engine's sleep, wake and weight load, FP8 rollouts, 2-step ``vllm-server`` runs, a 2-step
  run of the vision-language model with its images given to vLLM.

The unmarked tests run everywhere: the same code on the CPU (the weight channel over gloo,
the FSDP2 script on gloo) or the device choices of the CUDA branches (autocast, attention).
Figures measured on a GPU go to ``$DAPO_GPU_FIGURES`` (``gpu_support.record``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gpu_support import free_port, gpu_test, record, relative_error, samples, wait_for_health
from learner_utils import backward, learner

from dapo.algorithms import LossSettings
from dapo.config import TrainConfig
from dapo.models.precision import set_precision
from dapo.models.tiny import build_model, build_tokenizer
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs
from dapo.training.token_weights import logprob_mismatch

TESTS = Path(__file__).resolve().parent
PAD, EOS = 0, 1
CUDA = torch.device("cuda:0")
# NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected").
ONE_GPU_NCCL = ": NCCL refuses two ranks on one GPU, so the NCCL weight channel needs a second"


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    """The warmed-up builtin:tiny (built on first use; ``make test-gpu`` brings a copy)."""
    from dapo.models import resolve_model_path

    return Path(resolve_model_path("builtin:tiny", log=print))


def addition_prompts(n: int) -> list[list[int]]:
    from dapo.data.tasks.addition import addition_records

    tok = build_tokenizer()
    return [
        tok(r.prompt, add_special_tokens=False)["input_ids"] for r in addition_records("test", n=n)
    ]


def engine_samples(groups) -> list[Sample]:
    """One sample per response, with the engine's sampling log-probs."""
    return [
        Sample(g.prompt_ids, r, 0.0, [1.0] * len(r), sampling_logprobs=torch.tensor(lp))
        for g in groups
        for r, lp in zip(g.response_ids, g.logprobs, strict=True)
    ]


def gradients(model: torch.nn.Module, batch: list[Sample], **kw) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    backward(model, batch, LossSettings(), token_budget=400, pad_id=PAD, **kw)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ======================================================================================
# CPU stand-ins: the device choices of the CUDA branches, and the same code on the CPU
# ======================================================================================


def test_autocast_takes_the_device_of_the_model_and_bf16_only_under_bf16_mixed(monkeypatch):
    """``precision.autocast`` enters ``torch.autocast(<the model's device type>, bfloat16)``
    under bf16-mixed: on a CUDA model that is CUDA's autocast (checked on the GPU by
    ``test_bf16_mixed_update_on_cuda_agrees_with_fp32``); none in fp32, pure bf16 or FSDP."""
    from dapo.models import precision

    entered: list[tuple[str, torch.dtype]] = []
    caches: list[bool] = []

    class Recorder:
        def __init__(self, device_type: str, dtype: torch.dtype, cache_enabled: bool) -> None:
            entered.append((device_type, dtype))
            caches.append(cache_enabled)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(precision.torch, "autocast", Recorder)
    monkeypatch.setattr(precision, "device_of", lambda m: torch.device("cuda", 0))
    for mode, expected in (("bf16-mixed", [("cuda", torch.bfloat16)]), ("fp32", []), ("bf16", [])):
        entered.clear()
        with precision.autocast(set_precision(build_model(99), mode)):
            pass
        assert entered == expected, mode
    # Under CUDA graphs no cast is cached (a cached cast would be freed when the context ends).
    with precision.autocast(set_precision(build_model(99), "bf16-mixed"), cache=False):
        pass
    assert caches == [True, False]
    monkeypatch.setattr(precision, "is_fsdp", lambda m: True)  # FSDP2 casts parameters itself
    entered.clear()
    with precision.autocast(set_precision(build_model(99), "bf16-mixed")):
        pass
    assert entered == []


def test_the_hf_engine_swaps_its_attention_in_while_generating_only():
    """While generating, the engine's attention (grouped-query decode over the static cache,
    SDPA for prompts) replaces the model's on every device; afterwards the model's is back."""
    from dapo.rollout.attention import generation_attention

    model = build_model(99)
    assert model.config._attn_implementation == "sdpa"
    with generation_attention(model):
        assert model.config._attn_implementation == "dapo_generate"
    assert model.config._attn_implementation == "sdpa"


def run_fsdp_worker(out: Path, device: str) -> dict:
    """``tests/gpu_fsdp_worker.py`` in a process of its own (a group of one rank)."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
    }
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(TESTS / "gpu_fsdp_worker.py"), str(out), device],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def check_fsdp_result(result: dict) -> None:
    assert "bf16 parameters in forward/backward, fp32 gradient reduction" in result["log"][0]
    # bf16 rounding of parameters and activations: 0.8% on CPU; 2e-2 is the stated bound.
    assert result["grad_rel_error"] < 2e-2 and result["grad_dtypes"] == ["torch.float32"]
    assert result["fused"] and all(s["applied"] for s in result["steps"]) and result["finite"]
    assert result["logprobs_finite"]
    assert "model_optim/.metadata" in result["checkpoint_files"]  # a DCP directory
    assert "trainer_state.pt" in result["checkpoint_files"]
    assert result["resumed_step"] == 2 and result["weights_equal"]
    assert result["moments_max_diff"] == 0.0
    assert result["next_step_max_diff"] <= 1e-6  # the resumed run continues as the first


@pytest.mark.slow
def test_the_fsdp_script_on_gloo_trains_checkpoints_and_resumes(tmp_path):
    """The FSDP2 tier test's script on the CPU: a gloo group of one rank."""
    check_fsdp_result(run_fsdp_worker(tmp_path, "cpu"))


def push_to_stand_in(
    tmp_path: Path,
    model_dir: Path,
    policy_device: torch.device,
    receiver_device: str,
    served_device: str = "cpu",
) -> None:
    """Two weight pushes and a close from a :class:`ServerEngine` over ``policy_device``'s
    policy to ``tests/gpu_weight_receiver.py`` in another process; checks what arrived, in
    which order, where."""
    from dapo.models import load_policy
    from dapo.parallel.sharding import full_named_parameters
    from dapo.rollout.fingerprint import of_module
    from dapo.rollout.server_client import ServerEngine

    port, record, log = free_port(), tmp_path / "record.json", tmp_path / "receiver.log"
    cmd = [
        sys.executable,
        str(TESTS / "gpu_weight_receiver.py"),
        str(model_dir),
        "--port",
        str(port),
        "--device",
        receiver_device,
        "--served-device",
        served_device,
        "--record",
        str(record),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=TESTS, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc, log)
        model = load_policy(str(model_dir)).to(policy_device)
        eng = ServerEngine(
            f"http://127.0.0.1:{port}",
            max_model_len=64,
            eos_token_id=EOS,
            policy=of_module(model, EOS),
            timeout_s=120,
        )
        sent = []
        gen = torch.Generator(device=policy_device).manual_seed(0)
        for _ in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen, device=policy_device), alpha=0.01)
            weights = full_named_parameters(model)
            sent.append([(n, float(t.double().sum()), list(t.shape)) for n, t in weights])
            eng.load_weights(weights)  # returns once the receiver has them all
        eng.close()
        deadline = time.monotonic() + 30
        while not (record.exists() and json.loads(record.read_text())[-1]["event"] == "leave"):
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(30)
    events = json.loads(record.read_text())
    backend = "gloo" if served_device == "cpu" else "nccl"
    assert [e["event"] for e in events] == ["join", "load", "load", "leave"], events
    assert events[0]["backend"] == backend and events[0]["world_size"] == 2
    for push, event in zip(sent, events[1:3], strict=True):
        got = event["tensors"]
        assert [t["name"] for t in got] == [n for n, _, _ in push]  # in the announced order
        for (name, total, shape), t in zip(push, got, strict=True):
            assert t["shape"] == shape and t["dtype"] == "float32", name
            assert t["device"] == str(torch.device(receiver_device)), name
            assert abs(t["sum"] - total) <= 1e-9 * max(1.0, abs(total)), name  # the same values


@pytest.mark.slow
def test_weights_reach_a_stand_in_server_process_in_order_over_gloo(tmp_path, random_tiny_model):
    """The weight channel's messages between two processes (CPU, gloo): join once, each
    push's tensors in the announced order with their values, leave at close."""
    push_to_stand_in(tmp_path, random_tiny_model, torch.device("cpu"), "cpu")


# ======================================================================================
# The tier: training numerics on CUDA
# ======================================================================================


@gpu_test()
def test_bf16_mixed_update_on_cuda_agrees_with_fp32():
    """One optimizer step on CUDA: the bf16-mixed gradient is the float32 one to bf16
    rounding (stated bound: relative L2 error < 2e-2, each tensor's cosine > 0.99; 0.7% on
    CPU), the layers compute in bf16 under CUDA's autocast, and fused AdamW moves the
    float32 master weights like the float32 run (the first step normalises each entry, so
    near-zero entries may flip: > 98% of the moves agree in sign, relative difference < 0.3;
    CPU: 99.7% and 0.10)."""
    from dapo.training.optim import make_optimizer

    batch = samples(seed=1)
    fp32 = build_model(99, seed=3).to(CUDA).train()
    mixed = set_precision(copy.deepcopy(fp32), "bf16-mixed")
    seen: set[tuple[str, torch.dtype]] = set()
    mixed.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, i, o: seen.add((o.device.type, o.dtype))
    )
    g32, g16 = gradients(fp32, batch), gradients(mixed, batch)
    assert seen == {(CUDA.type, torch.bfloat16)}
    assert all(g.dtype == torch.float32 and g.device == CUDA for g in g16.values())
    error = relative_error(g16, g32)
    record("bf16-mixed vs fp32 gradient, relative L2 error (CUDA)", round(error, 5))
    assert 0 < error < 2e-2
    for n in g32:
        assert (
            torch.nn.functional.cosine_similarity(g16[n].flatten(), g32[n].flatten(), dim=0) > 0.99
        ), n
    moves = {}
    for name, start in (("fp32", fp32), ("mixed", mixed)):
        model = copy.deepcopy(start)
        model.zero_grad(set_to_none=True)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = make_optimizer(model, TrainConfig(lr=1e-3, weight_decay=0.0))
        assert all(group["fused"] for group in opt.param_groups)
        step = learner(model, LossSettings(), token_budget=400, optimizer=opt, max_grad_norm=1.0)
        assert step.optimizer_step(batch).applied
        assert all(p.dtype == torch.float32 for p in model.parameters())
        moves[name] = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    agree = sum(int(((moves["mixed"][n] > 0) == (moves["fp32"][n] > 0)).sum()) for n in g32)
    share = agree / sum(g32[n].numel() for n in g32)
    update_error = relative_error(
        {n: moves["mixed"][n] for n in g32}, {n: moves["fp32"][n] for n in g32}
    )
    record(
        "bf16-mixed vs fp32 AdamW step: sign agreement, relative difference (CUDA)",
        [round(share, 4), round(update_error, 4)],
    )
    assert share > 0.98 and update_error < 0.3


@gpu_test()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_logprobs_and_entropy_on_cuda_equal_the_whole_logits(dtype):
    """``chunked_logprobs`` on CUDA (bf16: bf16 operands, products summed in float32 by
    ``torch.mm(..., out_dtype=float32)``) against a float64 reference of the same operands:
    log-probs and entropies to 1e-4; their gradients to 1e-4 (relative) in float32 and 1e-2
    in bf16 (the logits' gradient is a bf16 operand of the backward products); chunks of 37
    rows, temperature 0.7. In bf16, logits rounded to bf16 would be off by far more."""
    from dapo.models.chunked_logprobs import chunked_logprobs

    gen = torch.Generator(device=CUDA).manual_seed(0)
    n, h, v, t = 300, 64, 1000, 0.7
    hidden = torch.randn(n, h, device=CUDA, generator=gen, requires_grad=True)
    weight = (torch.randn(v, h, device=CUDA, generator=gen) / 4).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device=CUDA, generator=gen)
    g_lp, g_ent = (
        torch.randn(n, device=CUDA, generator=gen),
        torch.randn(n, device=CUDA, generator=gen),
    )
    logp, ent = chunked_logprobs(
        hidden, weight, targets, temperature=t, chunk_size=37, compute_dtype=dtype
    )
    assert logp.dtype == ent.dtype == torch.float32 and logp.device == CUDA
    gh, gw = torch.autograd.grad((logp * g_lp + ent * g_ent).sum(), (hidden, weight))
    h64 = hidden.detach().to(dtype).double().requires_grad_(True)
    w64 = weight.detach().to(dtype).double().requires_grad_(True)
    z = (h64 @ w64.T) / t
    ref_lp = torch.log_softmax(z, -1).gather(-1, targets[:, None])[:, 0]
    ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    rh, rw = torch.autograd.grad(
        (ref_lp * g_lp.double() + ref_ent * g_ent.double()).sum(), (h64, w64)
    )
    err = max(
        float((logp.double() - ref_lp).abs().max()), float((ent.double() - ref_ent).abs().max())
    )
    record(f"chunked log-probs/entropy vs float64, max error ({dtype}, CUDA)", f"{err:.2e}")
    assert err < 1e-4
    bound = 1e-4 if dtype == torch.float32 else 1e-2
    for got, want in ((gh, rh), (gw, rw)):
        assert relative_error({"g": got}, {"g": want}) < bound
    if dtype == torch.bfloat16:  # what summing in float32 saves: logits rounded to bf16
        rounded = z.float().to(torch.bfloat16).double()
        naive = torch.log_softmax(rounded, -1).gather(-1, targets[:, None])[:, 0]
        assert float((naive - ref_lp).abs().max()) > 10 * err


@gpu_test()
def test_the_training_forward_on_cuda_equals_whole_logits_and_shared_prompt_with_checkpointing(
    monkeypatch,
):
    """On CUDA in float32: the chunked output layer (chunks of 7) gives the whole-logits
    log-probs and entropies (1e-5), and checkpointed layers with the shared-prompt forward
    give the gradient of the plain forward of whole sequences (relative 1e-4: only the
    summation order differs), with the layers run again in backward; also with the responses
    forwarded in one pass per distinct length."""
    from dapo import algorithms as alg
    from dapo.models.activation_checkpointing import checkpoint_layers
    from dapo.training import forward
    from dapo.training.forward import response_logits, response_states, token_logprobs
    from dapo.training.microbatch import collate

    plain = build_model(99, seed=5).to(CUDA).train()
    batch = samples(seed=8)
    mb = collate(batch, PAD)
    with torch.no_grad():
        states = response_states(plain, mb, shared_prompt=False)
        logp, ent = token_logprobs(plain, states, mb, temperature=0.8, chunk_size=7)
        logits = response_logits(plain, mb, temperature=0.8, shared_prompt=False)
    mask = mb.response_mask.to(CUDA) > 0
    ref_lp = alg.token_logprobs(logits, mb.response_ids.to(CUDA))
    torch.testing.assert_close(logp[mask], ref_lp[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[mask], alg.token_entropy(logits)[mask], atol=1e-5, rtol=1e-5)

    checkpointed = copy.deepcopy(plain)
    assert checkpoint_layers(checkpointed) == 4
    calls = {"plain": 0, "checkpointed": 0}
    for key, m in (("plain", plain), ("checkpointed", checkpointed)):
        m.model.layers[0].self_attn.register_forward_pre_hook(
            lambda *_, k=key: calls.__setitem__(k, calls[k] + 1)
        )
    want = gradients(plain, batch, shared_prompt=False)
    got = gradients(checkpointed, batch, shared_prompt=True)
    assert calls["checkpointed"] > calls["plain"]  # prompt passes, and every pass again in backward
    error = relative_error(got, want)
    record(
        "checkpointing + shared prompt vs plain gradient, relative error (CUDA, fp32)",
        f"{error:.1e}",
    )
    assert error < 1e-4
    monkeypatch.setattr(forward, "BUCKET_COST", 0)  # a response pass per distinct length
    by_length = relative_error(gradients(checkpointed, batch, shared_prompt=True), want)
    record("the same, responses in a pass per length, relative error", f"{by_length:.1e}")
    assert by_length < 1e-4


@gpu_test()
def test_fsdp2_at_world_size_1_over_nccl_trains_checkpoints_and_resumes(tmp_path):
    """FSDP2 on one GPU in a NCCL group of one rank (``tests/gpu_fsdp_worker.py``): the bf16
    gradient within 2e-2 of float32's, two fused-AdamW steps, a DCP checkpoint, and a resume
    that holds the same weights and moments and takes the same next step."""
    result = run_fsdp_worker(tmp_path, "cuda")
    record(
        "FSDP2 (world 1, NCCL) bf16 vs fp32 gradient, relative error",
        round(result["grad_rel_error"], 5),
    )
    check_fsdp_result(result)
    assert "nccl" in result["log"][0]


# ======================================================================================
# The tier: generation and the default run on CUDA
# ======================================================================================


@gpu_test()
@pytest.mark.parametrize(
    ("precision", "bound"), [("fp32", 1e-3), ("bf16-mixed", 2e-2)], ids=["fp32", "bf16-mixed"]
)
def test_the_hf_engine_on_cuda_samples_with_the_trainers_logprobs(precision, bound, tiny_path):
    """The ``hf`` engine decodes token by token on CUDA; the trainer forwards whole responses.
    The mean |difference| of their log-probs over 64 responses of the warmed-up model:
    below 1e-3 in float32, below 2e-2 in bf16-mixed (bf16 rounds the two orders of
    computation differently; 1e-4 on the CPU default run)."""
    from dapo.models import load_policy
    from dapo.rollout import HFEngine, SamplingParams

    model = set_precision(load_policy(str(tiny_path)), precision).to(CUDA)
    groups = HFEngine(model, EOS, PAD).generate(
        addition_prompts(16), SamplingParams(n=4, max_tokens=64, seed=0)
    )
    batch = engine_samples(groups)
    metrics = logprob_mismatch(
        batch, compute_logprobs(model, batch, ForwardOptions(PAD, 1.0, 8192))
    )
    record(
        f"hf engine vs trainer log-probs on CUDA ({precision}): mean |diff|, k3 KL",
        [f"{metrics['rollout/logprob_mismatch']:.2e}", f"{metrics['rollout/mismatch_kl']:.2e}"],
    )
    assert metrics["rollout/logprob_mismatch"] < bound
    assert 0 <= metrics["rollout/mismatch_kl"] < bound


@gpu_test()
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_cuda_graphs_on_and_off_give_the_same_tokens_and_every_bucket_is_captured(
    precision, tiny_path, monkeypatch
):
    """Greedy decoding with the decode step replayed from CUDA graphs and without: the same
    tokens, log-probs within 1e-4 (fp32) / 2e-2 (bf16-mixed); 40 responses of lengths spread
    over 4..48 on a batch of 16 pass through buckets 16 down to 1 and through growing cache
    windows (from 32 slots here), each captured once (a second call captures nothing new);
    no capture fallback is said. With nothing kept between calls (as for a model whose cache
    and bf16 copies are large), two calls each capture anew on fresh buffers and give the
    same tokens."""
    from dapo.models import load_policy
    from dapo.rollout import HFEngine, SamplingParams, buffers, decode

    monkeypatch.setattr(decode, "GRAPH_MIN_WINDOW", 32)
    model = set_precision(load_policy(str(tiny_path)), precision).to(CUDA)
    prompts = addition_prompts(20)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=48)
    lines: list[str] = []
    on = HFEngine(model, EOS, PAD, batch_size=16, cuda_graphs="on", log=lines.append)
    off = HFEngine(model, EOS, PAD, batch_size=16, cuda_graphs="off")
    assert on.uses_graphs() and not off.uses_graphs()
    a, b = on.generate(prompts, params), off.generate(prompts, params)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    gap = max(
        abs(x - y)
        for ga, gb in zip(a, b, strict=True)
        for la, lb in zip(ga.logprobs, gb.logprobs, strict=True)
        for x, y in zip(la, lb, strict=True)
    )
    assert gap < (1e-4 if precision == "fp32" else 2e-2), gap
    (ws,) = on.workspaces.entries.values()
    captured = sorted({key[0] for key in ws.graphs})
    windows = sorted({key[1] for key in ws.graphs})
    record(
        f"CUDA graphs ({precision}): buckets and windows captured, max |logprob gap|",
        [captured, windows, gap],
    )
    assert 16 in captured and len(captured) >= 3, captured
    assert len(windows) >= 2 and windows[-1] <= ws.state.valid.shape[1], windows
    before = len(ws.graphs)
    on.generate(prompts, params)
    assert len(ws.graphs) == before  # replayed, not captured again
    assert not lines, lines

    monkeypatch.setattr(buffers, "KEEP_BYTES", 0)  # frees the cache and the bf16 copies
    fresh = HFEngine(model, EOS, PAD, batch_size=16, cuda_graphs="on", log=lines.append)
    for _ in range(2):
        again = fresh.generate(prompts, params)
        assert [g.response_ids for g in again] == [g.response_ids for g in b]
        assert not fresh.workspaces.entries and fresh.weights.nbytes() == 0
    assert not lines, lines


@gpu_test()
def test_a_cache_that_does_not_fit_decodes_on_a_smaller_bucket_on_cuda(tiny_path, monkeypatch):
    """On CUDA with graphs, where the available memory (patched to room for 5 of 16 rows)
    does not hold the cache, the engine decodes on the largest bucket that fits (4) and says
    so once, with the greedy tokens of all 16 rows."""
    from dapo.memory import Memory
    from dapo.models import load_policy
    from dapo.rollout import HFEngine, SamplingParams, decode

    model = load_policy(str(tiny_path)).to(CUDA)
    prompts = addition_prompts(8)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=32)
    from test_decode import row_estimates

    per_row = row_estimates(monkeypatch)
    roomy = HFEngine(model, EOS, PAD, batch_size=16, cuda_graphs="on")
    want = roomy.generate(prompts, params)
    room = Memory(int(5.4 * per_row[-1] / decode.CACHE_SHARE), 2**40)
    monkeypatch.setattr(decode, "device_memory", lambda device: room)
    lines: list[str] = []
    engine = HFEngine(model, EOS, PAD, batch_size=16, cuda_graphs="on", log=lines.append)
    got = engine.generate(prompts, params)
    assert [g.response_ids for g in got] == [g.response_ids for g in want]
    (ws,) = engine.workspaces.entries.values()
    assert ws.state.done.shape[0] == 4 and max(key[0] for key in ws.graphs) == 4
    assert len(lines) == 1 and "decoding 4 rows at a time" in lines[0], lines


@gpu_test()
def test_the_two_level_draw_on_cuda_and_in_a_cuda_graph_picks_what_the_cpu_picks():
    """The sampler's draw over a large vocabulary (two levels: a block, then an entry) on
    CUDA, eagerly and replayed from a captured graph with new uniform numbers, picks the
    tokens the CPU picks. Integer masses make every sum exact, so the picks must be equal."""
    from dapo.rollout.sampling import BLOCK, _draw

    g = torch.Generator().manual_seed(0)
    rows, vocab = 256, 3 * BLOCK + 77
    mass = torch.randint(0, 8, (rows, vocab), generator=g).float()
    mass[:, BLOCK : 2 * BLOCK] = 0  # a block of no mass, never drawn
    u1, u2 = (torch.rand(rows, dtype=torch.float64, generator=g) for _ in range(2))
    probs, u = mass.to(CUDA), u1.to(CUDA)
    assert torch.equal(_draw(probs, u).cpu(), _draw(mass, u1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _draw(probs, u)  # warm-up off the capturing stream, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drawn = _draw(probs, u)
    u.copy_(u2.to(CUDA))
    graph.replay()
    want = _draw(mass, u2)
    assert torch.equal(drawn.cpu(), want) and (mass.gather(1, want[:, None]) > 0).all()


@gpu_test()
def test_cuda_graphs_fall_back_with_one_line_for_a_sharded_policy(monkeypatch, tiny_path):
    from dapo.models import load_policy
    from dapo.rollout import HFEngine, hf_engine

    model = load_policy(str(tiny_path)).to(CUDA)
    monkeypatch.setattr(hf_engine, "is_fsdp", lambda m: True)
    lines: list[str] = []
    engine = HFEngine(model, EOS, PAD, cuda_graphs="on", log=lines.append)
    assert not engine.uses_graphs() and not engine.uses_graphs()
    assert lines == [
        "rollout.cuda_graphs: decoding without CUDA graphs: the policy is FSDP-sharded "
        "(its gathered weights move at every call)"
    ]


@gpu_test()
def test_available_cuda_memory_counts_what_the_caching_allocator_holds_unused():
    """What the engine sizes its cache by (``dapo.memory.device_memory``) on CUDA: a 1 GiB
    tensor takes 1 GiB from the available memory, and freeing it gives it back, though
    PyTorch keeps the block cached (the driver's free memory alone would not count it)."""
    from dapo.memory import device_memory

    gib, slack = 2**30, 64 * 2**20
    before = device_memory(CUDA)
    x = torch.empty(gib, dtype=torch.uint8, device=CUDA)
    during = device_memory(CUDA)
    del x
    after = device_memory(CUDA)
    assert before is not None and 0 < before.available <= before.total
    assert abs((before.available - during.available) - gib) < slack, (before, during)
    assert abs(after.available - before.available) < slack, (before, after)
    assert torch.cuda.memory_reserved(CUDA) >= gib  # cached, not returned to the driver


@gpu_test()
def test_the_default_run_on_cuda_gains_as_usual(tmp_path, tiny_path):
    """``dapo train`` with no arguments on CUDA (precision auto: bf16-mixed): the usual gain
    on the CPU is +35 to +38 points of held-out accuracy (3 seeds); the stated floor here is
    +25 points. The hf engine's log-probs are compared with the training forward's."""
    out = tmp_path / "run"
    env = {**os.environ, "DAPO_CACHE": str(tiny_path.parent)}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "dapo", "train", f"output_dir={out}", "logging.tensorboard=false"],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "precision: bf16-mixed (auto: CUDA)" in proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    mismatch = [r["rollout/logprob_mismatch"] for r in rows if "rollout/logprob_mismatch" in r]
    steps = sorted(r["perf/step_s"] for r in rows if "perf/step_s" in r)
    record(
        "default run on CUDA: held-out accuracy before, after; seconds; median step s",
        [round(before, 3), round(after, 3), round(seconds), round(steps[len(steps) // 2], 3)],
    )
    assert after - before >= 0.25, (before, after)
    assert mismatch and max(mismatch) < 0.05


# ======================================================================================
# The tier: the rollout server's weight channel and vLLM on CUDA
# ======================================================================================


@gpu_test()
def test_weights_from_a_cuda_policy_reach_a_stand_in_server_on_the_same_gpu(
    tmp_path, random_tiny_model
):
    """The trainer's side with the policy on the GPU (gathered, copied to the host and sent
    over gloo: the stand-in reports a CPU engine) and a receiver process that keeps the
    tensors on the same GPU. NCCL itself needs a second GPU (next test)."""
    push_to_stand_in(tmp_path, random_tiny_model, CUDA, "cuda:0")


@gpu_test(vllm=True, gpus=2, why_gpus=ONE_GPU_NCCL)
def test_vllm_nccl_weight_channel_between_two_gpus(tmp_path, random_tiny_model):
    """The NCCL weight channel (vLLM's ``PyNcclCommunicator``) from the policy on GPU 0 to a
    receiver process on GPU 1, as a trainer and a rollout server on their own GPUs use it."""
    push_to_stand_in(tmp_path, random_tiny_model, CUDA, "cuda:1", served_device="cuda")


@gpu_test(vllm=True)
def test_vllm_colocated_engine_sleeps_wakes_and_loads_weights(tiny_path):
    """On a GPU the colocated engine sleeps while the trainer trains: level 2 frees its KV
    cache and weights (more than 1 GiB here) and refuses to wake before new weights come; the
    weights it loads are the trainer's (bf16-mixed on both sides: mean |log-prob difference|
    below 2e-2, where the old weights would be off by nats); level 1 keeps them (the same
    greedy responses after waking, on the warmed-up model)."""
    from dapo.models import load_policy
    from dapo.rollout import SamplingParams
    from dapo.rollout.vllm_engine import VLLMEngine, VLLMEngineError

    model = set_precision(load_policy(str(tiny_path)), "bf16-mixed").to(CUDA)
    prompts = addition_prompts(16)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=32, seed=0)
    eng = VLLMEngine(model, EOS, PAD, max_model_len=256, gpu_memory_utilization=0.3)
    try:
        assert eng.sleep_enabled and eng.dtype == torch.bfloat16
        awake = [g.response_ids for g in eng.generate(prompts, greedy)]
        eng.sleep(level=1)
        eng.wake_up()
        assert [g.response_ids for g in eng.generate(prompts, greedy)] == awake
        free_awake = torch.cuda.mem_get_info()[0]
        eng.sleep(level=2)
        freed = (torch.cuda.mem_get_info()[0] - free_awake) / 2**30
        record("vLLM sleep(level=2) freed GiB", round(freed, 2))
        assert freed > 1.0
        with pytest.raises(VLLMEngineError, match="load_weights"):
            eng.wake_up()
        model.load_state_dict(build_model(99, seed=7).state_dict())  # other weights: a random model
        eng.load_weights(model.named_parameters())
        batch = engine_samples(eng.generate(prompts, SamplingParams(n=4, max_tokens=48, seed=1)))
        metrics = logprob_mismatch(
            batch, compute_logprobs(model, batch, ForwardOptions(PAD, 1.0, 8192))
        )
        record(
            "vLLM (bf16) vs trainer (bf16-mixed) after load_weights: mean |diff|",
            f"{metrics['rollout/logprob_mismatch']:.2e}",
        )
        assert metrics["rollout/logprob_mismatch"] < 2e-2
    finally:
        eng.close()


@gpu_test(vllm=True)
def test_vllm_fp8_rollouts_load_the_trainers_weights(tiny_path):
    """``rollout.vllm_quantization=fp8``: vLLM samples with FP8 weights. Its log-probs differ
    from the bf16 trainer's (rollout/mismatch_kl > 0, finite), and after ``load_weights`` of
    other weights they follow the new weights, re-quantized: the gap to the new policy is less
    than half the gap to the old one."""
    from dapo.models import load_policy
    from dapo.rollout import SamplingParams
    from dapo.rollout.vllm_engine import VLLMEngine

    model = set_precision(load_policy(str(tiny_path)), "bf16-mixed").to(CUDA)
    old = copy.deepcopy(model)
    prompts, opts = addition_prompts(16), ForwardOptions(PAD, 1.0, 8192)
    eng = VLLMEngine(
        model,
        EOS,
        PAD,
        max_model_len=256,
        gpu_memory_utilization=0.3,
        enable_sleep_mode=False,
        quantization="fp8",
    )
    try:
        batch = engine_samples(eng.generate(prompts, SamplingParams(n=4, max_tokens=48, seed=0)))
        first = logprob_mismatch(batch, compute_logprobs(model, batch, opts))
        model.load_state_dict(build_model(99, seed=7).state_dict())
        eng.load_weights(model.named_parameters())
        batch = engine_samples(eng.generate(prompts, SamplingParams(n=4, max_tokens=48, seed=1)))
        new = logprob_mismatch(batch, compute_logprobs(model, batch, opts))
        stale = logprob_mismatch(batch, compute_logprobs(old, batch, opts))
    finally:
        eng.close()
    record(
        "vLLM fp8 vs trainer bf16: mismatch_kl (warmed-up, random after load)",
        [f"{first['rollout/mismatch_kl']:.2e}", f"{new['rollout/mismatch_kl']:.2e}"],
    )
    assert 0 < first["rollout/mismatch_kl"] < float("inf")
    assert new["rollout/logprob_mismatch"] < 0.5 * stale["rollout/logprob_mismatch"]


@gpu_test(vllm=True)
@pytest.mark.parametrize("max_staleness", [0, 1], ids=["sync", "async"])
def test_vllm_server_two_steps_on_the_gpu(max_staleness, tmp_path, tiny_path):
    """``dapo vllm-serve`` on the GPU and a 2-step ``rollout.engine=vllm-server`` run, with
    and without ``rollout.max_staleness=1``: the server gets the weights at the start and after
    each step, and samples with them (float32 on both sides; mean log-prob mismatch below
    1e-2, GPU attention kernels may round in TF32). With one GPU the trainer runs on
    the CPU and the weights go over gloo (NCCL refuses two ranks on one GPU); with two, the
    trainer takes GPU 0 and the server GPU 1 (NCCL)."""
    from dapo.rollout.server import launch

    two = torch.cuda.device_count() >= 2
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1" if two else "0"}
    trainer_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0" if two else ""}
    server = launch(
        str(tiny_path),
        port,
        log=tmp_path / "server.log",
        max_model_len=256,
        env=server_env,
        timeout_s=300,
        args=["--gpu-memory-utilization", "0.3"],
    )
    try:
        out = tmp_path / "run"
        cmd = [
            sys.executable,
            "-m",
            "dapo",
            "train",
            f"model.name_or_path={tiny_path}",
            f"output_dir={out}",
            "evaluate=false",
            "logging.tensorboard=false",
            "train.steps=2",
            "rollout.engine=vllm-server",
            f"rollout.server_url={url}",
            "rollout.server_timeout_s=120",
            f"rollout.max_staleness={max_staleness}",
            "train.prompts_per_step=4",
            "train.mini_batch_size=2",
            "rollout.num_generations=4",
            "rollout.max_completion_length=32",
            "algorithm.overlong_buffer=8",
            "algorithm.dynamic_sampling=false",
        ]
        proc = subprocess.run(cmd, env=trainer_env, capture_output=True, text=True, timeout=420)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        health = wait_for_health(url, server, tmp_path / "server.log")
    finally:
        server.terminate()
        server.wait(60)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "actor/loss" in r]
    assert len(steps) == 2 and health["weight_version"] == 3  # at the start, after each step
    assert [r["rollout/staleness"] for r in steps] == ([0.0, 1.0] if max_staleness else [0.0, 0.0])
    mismatch = [r["rollout/logprob_mismatch"] for r in steps if "rollout/logprob_mismatch" in r]
    record(f"vllm-server (GPU) run, max_staleness={max_staleness}: mismatch per step", mismatch)
    assert mismatch and max(mismatch) < 1e-2


@gpu_test()
def test_packed_forward_goes_through_varlen_attn_and_agrees_with_the_unpacked_one(monkeypatch):
    """bf16-mixed on CUDA: a packed micro-batch attends through one ``varlen_attn`` call per
    layer; its log-probs agree with the unpacked forward's and with the per-segment loop's
    within bf16 rounding (stated bound: largest difference < 5e-2; fp32 on CPU: 1e-5), and
    packing without the per-sequence attention does not (> 0.1)."""
    import dataclasses

    from dapo.models import packing
    from dapo.training.forward import response_states, token_logprobs
    from dapo.training.microbatch import collate
    from dapo.training.packed import pack, packed_states

    model = set_precision(build_model(99, seed=3).to(CUDA).eval(), "bf16-mixed")
    packing.install(model)
    calls = []
    real = packing._varlen_attention
    monkeypatch.setattr(packing, "_varlen_attention", lambda *a: calls.append(1) or real(*a))
    batch = collate(samples(seed=2), PAD).to(CUDA)

    def logprobs(packed: bool) -> torch.Tensor:
        with torch.no_grad():
            states = response_states(model, batch, packed=packed)
            return token_logprobs(model, states, batch, temperature=1.0)[0]

    unpacked, packed = logprobs(False), logprobs(True)
    layers = model.config.num_hidden_layers
    assert len(calls) == layers
    gap = float((packed - unpacked).abs().max())
    record("packed vs unpacked log-probs, largest difference (CUDA, bf16-mixed)", gap)
    assert gap < 5e-2
    row = pack(batch)
    with torch.no_grad():
        fast = packed_states(model, row).float()
        monkeypatch.setattr(packing, "_varlen", lambda: None)  # the per-segment loop
        loop = packed_states(model, row).float()
        mixed = packed_states(
            model, dataclasses.replace(row, layout=packing.whole_row(row.input_ids.shape[1]))
        ).float()
    assert float((fast - loop).abs().max()) < 5e-2
    assert float((mixed - loop).abs().max()) > 0.1


@gpu_test()
def test_packed_update_speed_on_cuda():
    """``benchmarks/bench_packing.py`` on CUDA in bf16-mixed: padded, bucketed and packed
    updates of a long-tailed step (figures recorded; the sides' log-probs agree within bf16
    rounding)."""
    from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

    bench = import_benchmark("bench_packing")
    out = Path(os.environ.get("TMPDIR", "/tmp")) / "dapo-gpu-packing.json"
    report = bench.main(["--precision", "bf16-mixed", "--repeats", "3", "--json", str(out)])
    record(
        "bench_packing on CUDA: packed over padded, over bucketed",
        [round(report["speedup"], 3), round(report["speedup_vs_bucketed"], 3)],
    )
    record(
        "bench_packing on CUDA: median update s (padded, bucketed, packed)",
        [round(report["median_s"][k], 4) for k in ("padded", "bucketed", "packed")],
    )
    assert report["logprob_gap"] < 5e-2


@gpu_test(vllm=True)
def test_a_vision_language_model_trains_with_vllm_on_cuda(tmp_path):
    """``dapo train examples/vision.yaml rollout.engine=vllm`` for 2 steps on the GPU: vLLM
    is given the images, expands them as dapo does (it raises otherwise), receives the
    weights after each update, and samples with the trainer's log-probs (mean mismatch below
    1e-2: GPU attention kernels may round in TF32; the CPU tests, with the negative control:
    ``tests/test_vllm_vision.py``)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dapo", "train", "examples/vision.yaml", "rollout.engine=vllm"]
    cmd += [f"output_dir={out}", "logging.tensorboard=false", "evaluate=false"]
    cmd += ["train.steps=2", "train.prompts_per_step=4", "rollout.num_generations=4"]
    cmd += ["algorithm.dynamic_sampling=false", "train.precision=fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "rollout/logprob_mismatch" in r]
    mismatch = [r["rollout/logprob_mismatch"] for r in steps]
    record("vision-language model with vLLM (GPU): mismatch per step", mismatch)
    assert len(steps) == 2 and all("perf/weight_sync_s" in r for r in steps)
    assert max(mismatch) < 1e-2
