"""LoRA through peft (``model.lora``): what is trained, checkpointed, merged and exported."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dapo.config import LoraConfig, load_config
from dapo.errors import ModelError
from dapo.models import lora
from dapo.models.tiny import build_model, build_tokenizer
from dapo.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def lora_model(rank: int = 4, targets: tuple[str, ...] = ("all-linear",), seed: int = 3):
    model = build_model(len(build_tokenizer()), seed=seed).double()
    handle = lora.apply_lora(model, LoraConfig(rank=rank, alpha=8.0, target_modules=list(targets)))
    return model, handle


def perturb_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-zero B (peft starts it at 0, i.e. the base model) so that merging matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def test_only_the_adapters_train_and_start_as_the_base_model() -> None:
    base = build_model(len(build_tokenizer()), seed=3).double()
    model, _ = lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    # all-linear: every linear layer but the output layer, 7 per decoder layer.
    layers = {n.split(".lora_")[0] for n in trainable}
    assert not any("lm_head" in n for n in layers)
    assert {n.rsplit(".", 1)[-1] for n in layers} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    n_trainable, n_total = lora.parameter_counts(model)
    assert n_trainable == sum(model.get_parameter(n).numel() for n in trainable)
    assert n_total - n_trainable == sum(p.numel() for p in base.parameters())  # tied: once
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits)


def test_merged_state_is_the_base_model_with_w_plus_scaled_ba() -> None:
    model, handle = lora_model(targets=("q_proj", "v_proj"))
    perturb_adapters(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = dict(lora.merged_parameters(model))
    # The trained model is untouched.
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    # Base names, the merged formula by hand for one layer: W + (alpha / r) B A.
    base_names = {n for n, _ in build_model(len(build_tokenizer()), seed=3).named_parameters()}
    assert set(merged) == base_names
    layer = "model.layers.0.self_attn.q_proj"
    w = before[f"{layer}.base_layer.weight"]
    b, a = before[f"{layer}.lora_B.default.weight"], before[f"{layer}.lora_A.default.weight"]
    torch.testing.assert_close(merged[f"{layer}.weight"], w + (8.0 / 4) * b @ a)
    # A plain model with the merged weights computes what the LoRA model computes, and the
    # same as peft's own merge.
    plain = build_model(len(build_tokenizer()), seed=3).double()
    plain.load_state_dict(merged, strict=False)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits)
    peft_merged = copy.deepcopy(handle).merge_and_unload().state_dict()
    for name, value in lora.merge_state(model.state_dict(), lora.scalings(model)).items():
        torch.testing.assert_close(value, peft_merged[name])


def test_target_modules_that_do_not_exist_name_the_linear_layers() -> None:
    model = build_model(len(build_tokenizer()), seed=3)
    with pytest.raises(ModelError) as err:
        lora.apply_lora(model, LoraConfig(rank=4, target_modules=["q_prj", "v_proj", "norm"]))
    assert str(err.value) == (
        "`model.lora.target_modules` = ['q_prj', 'v_proj', 'norm']: 'q_prj', 'norm' are not "
        "names of a linear layer of this model. Its linear layers are named down_proj, "
        "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; list some of them, or use "
        "[all-linear] for every linear layer but the output layer."
    )
    assert not lora.is_lora(model)  # refused before anything was injected


def _config(model: Path, out: Path, *extra: str):
    return load_config(
        overrides=[
            f"model.name_or_path={model}",
            f"output_dir={out}",
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
            "checkpoint.save_every=1",
            "reward.num_workers=1",
            "model.lora.rank=4",
            "model.lora.alpha=8",
            "train.lr=5e-3",
            *extra,
        ]
    )


@pytest.mark.slow
def test_checkpoints_hold_the_adapters_resume_exactly_and_export_merged(
    random_tiny_model, tmp_path
):
    from transformers import AutoModelForCausalLM

    whole = Trainer(
        _config(random_tiny_model, tmp_path / "whole", "train.steps=3"), log=lambda _: None
    )
    summary = whole.run()
    first = Trainer(
        _config(random_tiny_model, tmp_path / "run", "train.steps=2"), log=lambda _: None
    )
    first.run()
    resumed = Trainer(
        _config(random_tiny_model, tmp_path / "run", "train.steps=3", "resume=true"),
        log=lambda _: None,
    )
    resumed.run()
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    adapters = load_file(ckpt / "model.safetensors")
    trained = {n for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert set(adapters) == trained  # the adapters only, no base weight
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=False)
    assert len(optimizer["state"]) == len(trained)  # AdamW moments of the adapters only
    # Resuming loses nothing: the same adapters and optimizer state as the 3-step run.
    for name in ("model.safetensors", "optimizer.pt"):
        assert (ckpt / name).read_bytes() == (
            tmp_path / "whole" / "checkpoints" / "step_000003" / name
        ).read_bytes(), name
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # it trained
    assert summary["trainable_parameters"] == sum(v.numel() for v in adapters.values())
    assert summary["trainable_parameters"] < summary["parameters"] / 5
    # final_model: a plain transformers model holding the merged weights.
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model")
    plain_names = set(AutoModelForCausalLM.from_pretrained(random_tiny_model).state_dict())
    assert set(final.state_dict()) == plain_names
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(
            final(input_ids=ids).logits, resumed.model(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    # A checkpoint of a full fine-tuning run does not load into a LoRA run (and says why).
    full = tmp_path / "full"
    Trainer(
        load_config(
            overrides=[
                f"model.name_or_path={random_tiny_model}",
                f"output_dir={full}",
                "train.steps=1",
                "evaluate=false",
                "logging.tensorboard=false",
                "logging.dashboard=false",
                "logging.console=false",
                "checkpoint.save_final_model=false",
                "algorithm.dynamic_sampling=false",
                "train.prompts_per_step=2",
                "train.mini_batch_size=2",
                "rollout.max_completion_length=12",
                "algorithm.overlong_buffer=4",
            ]
        ),
        log=lambda _: None,
    ).run()
    from dapo.training.checkpoint import CheckpointError, load_checkpoint

    with pytest.raises(CheckpointError, match="model.lora setting"):
        load_checkpoint(full / "checkpoints" / "step_000001", resumed.model)


@pytest.mark.slow
def test_final_model_loads_in_dapo_eval(random_tiny_model, tmp_path, capsys):
    from dapo.cli import main

    Trainer(_config(random_tiny_model, tmp_path / "run", "train.steps=1"), log=lambda _: None).run()
    data = tmp_path / "eval.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{i}+{i}=", "reward_model": {"ground_truth": str(2 * i)}}) + "\n"
            for i in range(3)
        )
    )
    report = tmp_path / "report.json"
    assert (
        main(
            [
                "eval",
                str(tmp_path / "run" / "final_model"),
                "--data",
                str(data),
                "--k",
                "1",
                "--max-tokens",
                "8",
                "--output",
                str(report),
            ]
        )
        == 0
    )
    assert json.loads(report.read_text())


@pytest.mark.slow
def test_reference_policy_is_the_base_model_with_adapters_disabled(random_tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from dapo.training.batch import Sample
    from dapo.training.forward import ForwardOptions, compute_logprobs

    trainer = Trainer(
        _config(random_tiny_model, tmp_path / "run", "algorithm.beta=0.01"), log=lambda _: None
    )
    assert trainer.learner.ref_model is None  # no copy of the policy
    perturb_adapters(trainer.model)
    samples = [Sample([5, 6, 7], [8, 9, 10, 11], 1.0, [1.0] * 4) for _ in range(2)]
    forward = ForwardOptions(0, 1.0, 10**6)
    with trainer.learner.reference() as reference:
        ref = compute_logprobs(reference, samples, forward)
    base = AutoModelForCausalLM.from_pretrained(random_tiny_model)
    want = compute_logprobs(base, samples, forward)
    policy = compute_logprobs(trainer.model, samples, forward)
    torch.testing.assert_close(ref[0], want[0], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(policy[0], want[0], atol=1e-3)  # the adapters are back on
    trainer.close()


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "lm_head")])
def test_training_log_probs_of_a_lora_model_equal_the_whole_logits_path(targets) -> None:
    """all-linear leaves the output layer a plain nn.Linear: the chunked head path
    (dapo.models.chunked_logprobs) runs. A LoRA-wrapped output layer is no plain nn.Linear: the whole logits
    are computed. Either way the values and the adapters' gradients are those of the whole
    logits, and an adapted output layer's adapters get their gradient."""
    from dapo import algorithms as alg
    from dapo.models.head import output_head
    from dapo.training.batch import Sample
    from dapo.training.forward import ForwardOptions, response_logits, response_logprobs
    from dapo.training.microbatch import collate

    model, _ = lora_model(targets=targets)
    perturb_adapters(model)
    model.train()
    assert (output_head(model) is model.lm_head) == (targets == ("all-linear",))
    batch = [
        Sample([5, 6, 7], [8, 9, 10, 11], 1.0, [1.0] * 4),
        Sample([5, 6, 7], [12, 13], -1.0, [1.0] * 2),
        Sample([14, 15], [16, 17, 18], 0.5, [1.0] * 3),
    ]
    mask = collate(batch, 0).loss_mask.double()
    gen = torch.Generator().manual_seed(1)
    cl = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    ce = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    adapters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def run(fn):
        model.zero_grad(set_to_none=True)
        logp, ent = fn()
        ((logp * cl * mask).sum() + (ent * ce * mask).sum()).backward()
        return logp.detach() * mask, ent.detach() * mask, {n: p.grad.clone() for n, p in adapters}

    def whole():
        logits = response_logits(model, collate(batch, 0), temperature=0.7).double()
        ids = collate(batch, 0).response_ids
        return alg.token_logprobs(logits, ids), alg.token_entropy(logits)

    ref = run(whole)
    got = run(
        lambda: response_logprobs(
            model, collate(batch, 0), ForwardOptions(0, 0.7, logits_chunk_size=5)
        )
    )
    torch.testing.assert_close(got[0], ref[0].to(got[0].dtype), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1].to(got[1].dtype), atol=1e-5, rtol=1e-5)
    for name, g in ref[2].items():
        torch.testing.assert_close(got[2][name], g, atol=1e-5 * float(g.abs().max()), rtol=1e-4)
    if "lm_head" in targets:
        assert any("lm_head.lora_" in n and float(g.abs().max()) > 0 for n, g in got[2].items())


def test_lora_with_gradient_checkpointing_gives_the_same_adapter_gradients() -> None:
    """dapo's checkpointed decoder layers (model.gradient_checkpointing) around peft's
    adapters, with frozen inputs (embeddings): the adapters' gradients are unchanged."""
    from dapo.models.activation_checkpointing import checkpoint_layers
    from dapo.training.batch import Sample
    from dapo.training.forward import ForwardOptions, response_logprobs
    from dapo.training.microbatch import collate

    batch = [
        Sample([5, 6, 7], [8, 9, 10, 11], 1.0, [1.0] * 4),
        Sample([5, 6, 7], [12, 13], -1.0, [1.0] * 2),
    ]
    grads = []
    for checkpointed in (False, True):
        model, _ = lora_model()
        perturb_adapters(model)
        if checkpointed:
            assert checkpoint_layers(model) > 0
        model.train()
        logp, ent = response_logprobs(model, collate(batch, 0), ForwardOptions(0, 1.0))
        (logp.sum() + 0.1 * ent.sum()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert all(g is not None and float(g.abs().max()) > 0 for g in grads[0].values())
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-12, rtol=1e-9)
