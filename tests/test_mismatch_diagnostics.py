"""Engine-vs-trainer mismatch: ``algorithm.is_level=geometric``, ``rollout/mismatch_kl`` and
``rollout.vllm_quantization``, checked against values computed by hand."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch
from learner_utils import learner

from dapo import algorithms as alg
from dapo.algorithms import LossSettings
from dapo.config import ConfigError, TrainConfig, load_config
from dapo.models.tiny import build_model
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs
from dapo.training.token_weights import attach_is_weights, logprob_mismatch

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


def logs(*probs: float) -> torch.Tensor:
    return torch.log(torch.tensor([probs], dtype=F64))


# --- is_level=geometric ----------------------------------------------------------------------


def test_geometric_level_by_hand():
    """Token ratios 2 and 8 (and 100 on a token outside the mask): the geometric mean is
    sqrt(2 * 8) = 4 on both tokens (the product would be 16); masked tokens neither count nor
    get a weight."""
    old = logs(0.4, 0.8, 1.0)
    engine = logs(0.2, 0.1, 0.01)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    cases = {  # cap, mode -> weights, keep, over
        (3.0, "truncate"): ([3, 3, 0], [1, 1, 0], [1, 1, 0]),
        (3.0, "mask"): ([0, 0, 0], [0, 0, 0], [1, 1, 0]),
        (5.0, "truncate"): ([4, 4, 0], [1, 1, 0], [0, 0, 0]),
        (5.0, "mask"): ([4, 4, 0], [1, 1, 0], [0, 0, 0]),
    }
    for (cap, mode), expected in cases.items():
        got = alg.is_weights(old, engine, mask, cap=cap, level="geometric", mode=mode)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, torch.tensor([e], dtype=F64), atol=1e-12, rtol=1e-12)
    w, _, _ = alg.is_weights(old, engine, mask, cap=100.0, level="sequence", mode="truncate")
    torch.testing.assert_close(w, torch.tensor([[16.0, 16.0, 0.0]], dtype=F64))
    # A row without a response token: ratio 1, weight 0 (nothing to weigh), nothing dropped.
    w, keep, over = alg.is_weights(
        old, engine, torch.zeros(1, 3, dtype=F64), cap=2.0, level="geometric", mode="mask"
    )
    assert not w.any() and not keep.any() and not over.any()


def test_geometric_level_matches_a_transcription():
    """rho_i = exp(mean of log rho over the tokens where mask is 1), for random rows."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 9, generator=g, dtype=F64) * 3
    shift = torch.tensor([[0.2], [-0.2], [0.1], [-0.1], [0.0], [0.3]], dtype=F64)  # some rows cross
    engine = old - shift + 0.3 * torch.randn(6, 9, generator=g, dtype=F64)
    mask = (torch.rand(6, 9, generator=g) > 0.3).to(F64)
    w, keep, _ = alg.is_weights(old, engine, mask, cap=1.2, level="geometric", mode="mask")
    for i in range(6):
        tokens = [t for t in range(9) if mask[i, t]]
        gaps = [float(old[i, t] - engine[i, t]) for t in tokens]
        rho = math.exp(sum(gaps) / len(gaps)) if gaps else 1.0
        for t in range(9):
            kept = bool(mask[i, t]) and rho <= 1.2
            assert keep[i, t] == float(kept)
            assert math.isclose(float(w[i, t]), rho if kept else 0.0, rel_tol=1e-12)
    assert 0 < keep.sum() < mask.sum()  # the data crosses the cap, not everywhere


def test_the_geometric_ratio_does_not_grow_with_the_length():
    """The same gap per token (0.01 nats) over 10 and 1000 tokens: the product is e^0.1 and
    e^10, so a sequence-level cap of 2 drops the long response; the geometric mean is e^0.01
    for both and keeps them."""
    for n in (10, 1000):
        old = torch.full((1, n), -1.0, dtype=F64)
        engine, mask = old - 0.01, torch.ones(1, n, dtype=F64)
        _, keep_seq, _ = alg.is_weights(old, engine, mask, cap=2.0, level="sequence", mode="mask")
        w, keep_geo, _ = alg.is_weights(old, engine, mask, cap=2.0, level="geometric", mode="mask")
        assert bool(keep_seq.all()) == (n == 10)
        assert keep_geo.all() and math.isclose(float(w[0, 0]), math.exp(0.01), rel_tol=1e-12)


