"""Images in multi-turn episodes: what environments and tools may return, the renderer's
image tokens, and the engine's later-turn prefill against the training forward for both
families (with negative controls: the later image left out of the training forward must
fail, and an image token the model sampled must stay text), then whole runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dapo.data.images import ImagePrompt, ImageText, copy_prompt, images_of, prompt_key
from dapo.data.tasks import colour_count
from dapo.data.tasks.calculator import CHAT_TEMPLATE
from dapo.environments import ChatRenderer, EnvironmentPool, RenderError, load_environment
from dapo.environments.base import MalformedOutput, check_messages
from dapo.environments.tools import ToolCall, call_tool
from dapo.models.vision import image_token_id, pixel_cache, token_inputs
from dapo.rollout.base import Group, SamplingParams
from dapo.rollout.episodes import run_episodes
from dapo.rollout.hf_engine import HFEngine
from dapo.rollout.vllm_images import refusal
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs

tiny_vlm = pytest.importorskip("dapo.models.tiny_vlm")
from vision_fixtures import tiny_qwen2_vl  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ENVS = Path(__file__).with_name("sample_environments.py")


def _grid(colour: str):
    return colour_count.draw([colour] * colour_count.GRID**2)


def _renderer(processor) -> ChatRenderer:
    processor.tokenizer.chat_template = CHAT_TEMPLATE  # "U: ...", "A: ..." turns
    return ChatRenderer(processor.tokenizer, None, ImageText(processor, pixel_cache(processor)))


@pytest.fixture(scope="module", params=["idefics3", "qwen2_vl"])
def family(request):
    """A random model of each family (the checks must hold for any weights) and its
    renderer."""
    if request.param == "idefics3":
        processor = tiny_vlm.build_processor()
        model = tiny_vlm.build_model(processor, seed=3).eval()
    else:
        model, processor = tiny_qwen2_vl()
    return model, processor, _renderer(processor)


@pytest.fixture(scope="module")
def warmed():
    """The warmed-up builtin:tiny-vlm (it ends its turns), with a chat template."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_vlm.ensure_builtin_vlm()
    processor = AutoProcessor.from_pretrained(path)
    return AutoModelForImageTextToText.from_pretrained(path).eval(), processor


def _gap(trainer, engine, samples) -> float:
    """The largest log-prob gap over the tokens the model sampled."""
    return max(
        ((a - b).abs() * torch.tensor(s.model_mask, dtype=torch.float32)).max().item()
        for a, b, s in zip(trainer, engine, samples, strict=True)
    )


# --- what environments and tools return ---------------------------------------------------


def test_messages_may_hold_image_parts_and_tools_may_return_images():
    image = _grid("red")
    parts = [{"type": "image", "image": image}, {"type": "text", "text": "Look."}]
    (m,) = check_messages([{"role": "tool", "name": "look", "content": parts}], "step")
    assert m["content"] == parts and m["name"] == "look"
    for bad in ([{"type": "image", "image": 3}], [{"type": "video"}], [], [{"text": "x"}]):
        with pytest.raises(MalformedOutput, match="list of parts"):
            check_messages([{"role": "user", "content": bad}], "step")

    def look(colour: str):
        return _grid(colour)

    def both(colour: str):
        return [{"type": "text", "text": colour}, {"type": "image", "image": _grid(colour)}]

    reply, error, _ = call_tool({"look": look}, ToolCall("look", {"colour": "blue"}))
    assert error is None and reply[0]["type"] == "image" and reply[0]["image"].size == (32, 32)
    reply, _, _ = call_tool({"both": both}, ToolCall("both", {"colour": "red"}))
    assert [p["type"] for p in reply] == ["text", "image"]


def test_the_renderer_expands_an_observation_image_into_its_tokens():
    processor = tiny_vlm.build_processor()
    renderer = _renderer(processor)
    token = processor.image_token_id
    parts = [{"type": "image", "image": _grid("red")}, {"type": "text", "text": "Again?"}]
    reply = renderer.reply([{"role": "user", "content": parts}])
    assert isinstance(reply, ImagePrompt) and len(reply.images) == 1
    ((a, b),) = reply.spans
    assert b - a == tiny_vlm.IMAGE_TOKENS and set(reply[a:b]) == {token}
    assert token not in reply[:a] + reply[b:]
    assert "Again?" in processor.tokenizer.decode(reply[b:])
    text = renderer.reply([{"role": "user", "content": [{"type": "text", "text": "ok"}]}])
    assert type(text) is list and text == renderer.reply([{"role": "user", "content": "ok"}])
    # A record's image fills its prompt's placeholder in the opening.
    record = colour_count.colour_count_records("test", n=1)[0]
    opening = renderer.opening([{"role": "user", "content": record.prompt}], record.images)
    assert opening.images == tuple(record.images) and len(opening.spans) == 1
    with pytest.raises(RenderError, match="text model"):
        ChatRenderer(processor.tokenizer).reply([{"role": "user", "content": parts}])
    with pytest.raises(RenderError, match="without its image"):
        renderer.reply([{"role": "user", "content": [{"type": "image"}]}])


