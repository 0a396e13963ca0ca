"""A vision-language policy through the vLLM engine (an optional extra; skipped, with the
reason, where ``vllm`` does not import).

vLLM is given each prompt's unexpanded tokens and its images and expands them itself; the
checks: the prompt it ran equals dapo's expansion, its sampling log-probs equal the training
forward's (1e-5, fp32) while the same forward without the pixels does not, every part of
the model (text model, connector, vision tower) reaches the engine under its own names in a
weight sync, prompts vLLM cannot be given are refused with the reason, and a short run with
``rollout.engine=vllm`` on ``builtin:tiny-vlm`` trains with the engine and the trainer in
agreement.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from ranks import forked, forked_popen  # tests/ranks.py
from vllm_check import needs_vllm  # tests/vllm_check.py

from dapo.data.images import ImagePrompt, ImageText, encode_with_images, render_with_images
from dapo.data.tasks import colour_count
from dapo.data.tasks.calculator import CHAT_TEMPLATE
from dapo.environments import ChatRenderer
from dapo.models.vision import pixel_cache
from dapo.rollout.base import SamplingParams
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs

tiny_vlm = pytest.importorskip("dapo.models.tiny_vlm")
pytestmark = [needs_vllm, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def setup():
    """A random tiny Idefics3 model (any weights must agree), its processor, and a vLLM
    engine built from the module."""
    from dapo.rollout.vllm_engine import VLLMEngine

    processor = tiny_vlm.build_processor()
    model = tiny_vlm.build_model(processor, seed=3).float().eval()
    tok = processor.tokenizer
    engine = VLLMEngine(model, tok.eos_token_id, max_model_len=256, processor=processor)
    yield model, processor, engine
    engine.close()


def _prompts(processor, n: int) -> list[ImagePrompt]:
    records = colour_count.colour_count_records("test", n=n)
    texts = [render_with_images(r.prompt, processor) for r in records]
    return encode_with_images(texts, [r.images for r in records], processor, pixel_cache(processor))


def _gap(a, b) -> float:
    return max(
        (torch.as_tensor(x) - torch.as_tensor(y)).abs().max().item()
        for x, y in zip(a, b, strict=True)
    )


def _scores(model, processor, engine, prompts: list[ImagePrompt], response: list[int]):
    """The response's log-probs after each prompt: the engine's (scoring the whole
    sequence) and the training forward's."""
    engine_lp = [
        s[len(p) - 1 :]
        for s, p in zip(engine.score([p + response for p in prompts]), prompts, strict=True)
    ]
    samples = [Sample(p, response, 0.0, [1.0] * len(response)) for p in prompts]
    opts = ForwardOptions(processor.tokenizer.pad_token_id)
    return engine_lp, compute_logprobs(model, samples, opts)


def test_sampling_log_probs_equal_the_training_forward_and_a_dropped_image_fails(setup):
    model, processor, engine = setup
    prompts = _prompts(processor, 4)
    assert all(p.raw is not None and len(p.raw) < len(p) for p in prompts)  # unexpanded
    groups = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5))
    for g, p in zip(groups, prompts, strict=True):
        assert isinstance(g.prompt_ids, ImagePrompt) and g.prompt_ids.images == p.images
        assert list(g.prompt_ids) == list(p)  # vLLM's expansion is dapo's (checked inside too)
    samples = [Sample(g.prompt_ids, r, 0.0, [1.0] * len(r)) for g in groups for r in g.response_ids]
    engine_lp = [lp for g in groups for lp in g.logprobs]
    opts = ForwardOptions(processor.tokenizer.pad_token_id)
    assert _gap(compute_logprobs(model, samples, opts), engine_lp) < 1e-5
    # Negative control: the same tokens without the pixels must not pass.
    dropped = [Sample(list(s.prompt_ids), s.response_ids, 0.0, s.loss_mask) for s in samples]
    assert _gap(compute_logprobs(model, dropped, opts), engine_lp) > 1e-2


@pytest.mark.parametrize("part", ["model.text_model", "model.connector", "model.vision_model"])
def test_a_weight_sync_reaches_every_part_of_the_model(setup, part):
    """Each part changed alone must change the engine's log-probs, and after a sync agree:
    a name that vLLM does not map would leave the engine on the old weights."""
    model, processor, engine = setup
    prompts, response = _prompts(processor, 2), [5, 6, 7, 8]
    assert _gap(*_scores(model, processor, engine, prompts, response)) < 1e-5
    g = torch.Generator().manual_seed(len(part))
    with torch.no_grad():
        changed = 0
        for name, p in model.named_parameters():
            if name.startswith(part):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
                changed += 1
    assert changed > 0
    stale = _gap(*_scores(model, processor, engine, prompts, response))
    assert stale > 1e-3, f"precondition: changing {part} must change the log-probs ({stale})"
    engine.load_weights(model.named_parameters())
    assert _gap(*_scores(model, processor, engine, prompts, response)) < 1e-5


