"""Vision-language policies: image data forms and their errors, the engine's prefill with
images against the training forward (with a negative control: the image left out must
fail), shared prefixes that never hold an image, freezing, refusals, transcripts' images and
the export's processor."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from dapo.data.images import ImagePrompt, encode_with_images, prompt_key, render_with_images
from dapo.data.prompts import encode_prompts
from dapo.data.records import records_from_rows
from dapo.data.tasks import colour_count
from dapo.errors import ConfigError, DataError, ModelError
from dapo.models.vision import freeze_vision_tower, image_token_id, pixel_cache, text_prefix
from dapo.rollout.base import SamplingParams
from dapo.rollout.hf_engine import HFEngine
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs
from dapo.training.microbatch import collate

tiny_vlm = pytest.importorskip("dapo.models.tiny_vlm")
from vision_fixtures import tiny_qwen2_vl  # noqa: E402


@pytest.fixture(scope="module")
def vlm():
    """A random tiny Idefics3 model and its processor (not the warmed-up one: the checks
    must hold for any weights)."""
    processor = tiny_vlm.build_processor()
    return tiny_vlm.build_model(processor, seed=3).eval(), processor


def _png(colour=(200, 20, 20), size=(16, 16)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _prompts(processor, records) -> list[ImagePrompt]:
    texts = [render_with_images(r.prompt, processor) for r in records]
    return encode_with_images(texts, [r.images for r in records], processor, pixel_cache(processor))


# --- data forms --------------------------------------------------------------------------


def test_trl_and_verl_image_rows_read_every_image_form(tmp_path):
    from PIL import Image

    path, other = tmp_path / "cell.png", tmp_path / "other.png"
    path.write_bytes(_png((0, 0, 255)))
    other.write_bytes(_png((0, 99, 0)))
    trl = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    rows = [
        {"prompt": [{"role": "user", "content": trl}], "images": [Image.open(path)], "a": "blue"},
        {"prompt": [{"role": "user", "content": trl}], "image": str(other), "a": "green"},
        {"prompt": "<image> colour?", "images": [_png()], "a": "red"},
        {"prompt": "<image> colour? <image>", "images": [{"bytes": _png(), "path": None},
                                                        {"bytes": None, "path": str(path)}],
         "a": "red"},
        {"prompt": "no image at all", "a": "1"},
    ]  # fmt: skip
    records, _ = records_from_rows(rows, answer_key="a")
    assert [len(r.images) for r in records] == [1, 1, 1, 2, 0]
    assert all(img.mode == "RGB" for r in records for img in r.images)
    assert records[2].images[0].getpixel((0, 0)) == (200, 20, 20)
    assert records[3].images[1].getpixel((0, 0)) == (0, 0, 255)
    assert records[0].prompt[0]["content"] == trl  # the parts kept, in order
    assert "images" not in records[2].extra  # the images are the record's, not a column


def test_identical_text_with_different_images_are_different_problems():
    rows = [
        {"prompt": "<image> colour?", "images": [_png((255, 0, 0))], "a": "red"},
        {"prompt": "<image> colour?", "images": [_png((0, 255, 0))], "a": "green"},
        {"prompt": "<image> colour?", "images": [_png((255, 0, 0))], "a": "red"},
    ]
    records, stats = records_from_rows(rows, answer_key="a")
    assert len(records) == 2 and stats.duplicates == 1
    assert records[0].uid != records[1].uid


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"prompt": "<image> and <image>", "images": [_png()]}, "2 image placeholders"),
        ({"prompt": "no placeholder", "images": [_png()]}, "0 image placeholders"),
        ({"prompt": "<image>", "images": ["/no/such/file.png"]}, "does not exist"),
        ({"prompt": "<image>", "images": [b"not an image"]}, "cannot be read"),
        ({"prompt": "<image>", "images": [3.5]}, "an image is a float"),
        (
            {"prompt": [{"role": "user", "content": [{"type": "video"}]}], "images": []},
            "neither {'type': 'text'",
        ),
    ],
)
def test_a_bad_image_row_is_refused_naming_the_row(row, needle):
    rows = [{"prompt": "<image>", "images": [_png()], "a": "1"}, {**row, "a": "1"}]
    with pytest.raises(DataError, match="row 1") as err:
        records_from_rows(rows, answer_key="a", source="train.parquet")
    assert needle in str(err.value) and "Fix:" in str(err.value)


def test_parquet_and_datasets_image_feature(tmp_path):
    datasets = pytest.importorskip("datasets")
    from dapo.data.sources import load_records

    ds = datasets.Dataset.from_dict(
        {
            "prompt": ["<image> colour?", "<image> colour?"],
            "images": [
                [{"bytes": _png((1, 2, 3)), "path": None}],
                [{"bytes": _png(), "path": None}],
            ],
            "reward_model": [{"ground_truth": "a"}, {"ground_truth": "b"}],
        },
        features=datasets.Features(
            {
                "prompt": datasets.Value("string"),
                "images": datasets.Sequence(datasets.Image()),
                "reward_model": {"ground_truth": datasets.Value("string")},
            }
        ),
    )
    ds.to_parquet(str(tmp_path / "train.parquet"))
    for source in (ds, str(tmp_path / "train.parquet")):
        records, _ = load_records(source)
        assert [r.images[0].getpixel((0, 0)) for r in records] == [(1, 2, 3), (200, 20, 20)]


def test_a_text_model_refuses_prompts_with_images():
    from dapo.models.tiny import build_tokenizer

    records, _ = records_from_rows(
        [{"prompt": "<image> x", "images": [_png()], "a": "1"}], answer_key="a"
    )
    with pytest.raises(DataError, match="text model"):
        encode_prompts(records, build_tokenizer(), 64)


# --- the engine and the training forward ---------------------------------------------------


def _rollout(model, processor, n_prompts=4, n=3, direct=True):
    tok = processor.tokenizer
    prompts = _prompts(processor, colour_count.colour_count_records("test", n=n_prompts))
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, direct=direct)
    groups = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=10, seed=5))
    samples = [Sample(g.prompt_ids, r, 0.0, [1.0] * len(r)) for g in groups for r in g.response_ids]
    engine_lp = [torch.tensor(lp) for g in groups for lp in g.logprobs]
    return groups, samples, engine_lp


def _gap(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_engine_and_trainer_logprobs_agree_and_a_dropped_image_fails(vlm, direct, shared):
    model, processor = vlm
    groups, samples, engine_lp = _rollout(model, processor, direct=direct)
    assert all(isinstance(g.prompt_ids, ImagePrompt) for g in groups)  # the images travel
    opts = ForwardOptions(processor.tokenizer.pad_token_id, shared_prompt=shared)
    assert _gap(compute_logprobs(model, samples, opts), engine_lp) < 1e-5
    # Negative control: the same tokens without the pixels (the image tokens embedded as
    # text) must not pass.
    dropped = [Sample(list(s.prompt_ids), s.response_ids, 0.0, s.loss_mask) for s in samples]
    assert _gap(compute_logprobs(model, dropped, opts), engine_lp) > 1e-2


def test_partial_rollouts_keep_the_prompt_s_images_and_agree(vlm):
    from dapo.rollout.versioned import VersionedEngine

    model, processor = vlm
    tok = processor.tokenizer
    prompts = _prompts(processor, colour_count.colour_count_records("test", n=2))
    engine = VersionedEngine(HFEngine(model, tok.eos_token_id, tok.pad_token_id), chunk_tokens=3)
    groups = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=5))
    assert all(g.prompt_ids.images == p.images for g, p in zip(groups, prompts, strict=True))
    samples = [Sample(g.prompt_ids, r, 0.0, [1.0] * len(r)) for g in groups for r in g.response_ids]
    engine_lp = [torch.tensor(lp) for g in groups for lp in g.logprobs]
    opts = ForwardOptions(tok.pad_token_id)
    assert _gap(compute_logprobs(model, samples, opts), engine_lp) < 1e-5


def test_another_image_under_the_same_tokens_changes_the_logprobs(vlm):
    model, processor = vlm
    _, samples, engine_lp = _rollout(model, processor, n_prompts=2)
    first, second = samples[0].prompt_ids, samples[-1].prompt_ids
    swapped = ImagePrompt(list(first), second.images, first.pixels)
    assert list(swapped) == list(first) and prompt_key(swapped) != prompt_key(first)
    moved = Sample(swapped, samples[0].response_ids, 0.0, samples[0].loss_mask)
    opts = ForwardOptions(processor.tokenizer.pad_token_id)
    assert _gap(compute_logprobs(model, [moved], opts), engine_lp[:1]) > 1e-3
    batch = collate([samples[0], moved], 0)
    assert batch.owner == [0, 1]  # same tokens, different images: two prompts


def test_a_shared_prefix_stops_before_the_first_image(vlm):
    model, processor = vlm
    token = image_token_id(model)
    prompts = _prompts(processor, colour_count.colour_count_records("test", n=3))
    heads = text_prefix(prompts, token)
    assert all(token not in h and len(h) < len(p) for h, p in zip(heads, prompts, strict=True))
    assert text_prefix([[5, 6, 7]], token) == [[5, 6, 7]]


def test_the_vision_tower_is_frozen_unless_asked(vlm):
    _, processor = vlm
    model = tiny_vlm.build_model(processor)
    frozen = freeze_vision_tower(model, train=False)
    tower = model.model.vision_model
    assert frozen == sum(p.numel() for p in tower.parameters()) > 0
    assert not any(p.requires_grad for p in tower.parameters())
    assert all(p.requires_grad for p in model.model.connector.parameters())
    again = tiny_vlm.build_model(processor)
    assert freeze_vision_tower(again, train=True) == 0
    assert all(p.requires_grad for p in again.parameters())


def test_an_unsupported_vision_family_is_refused_with_the_reason(tmp_path):
    from transformers import Gemma3Config, LlavaConfig

    from dapo.models.loading import load_policy

    LlavaConfig().save_pretrained(tmp_path / "llava")
    with pytest.raises(ModelError, match="'llava' is not supported.*supported: idefics3"):
        load_policy(str(tmp_path / "llava"))
    Gemma3Config().save_pretrained(tmp_path / "gemma3")
    with pytest.raises(ModelError, match="'gemma3' is not supported .dapo does not know"):
        load_policy(str(tmp_path / "gemma3"))


def test_a_vision_model_with_agents_is_refused_at_start_up_and_every_engine_is_taken():
    from dapo.config import load_config
    from dapo.training.loading import check_vision_run

    with pytest.raises(ConfigError, match="rollout.agent"):
        check_vision_run(load_config(), agent=True)
    server = ["rollout.engine=vllm-server", "rollout.server_url=http://127.0.0.1:8000"]
    for overrides in ([], ["rollout.engine=vllm"], server):  # environments and tools may too
        check_vision_run(load_config(overrides=overrides), agent=False)


# --- a run: transcripts, export ------------------------------------------------------------


SHORT_RUN = {  # two steps of builtin:tiny-vlm's size
    "train.steps": 2,
    "train.prompts_per_step": 4,
    "rollout.num_generations": 4,
    "rollout.max_completion_length": 12,
    "algorithm.dynamic_sampling": False,
}


def _rows(n: int) -> list[dict]:
    return [
        {"prompt": r.prompt, "images": r.images, "reward_model": {"ground_truth": r.ground_truth}}
        for r in colour_count.colour_count_records("train", n=n)
    ]


def _loaded():
    """builtin:tiny-vlm loaded as objects, as a user loads a model from Python."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_vlm.ensure_builtin_vlm()
    return AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)