def test_geometric_weights_of_a_multi_turn_sample_skip_the_environments_tokens():
    """Model tokens with ratios 2 and 4 around an environment token (ratio 1/9): the geometric
    mean over the model's tokens is sqrt(8); the environment token gets no weight. With cap 2.5
    the response is truncated: is_weight_mean 2.5, is_truncated_frac 1 (one response of one)."""
    s = Sample([5, 6], [7, 8, 9], 1.0, [1.0, 0.0, 1.0], model_mask=[1, 0, 1])
    s.old_logprobs = torch.log(torch.tensor([0.5, 0.1, 0.8]))
    s.sampling_logprobs = torch.log(torch.tensor([0.25, 0.9, 0.2]))
    metrics = attach_is_weights([s], LossSettings(is_cap=3.0, is_level="geometric"))
    torch.testing.assert_close(s.is_weight, torch.tensor([8**0.5, 0.0, 8**0.5]))
    assert math.isclose(metrics["rollout/is_weight_mean"], 8**0.5, rel_tol=1e-6)
    assert metrics["rollout/is_truncated_frac"] == 0.0
    metrics = attach_is_weights([s], LossSettings(is_cap=2.5, is_level="geometric"))
    torch.testing.assert_close(s.is_weight, torch.tensor([2.5, 0.0, 2.5]))
    assert metrics == {
        "rollout/is_weight_mean": pytest.approx(2.5),
        "rollout/is_truncated_frac": 1.0,
    }


def test_is_level_geometric_is_a_config_choice():
    cfg = load_config(
        overrides=["algorithm.is_cap=2.0", "algorithm.is_level=geometric", "algorithm.is_mode=mask"]
    )
    assert cfg.algorithm.is_level == "geometric"
    with pytest.raises(ConfigError, match=r"is not one of \['token', 'sequence', 'geometric'\]"):
        load_config(overrides=["algorithm.is_level=geo"])


# --- rollout/mismatch_kl ---------------------------------------------------------------------


def test_mismatch_kl_by_hand_over_the_models_tokens():
    """Engine 0.5 / trainer 0.25 (r = 0.5: k3 = 0.5 - 1 + ln 2) and engine 0.2 / trainer 0.4
    (r = 2: k3 = 2 - 1 - ln 2) average to 0.25; |log gap| is ln 2 on both. The environment's
    token between them (far apart) counts in neither."""
    s = Sample([5], [7, 8, 9], 1.0, [1.0, 0.0, 1.0], model_mask=[1, 0, 1])
    s.sampling_logprobs = torch.log(torch.tensor([0.5, 0.9, 0.2]))
    trainer = torch.log(torch.tensor([0.25, 0.001, 0.4]))
    plain = Sample([5], [7], 1.0, [1.0])  # no engine log-probs: not compared
    m = logprob_mismatch([s, plain], [trainer, torch.zeros(1)])
    assert m["rollout/mismatch_kl"] == pytest.approx(0.25, abs=1e-6)
    assert m["rollout/logprob_mismatch"] == pytest.approx(math.log(2), abs=1e-6)
    assert logprob_mismatch([plain], [torch.zeros(1)]) == {}