def test_an_image_in_a_later_turn_reaches_the_engine_and_the_trainer(setup):
    """Two turns: the environment answers the first with an image; vLLM samples the second
    from the whole sequence, and the training forward, given both images, agrees with it."""
    model, processor, engine = setup
    tok = processor.tokenizer
    tok.chat_template = CHAT_TEMPLATE  # "U: ...", "A: ..." turns
    renderer = ChatRenderer(tok, None, ImageText(processor, pixel_cache(processor)))
    record = colour_count.colour_count_records("test", n=1)[0]
    opening = renderer.opening([{"role": "user", "content": record.prompt}], record.images)
    grid = colour_count.draw(["green"] * colour_count.GRID**2)
    parts = [{"type": "image", "image": grid}, {"type": "text", "text": "Again?"}]
    prefix = [*tok("2", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    prefix = prefix + renderer.reply([{"role": "user", "content": parts}])
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=4)
    (later,) = engine.generate([opening + prefix], params)
    assert len(later.prompt_ids.images) == 2
    samples = [
        Sample(opening, prefix + r, 0.0, [1.0] * (len(prefix) + len(r)), model_mask=None)
        for r in later.response_ids
    ]
    for sample, r in zip(samples, later.response_ids, strict=True):
        sample.model_mask = [0] * len(prefix) + [1] * len(r)
    opts = ForwardOptions(tok.pad_token_id)
    trainer = [lp[len(prefix) :] for lp in compute_logprobs(model, samples, opts)]
    assert _gap(trainer, later.logprobs) < 1e-5
    # Negative control: the later image left out of the training forward must not pass.
    for sample in samples:
        sample.response_ids = list(sample.response_ids)
    dropped = [lp[len(prefix) :] for lp in compute_logprobs(model, samples, opts)]
    assert _gap(dropped, later.logprobs) > 1e-2


def test_prompts_vllm_cannot_be_given_are_refused_with_the_reason(setup):
    model, processor, engine = setup
    p = _prompts(processor, 1)[0]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=4, seed=0)
    no_raw = ImagePrompt(list(p), p.images, p.pixels, p.digest, p.spans)
    with pytest.raises(ValueError, match="no unexpanded form"):
        engine.generate([no_raw], params)
    # The image placeholder sampled as text, then another image: vLLM would put the image
    # where the sampled token stands.
    turn = [*p[:3], model.config.image_token_id] + p
    with pytest.raises(ValueError, match="sampled the placeholder as text"):
        engine.generate([turn], params)


def _run(out: Path, *overrides: str, in_step: bool = True, ranks: int = 1) -> list[dict]:
    """Two steps of examples/vision.yaml (builtin:tiny-vlm) with ``overrides``; the metrics
    of its steps, checked: the engine is kept in sync, and (``in_step``) sampled the tokens
    with the trainer's log-probs."""
    cmd = [
        "-m",
        "dapo",
        "train",
        "examples/vision.yaml",
        f"output_dir={out}",
        "evaluate=false",
        "train.steps=2",
        "train.prompts_per_step=4",
        "rollout.num_generations=4",
        "algorithm.dynamic_sampling=false",
        "train.precision=fp32",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = forked(cmd, Path(__file__).parents[1], env, timeout=600, vllm=True, ranks=ranks)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "rollout/logprob_mismatch" in r]
    assert len(steps) == 2
    assert all("perf/weight_sync_s" in r for r in steps)  # a separate engine, kept in sync
    assert steps[0]["actor/grad_norm"] > 0  # step 2 sampled from updated, pushed weights
    mismatch = [r["rollout/logprob_mismatch"] for r in steps]
    assert max(mismatch) < 1e-5 or not in_step, mismatch
    return steps


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_run_with_the_vllm_engine_trains_in_agreement_with_it(tmp_path, ranks):
    """In one process, and on 2 ranks each with its own engine (started from placeholder
    weights and the processor, then given the full weights)."""
    _run(tmp_path / "run", "rollout.engine=vllm", "train.mini_batch_size=2", ranks=ranks)


def test_a_streaming_run_with_the_vllm_engine_samples_one_version_behind(tmp_path):
    """``rollout.max_staleness=1``: the second batch is sampled while the first trains, so
    from the weights before that update. Its first batch agrees with the trainer exactly;
    the second was sampled by the previous version, which the decoupled correction weighs
    (its behaviour weights average ~1)."""
    steps = _run(tmp_path / "run", "rollout.engine=vllm", "rollout.max_staleness=1", in_step=False)
    assert steps[0]["rollout/logprob_mismatch"] < 1e-5
    assert [r["stream/staleness_max"] for r in steps] == [0.0, 1.0]
    assert all(abs(r["rollout/is_weight_mean"] - 1) < 0.05 for r in steps)


def test_a_run_against_a_rollout_server_of_the_vision_model(tmp_path):
    """``dapo vllm-serve builtin:tiny-vlm``: the images travel with the prompts, the weights
    (connector and language model change) are pushed after every update, and the server's
    cached image features are dropped with the old weights."""
    from dapo.rollout.server import launch
    from dapo.rollout.weight_channel import free_port

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    server = launch(
        "builtin:tiny-vlm", port, log=tmp_path / "server.log", max_model_len=128, env=env,
        timeout_s=300, popen=forked_popen,
    )  # fmt: skip
    try:
        url = f"rollout.server_url=http://127.0.0.1:{port}"
        _run(tmp_path / "run", "rollout.engine=vllm-server", url, "rollout.server_timeout_s=60")
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_dapo_eval_of_the_vision_model_with_vllm_scores_like_hf(tmp_path):
    """``dapo eval builtin:tiny-vlm --engine vllm`` (greedy) answers the held-out visual
    problems as the transformers engine does."""
    from dapo.cli import main

    reports = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / f"{engine}.json"
        args = ["eval", "builtin:tiny-vlm", "--data", "builtin:colour_count", "--engine", engine]
        args += ["--max-problems", "40", "--temperature", "0", "--k", "1", "--max-tokens", "16"]
        assert main([*args, "--output", str(out)]) == 0
        reports[engine] = json.loads(out.read_text())
    hf, vl = reports["hf"]["overall"], reports["vllm"]["overall"]
    assert reports["hf"]["problems"] == reports["vllm"]["problems"] == 40
    assert 0.1 < hf["avg@1"] < 1.0  # the warmed-up model: some right, some wrong
    assert vl["avg@1"] == hf["avg@1"]
    assert reports["vllm"]["mean_response_length"] == reports["hf"]["mean_response_length"]