def test_a_vision_model_object_without_its_processor_is_refused(tmp_path):
    import dapo

    model, processor = _loaded()
    with pytest.raises(ConfigError, match=r"processor=AutoProcessor\.from_pretrained") as err:
        dapo.make_trainer(
            model=model,
            tokenizer=processor.tokenizer,
            train_dataset=_rows(8),
            output_dir=str(tmp_path / "run"),
        )
    assert "Idefics3ForConditionalGeneration object" in str(err.value)
    assert "text model" not in str(err.value)


@pytest.mark.slow
def test_a_vision_model_given_as_objects_trains_with_its_processor(tmp_path):
    import dapo

    model, processor = _loaded()
    tower = {k: v.clone() for k, v in model.model.vision_model.state_dict().items()}
    text = model.model.text_model.layers[0].mlp.up_proj.weight.clone()
    out = tmp_path / "run"
    summary = dapo.train(
        model=model,
        processor=processor,  # its tokenizer is the run's
        train_dataset=_rows(32),
        output_dir=str(out),
        **SHORT_RUN,
    )
    assert summary["steps"] == 2
    lines = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    assert lines and all(len(r["images"]) == 1 for r in lines)
    # Trained in place: the language model moved, the vision encoder stayed frozen.
    assert not torch.equal(model.model.text_model.layers[0].mlp.up_proj.weight, text)
    assert all(torch.equal(v, tower[k]) for k, v in model.model.vision_model.state_dict().items())