def test_a_template_that_reads_only_parts_gets_every_message_as_parts():
    processor = tiny_vlm.build_processor()
    processor.tokenizer.chat_template = (  # SmolVLM's way: a string content shows nothing
        "{% for m in messages %}{{ m['role'] + ': ' }}{% for p in m['content'] %}"
        "{% if p['type'] == 'text' %}{{ p['text'] }}{% elif p['type'] == 'image' %}"
        "{{ '<image>' }}{% endif %}{% endfor %}{{ eos_token if m['role'] == 'assistant' }}"
        "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    renderer = ChatRenderer(processor.tokenizer, None, ImageText(processor, pixel_cache(processor)))
    assert renderer.parts
    parts = [{"type": "text", "text": "See "}, {"type": "image", "image": _grid("blue")}]
    reply = renderer.reply([{"role": "user", "content": parts}])
    text = processor.tokenizer.decode(reply)
    assert text.startswith("\nuser: See <fake_token_around_image>") and len(reply.spans) == 1
    assert text.endswith("assistant: ")


def test_joined_sequences_keep_their_images_and_a_sampled_image_token_is_text():
    processor = tiny_vlm.build_processor()
    renderer = _renderer(processor)
    token = processor.image_token_id
    opening = renderer.opening([{"role": "user", "content": "<image>Count."}], [_grid("red")])
    reply = renderer.reply(
        [{"role": "user", "content": [{"type": "image", "image": _grid("blue")}]}]
    )
    sampled = [5, token, processor.tokenizer.eos_token_id]  # an image token the model wrote
    whole = opening + (sampled + reply) + [7]
    assert list(whole) == [*opening, *sampled, *reply, 7]
    assert [i.getpixel((0, 0)) for i in whole.images] == [(220, 30, 30), (30, 30, 220)]
    shift = len(opening) + len(sampled)
    assert whole.spans == (*opening.spans, *((a + shift, b + shift) for a, b in reply.spans))
    assert len(opening) + 1 not in {i for a, b in whole.spans for i in range(a, b)}
    assert prompt_key(whole) != prompt_key(list(whole)) and images_of(list(whole)) == ()
    assert whole.__reduce__()[1][4] == whole.spans  # pickled with its spans
    # The unexpanded form (one placeholder per image, what vLLM expands) follows the joins.
    assert opening.raw.count(token) == reply.raw.count(token) == 1
    assert list(whole.raw) == [*opening.raw, *sampled, *reply.raw, 7]
    assert whole.__reduce__()[1][5] == whole.raw


# --- the engine's later-turn prefill and the training forward -----------------------------


def _episode(model, processor, renderer, n=3):
    """A hand-made two-turn episode (the first turn holds an image token the model sampled,
    as text; the environment answers it with an image), the second turn sampled by the
    engine from the whole sequence; samples with the engine's log-probs on that turn, and
    one single-turn sample of the same prompt beside them."""
    tok = processor.tokenizer
    record = colour_count.colour_count_records("test", n=1)[0]
    opening = renderer.opening([{"role": "user", "content": record.prompt}], record.images)
    turn = [*tok("2", add_special_tokens=False)["input_ids"], image_token_id(model)]
    turn.append(tok.eos_token_id)
    parts = [{"type": "image", "image": _grid("green")}, {"type": "text", "text": "Again?"}]
    prefix = turn + renderer.reply([{"role": "user", "content": parts}])
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=8, seed=4)
    (later,) = engine.generate([opening + prefix], params)
    (first,) = engine.generate([opening], SamplingParams(n=1, max_tokens=8, seed=5))
    samples = [
        Sample(opening, prefix + r, 0.0, [1.0] * (len(prefix) + len(r))) for r in later.response_ids
    ]
    for s, r in zip(samples, later.response_ids, strict=True):
        s.model_mask = [0] * len(prefix) + [1] * len(r)
    lps = [torch.tensor([0.0] * len(prefix) + lp) for lp in later.logprobs]
    r = first.response_ids[0]
    samples.append(Sample(opening, r, 0.0, [1.0] * len(r), model_mask=[1] * len(r)))
    lps.append(torch.tensor(first.logprobs[0]))
    return samples, lps