def test_mismatch_kl_estimates_kl_of_the_engine_from_the_trainer():
    """Tokens sampled from the engine's distribution p_e: the mean k3 is KL(p_e || p_t), not
    the reverse (here 0.368 against 0.511), within 4 standard errors."""
    p_e = torch.tensor([0.9, 0.1], dtype=F64)
    p_t = torch.tensor([0.5, 0.5], dtype=F64)
    forward = float((p_e * (p_e / p_t).log()).sum())
    reverse = float((p_t * (p_t / p_e).log()).sum())
    tokens = torch.multinomial(
        p_e, 40000, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    s = Sample([1], tokens.tolist(), 0.0, [1.0] * len(tokens), sampling_logprobs=p_e.log()[tokens])
    m = logprob_mismatch([s], [p_t.log()[tokens]])
    r = (p_t / p_e)[tokens]
    k3 = r - 1 - r.log()
    assert m["rollout/mismatch_kl"] == pytest.approx(float(k3.mean()), rel=1e-9)
    se = float(k3.std()) / len(tokens) ** 0.5
    assert forward == pytest.approx(0.368, abs=1e-3) and reverse == pytest.approx(0.511, abs=1e-3)
    assert (
        abs(m["rollout/mismatch_kl"] - forward) < 4 * se < abs(m["rollout/mismatch_kl"] - reverse)
    )


@pytest.mark.parametrize("mini_batch_size", [4, 2], ids=["one_update", "two_updates"])
def test_the_learner_reports_mismatch_kl_beside_the_mismatch(mini_batch_size):
    """Both places the learner compares the engine (the training forward itself with one
    update per step, the old-log-prob pass with two) log both metrics, equal to the formula
    on the trainer's log-probs."""
    rng = random.Random(0)
    model = build_model(99, seed=1).train()
    samples = []
    for _ in range(4):
        prompt = [rng.randrange(3, 99) for _ in range(5)]
        for _ in range(2):
            resp = [rng.randrange(3, 99) for _ in range(rng.randrange(3, 9))]
            samples.append(Sample(prompt, resp, rng.choice([-1.0, 1.0]), [1.0] * len(resp)))
    trainer = compute_logprobs(model, samples, ForwardOptions(0, 1.0, 400))
    gaps, k3 = [], []
    for s, lp in zip(samples, trainer, strict=True):
        s.sampling_logprobs = lp + 0.1 * torch.randn(
            lp.shape, generator=torch.Generator().manual_seed(len(gaps))
        )
        d = (lp - s.sampling_logprobs).double()
        gaps += d.abs().tolist()
        k3 += (d.exp() - 1 - d).tolist()
    lrn = learner(model, LossSettings(), token_budget=400)
    lrn.train = TrainConfig(prompts_per_step=4, mini_batch_size=mini_batch_size, max_grad_norm=0.0)
    lrn.compare_engine = True
    metrics = lrn.update(samples, step=0, group_size=2)
    assert metrics["rollout/logprob_mismatch"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-4)
    assert metrics["rollout/mismatch_kl"] == pytest.approx(sum(k3) / len(k3), rel=1e-3)


# --- rollout.vllm_quantization ---------------------------------------------------------------


def test_fp8_rollouts_warn_without_is_cap_and_not_with_it():
    with pytest.warns(UserWarning, match=r"rollout.vllm_quantization=fp8: .*set algorithm.is_cap"):
        cfg = load_config(overrides=["rollout.engine=vllm", "rollout.vllm_quantization=fp8"])
    assert cfg.rollout.vllm_quantization == "fp8"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(
            overrides=[
                "rollout.engine=vllm",
                "rollout.vllm_quantization=fp8",
                "algorithm.is_cap=2.0",
            ]
        )
        assert load_config().rollout.vllm_quantization == "none"


@pytest.mark.parametrize(
    ("engine", "fix"),
    [
        ("hf", "use rollout.engine=vllm, or none"),
        ("vllm-server", "dapo vllm-serve MODEL --quantization fp8"),
    ],
)
def test_fp8_rollouts_need_the_in_process_vllm_engine(engine, fix):
    extra = ["rollout.server_url=http://127.0.0.1:8000"] if engine == "vllm-server" else []
    with pytest.raises(ConfigError) as info:
        load_config(
            overrides=[
                f"rollout.engine={engine}",
                "rollout.vllm_quantization=fp8",
                "algorithm.is_cap=2.0",
                *extra,
            ]
        )
    msg = str(info.value)
    assert msg.startswith("`rollout.vllm_quantization` = 'fp8' is invalid:") and fix in msg
    with pytest.raises(ConfigError, match=r"is not one of \['none', 'fp8'\]"):
        load_config(overrides=["rollout.vllm_quantization=int4"])


def test_fp8_reaches_vllm_through_the_factory_and_the_server(monkeypatch, random_tiny_model):
    from dapo import cli
    from dapo.models import load_tokenizer
    from dapo.rollout import factory, server, vllm_engine

    built: list[dict] = []

    class Stop(Exception):
        pass

    def fake_engine(*args, **kwargs):
        built.append(kwargs)
        raise Stop

    monkeypatch.setattr(vllm_engine, "VLLMEngine", fake_engine)
    tok = load_tokenizer(str(random_tiny_model))
    for setting, expected in (("fp8", "fp8"), ("none", None)):
        cfg = load_config(
            overrides=[
                "rollout.engine=vllm",
                f"rollout.vllm_quantization={setting}",
                "algorithm.is_cap=2.0",
            ]
        )
        with pytest.raises(Stop):
            factory.make_engine(cfg.rollout, build_model(99), tok, max_model_len=64)
        assert built[-1]["quantization"] == expected
    # dapo vllm-serve --quantization fp8 -> serve(...) -> VLLMEngine(quantization="fp8")
    calls: list[dict] = []
    monkeypatch.setattr(server, "serve", lambda model, **kw: calls.append(kw) or 0)
    assert cli.main(["vllm-serve", str(random_tiny_model), "--quantization", "fp8"]) == 0
    assert calls[-1]["quantization"] == "fp8"
    assert (
        cli.main(["vllm-serve", str(random_tiny_model)]) == 0 and calls[-1]["quantization"] is None
    )
    with pytest.raises(SystemExit):
        cli.main(["vllm-serve", str(random_tiny_model), "--quantization", "int4"])
    monkeypatch.undo()
    monkeypatch.setattr(vllm_engine, "VLLMEngine", fake_engine)
    from dapo.rollout.weight_channel import free_port

    with pytest.raises(Stop):
        server.serve(
            str(random_tiny_model), port=free_port(), quantization="fp8", log_fn=lambda _: None
        )
    assert built[-1]["quantization"] == "fp8"


def test_the_vllm_engine_passes_the_quantization_to_vllm(monkeypatch):
    from vllm_check import VLLM_ERROR

    if VLLM_ERROR is not None:
        pytest.skip(f"vllm does not import: {VLLM_ERROR[:200]}")
    import vllm

    from dapo.rollout.vllm_engine import VLLMEngine

    seen: list[dict] = []

    class Stop(Exception):
        pass

    def fake_llm(**kwargs):
        seen.append(kwargs)
        raise Stop

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    for quantization in ("fp8", None):
        with pytest.raises(Stop):
            VLLMEngine(build_model(99), 1, 0, max_model_len=64, quantization=quantization)
    assert seen[0]["quantization"] == "fp8" and "quantization" not in seen[1]