@pytest.mark.slow
def test_a_run_from_python_rows_saves_images_and_exports_the_processor(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import dapo

    out = tmp_path / "run"
    dapo.train(
        train_dataset=_rows(64),
        model="builtin:tiny-vlm",
        output_dir=str(out),
        **SHORT_RUN,
    )
    lines = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    assert lines and all(len(r["images"]) == 1 for r in lines)
    assert all((out / r["images"][0]).is_file() for r in lines)
    assert all(f"<image>×{tiny_vlm.IMAGE_TOKENS}" in r["prompt"] for r in lines)
    from PIL import Image

    assert Image.open(out / lines[0]["images"][0]).size == (32, 32)

    # The export loads back with transformers and greedy-decodes as dapo's engine does.
    final = out / "final_model"
    model = AutoModelForImageTextToText.from_pretrained(final).eval()
    processor = AutoProcessor.from_pretrained(final)
    record = colour_count.colour_count_records("test", n=1)[0]
    (prompt,) = _prompts(processor, [record])
    tok = processor.tokenizer
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    (group,) = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_tokens=10))
    inputs = {k: v for k, v in prompt.pixel_inputs().items()}
    ref = model.generate(
        input_ids=torch.tensor([list(prompt)]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=10,
        do_sample=False,
        **inputs,
    )[0, len(prompt) :].tolist()
    ours = group.response_ids[0]
    assert ours == ref[: len(ours)] and len(ours) >= 1


# --- the Qwen2-VL family: three-axis positions ---------------------------------------------


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen2_vl()


def _qwen_prompts(processor, n=3):
    from PIL import Image

    rows = [
        {
            "prompt": f"Look: <|vision_start|><image><|vision_end|> which {i}?",
            "images": [Image.new("RGB", (32, 16 + 16 * (i % 2)), (40 * i, 200, 30))],
            "a": "1",
        }
        for i in range(n)
    ]
    records, _ = records_from_rows(rows, answer_key="a")
    return _prompts(processor, records)


def test_qwen2_vl_decodes_as_transformers_generate_does(qwen):
    model, processor = qwen
    tok = processor.tokenizer
    prompts = _qwen_prompts(processor)
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    groups = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=8))
    for prompt, group in zip(prompts, groups, strict=True):
        x = prompt.pixel_inputs()
        ids = torch.tensor([list(prompt)])
        ref = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            max_new_tokens=8,
            do_sample=False,
            **x,
        )[0, ids.shape[1] :].tolist()
        ours = group.response_ids[0]
        assert ours == ref[: len(ours)] and ours