def test_engine_and_trainer_agree_on_an_image_in_a_later_turn(family):
    model, processor, renderer = family
    samples, engine_lp = _episode(model, processor, renderer)
    assert all(len(images_of(s.response_ids)) == 1 for s in samples[:-1])
    for shared in (True, False):
        opts = ForwardOptions(processor.tokenizer.pad_token_id, shared_prompt=shared)
        assert _gap(compute_logprobs(model, samples, opts), engine_lp, samples) < 1e-5
    # Negative control: the later image left out of the training forward (its tokens
    # embedded as text) must not pass.
    dropped = [
        Sample(s.prompt_ids, list(s.response_ids), 0.0, s.loss_mask, model_mask=s.model_mask)
        for s in samples
    ]
    opts = ForwardOptions(processor.tokenizer.pad_token_id)
    assert _gap(compute_logprobs(model, dropped, opts), engine_lp, samples) > 1e-2


def test_a_later_turn_is_laid_out_as_transformers_lays_it_out(family):
    """A sequence with two images in two turns, through the training forward, gives the
    log-probs of the model's own forward given the pixels (its own feature placement and,
    for Qwen2-VL, its own three-axis positions)."""
    model, processor, renderer = family
    tok = processor.tokenizer
    record = colour_count.colour_count_records("test", n=1)[0]
    opening = renderer.opening([{"role": "user", "content": record.prompt}], record.images)
    turn = [*tok("2", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    parts = [{"type": "image", "image": _grid("blue")}, {"type": "text", "text": "And now?"}]
    response = turn + renderer.reply([{"role": "user", "content": parts}]) + turn
    whole = opening + response
    ids = torch.tensor([list(whole)])
    pixels = whole.pixel_inputs()
    extra = {"mm_token_type_ids": (ids == image_token_id(model)).int()}
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **pixels,
            **(extra if "image_grid_thw" in pixels else {}),
        ).logits[0, len(opening) - 1 : -1]
    ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(response)[:, None])[:, 0]
    sample = Sample(opening, response, 0.0, [1.0] * len(response))
    (ours,) = compute_logprobs(model, [sample], ForwardOptions(tok.pad_token_id))
    assert len(whole.images) == 2 and (ours - ref).abs().max() < 1e-5
    dropped = Sample(opening, list(response), 0.0, sample.loss_mask)  # the later image left out
    (without,) = compute_logprobs(model, [dropped], ForwardOptions(tok.pad_token_id))
    assert (without - ref).abs().max() > 1e-2


def test_every_image_token_as_an_image_is_refused(family):
    model, processor, renderer = family
    samples, _ = _episode(model, processor, renderer, n=1)
    whole = samples[0].prompt_ids + samples[0].response_ids
    ids = torch.tensor([list(whole)])
    assert "inputs_embeds" in token_inputs(model, ids, [whole], [0])
    legacy = ImagePrompt(list(whole), whole.images, whole.pixels)  # no spans: every token
    with pytest.raises(ValueError, match="image positions for"):
        token_inputs(model, ids, [legacy], [0])


def test_episodes_with_image_observations_train_on_what_the_engine_saw(warmed):
    model, processor = warmed
    tok = processor.tokenizer
    renderer = _renderer(processor)
    spec = load_environment(f"{ENVS}:LookAgain", [], "hermes")
    records = colour_count.colour_count_records("test", n=3)
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=100, seed=1)
    with EnvironmentPool(spec, num_workers=1) as pool:  # the images cross a process
        groups = run_episodes(engine, tok, records, params, pool, max_turns=3, renderer=renderer)
    stats = [e for g in groups for e in g.episode_stats]
    assert all(e["end"] == "done" and e["turns"] == 2 for e in stats)
    assert all(len(images_of(r)) == 1 for g in groups for r in g.response_ids)
    samples = [
        Sample(g.prompt_ids, r, 0.0, [1.0] * len(r), model_mask=m)
        for g in groups
        for r, m in zip(g.response_ids, g.model_mask, strict=True)
    ]
    engine_lp = [torch.tensor(lp) for g in groups for lp in g.logprobs]
    opts = ForwardOptions(tok.pad_token_id)
    assert _gap(compute_logprobs(model, samples, opts), engine_lp, samples) < 1e-5
    dropped = [
        Sample(s.prompt_ids, list(s.response_ids), 0.0, s.loss_mask, model_mask=s.model_mask)
        for s in samples
    ]
    assert _gap(compute_logprobs(model, dropped, opts), engine_lp, samples) > 1e-2