def test_qwen2_vl_engine_and_trainer_agree_and_one_axis_positions_fail(qwen, monkeypatch):
    model, processor = qwen
    tok = processor.tokenizer
    prompts = _qwen_prompts(processor)
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    groups = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=2))
    samples = [Sample(g.prompt_ids, r, 0.0, [1.0] * len(r)) for g in groups for r in g.response_ids]
    engine_lp = [torch.tensor(lp) for g in groups for lp in g.logprobs]
    for shared in (True, False):
        opts = ForwardOptions(tok.pad_token_id, shared_prompt=shared)
        assert _gap(compute_logprobs(model, samples, opts), engine_lp) < 1e-5
    dropped = [Sample(list(s.prompt_ids), s.response_ids, 0.0, s.loss_mask) for s in samples]
    opts = ForwardOptions(tok.pad_token_id)
    assert _gap(compute_logprobs(model, dropped, opts), engine_lp) > 1e-2
    # The token index as every axis's position (what a one-axis layout would give) fails.
    import dapo.models.vision as vision

    monkeypatch.setattr(vision, "uses_mrope", lambda model: False)
    assert _gap(compute_logprobs(model, samples, opts), engine_lp) > 1e-3


def test_qwen2_vl_freezes_its_tower_but_not_its_merger(qwen):
    model, _ = qwen
    import copy

    model = copy.deepcopy(model)
    assert freeze_vision_tower(model, train=False) > 0
    assert not any(p.requires_grad for p in model.model.visual.blocks.parameters())
    assert all(p.requires_grad for p in model.model.visual.merger.parameters())


def test_lora_adapters_go_on_the_language_model_and_the_engine_still_agrees(vlm):
    pytest.importorskip("peft")
    import copy

    from dapo.config.schema import LoraConfig
    from dapo.models.lora import apply_lora

    model, processor = vlm
    model = copy.deepcopy(model)
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    adapted = {n for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted and all("text_model" in n for n in adapted)
    for p in (p for n, p in model.named_parameters() if "lora_B" in n):
        torch.nn.init.normal_(p, std=0.05)  # adapters that change the policy
    _, samples, engine_lp = _rollout(model, processor)
    opts = ForwardOptions(processor.tokenizer.pad_token_id)
    assert _gap(compute_logprobs(model, samples, opts), engine_lp) < 1e-5


@pytest.mark.slow
def test_dapo_eval_reads_the_images_of_a_vision_model(tmp_path, capsys):
    from dapo.cli import main

    out = tmp_path / "report.json"
    argv = ["eval", "builtin:tiny-vlm", "--data", "builtin:colour_count", "--max-problems", "40"]
    assert main([*argv, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["samples"] == 40 and report["mean_response_length"] > 0
    # The default --max-tokens is cut to the text model's context (1024 positions), which
    # the vLLM engine must hold.
    assert report["max_tokens"] + report["max_prompt_length"] <= 1024


@pytest.mark.slow
def test_a_resumed_vision_run_ends_with_the_uninterrupted_run_s_weights(tmp_path):
    """Carried-over groups hold their images through a checkpoint: 4 steps straight and
    2 + 2 resumed give the same final weights and the same metrics."""
    from safetensors.torch import load_file

    import dapo

    def run(out, steps, resume=False):
        dapo.train(
            str(Path(__file__).resolve().parents[1] / "examples" / "vision.yaml"),
            output_dir=str(out),
            resume=resume,
            **{
                "train.steps": steps,
                "train.prompts_per_step": 4,
                "rollout.num_generations": 4,
                "data.max_eval_prompts": 8,
                "checkpoint.save_every": 1,
                "logging.eval_every": 0,
            },
        )

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, 4)
    run(resumed, 2)
    run(resumed, 4, resume=True)
    a = load_file(straight / "final_model" / "model.safetensors")
    b = load_file(resumed / "final_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def rewards(out):
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [(m["step"], m["reward/mean"]) for m in lines if "reward/mean" in m]

    assert rewards(straight) == rewards(resumed) and len(rewards(straight)) == 4