class _ExpandingEngine:
    """A stand-in for an engine that expands images itself (vLLM): every turn answers
    ``reply``; it records the prompts it was given."""

    expands_images = True

    def __init__(self, reply: list[int]) -> None:
        self.reply, self.prompts = reply, []

    def generate(self, prompts, params):
        self.prompts.extend(prompts)
        r, n = self.reply, params.n
        return [
            Group(copy_prompt(p), [list(r)] * n, [[-0.5] * len(r)] * n, [False] * n)
            for p in prompts
        ]


@pytest.mark.parametrize("writes_placeholder", [True, False])
def test_an_episode_an_engine_cannot_continue_ends_there_and_keeps_its_sample(writes_placeholder):
    """The policy wrote the image placeholder as text, and the environment answered with an
    image: an engine that expands images itself would put that image on the written token,
    so the episode ends before that prompt (``engine_refused``, truncated), the run goes on
    and the sample is kept; without the written placeholder the episode continues."""
    processor = tiny_vlm.build_processor()
    tok = processor.tokenizer
    renderer = _renderer(processor)
    spec = load_environment(f"{ENVS}:LookAgain", [], "hermes")
    records = colour_count.colour_count_records("test", n=2)
    answer = tok("Answer: 2", add_special_tokens=False)["input_ids"]
    reply = [*answer, processor.image_token_id, tok.eos_token_id]
    engine = _ExpandingEngine(reply if writes_placeholder else [*answer, tok.eos_token_id])
    params = SamplingParams(n=2, temperature=1.0, max_tokens=60, seed=1)
    with EnvironmentPool(spec, num_workers=1) as pool:
        groups = run_episodes(engine, tok, records, params, pool, max_turns=3, renderer=renderer)
    stats = [e for g in groups for e in g.episode_stats]
    if writes_placeholder:
        assert len(engine.prompts) == 2  # the openings only
        assert all(e["end"] == "engine_refused" for e in stats)
        assert all(t for g in groups for t in g.truncated)
        assert all("sampled the placeholder as text" in e["failure"] for e in stats)
        assert all(len(images_of(r)) == 1 for g in groups for r in g.response_ids)  # kept
    else:
        assert len(engine.prompts) == 2 + 4  # then each episode's second turn
        assert all(e["end"] == "done" for e in stats)
        assert all(refusal(p) is None for p in engine.prompts)


# --- runs -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_multi_turn_vision_run_trains_on_the_environment_s_images(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import dapo

    path = tiny_vlm.ensure_builtin_vlm()
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.chat_template = CHAT_TEMPLATE
    rows = [
        {"prompt": r.prompt, "images": r.images, "reward_model": {"ground_truth": r.ground_truth}}
        for r in colour_count.colour_count_records("train", n=32)
    ]
    out = tmp_path / "run"
    seen: list[dict[str, float]] = []
    dapo.train(
        model=AutoModelForImageTextToText.from_pretrained(path),
        processor=processor,
        train_dataset=rows,
        reward_funcs=lambda response, ground_truth: float(ground_truth in response),
        callbacks=[lambda step, metrics: seen.append(metrics)],
        output_dir=str(out),
        **{
            "rollout.environment": f"{ENVS}:LookAgain",
            "rollout.max_turns": 3,
            "rollout.max_completion_length": 100,
            "train.steps": 2,
            "train.prompts_per_step": 4,
            "rollout.num_generations": 4,
            "algorithm.dynamic_sampling": False,
            "algorithm.is_cap": 2.0,  # the engine's log-probs are compared with the trainer's
            "logging.transcripts_per_step": 4,
        },
    )
    # The trainer's log-probs of every model token equal the engine's: each episode's
    # second image reached the training forward (without it they differ by > 1e-2).
    assert len(seen) == 2 and all(m["rollout/logprob_mismatch"] < 1e-5 for m in seen)
    lines = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    assert lines and all(len(r["images"]) == 2 for r in lines)  # the prompt's and the reply's
    assert all((out / p).is_file() for r in lines for p in r["images"])
    assert all("<image>×16" in t["text"] for r in lines for t in r["turns"][1:2])
