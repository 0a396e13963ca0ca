"""``model.name_or_path`` = a .gguf file: dequantised once, cached, trained, saved as transformers.

The file is written by the test (tests/gguf_fixtures.py: a small Llama with a byte-level BPE
tokenizer, a chat template and Q4_1 matrices), together with the model whose weights it
decodes to, so the conversion is checked weight for weight.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf extra is not installed (pip install 'dapo[gguf]')")

from gguf_fixtures import CHAT_TEMPLATE, EOS_ID, write_tiny_gguf  # noqa: E402

from dapo.cli import main  # noqa: E402
from dapo.errors import ModelError  # noqa: E402
from dapo.models import gguf as dapo_gguf  # noqa: E402
from dapo.models import load_policy, load_tokenizer, resolve_model_path  # noqa: E402


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("DAPO_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-test.Q4_1.gguf"
    return path, write_tiny_gguf(path)


def test_a_gguf_file_is_dequantised_exactly_once_and_cached(tiny_gguf, cache, monkeypatch):
    path, reference = tiny_gguf
    notes: list[str] = []
    out = Path(resolve_model_path(str(path), log=notes.append))

    assert out.parent == cache / "gguf" and out.name.startswith("tiny-test.Q4_1-")
    n_params = sum(p.numel() for p in reference.parameters())
    (note,) = notes
    assert note.startswith("tiny-test.Q4_1.gguf: GGUF (llama, Q4_1) dequantised to float32")
    assert f"{n_params / 1e6:.1f}M parameters" in note and str(out) in note
    # A plain transformers directory: no quantization config, every weight as the file decodes.
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    model = load_policy(str(out))
    got, want = model.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    ids = torch.tensor([[5, 70, 100, 3, 200, EOS_ID]])
    assert torch.equal(model(ids).logits, reference(ids).logits)

    tok = load_tokenizer(str(out))
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tok.pad_token_id == EOS_ID
    text = "the answer is 42"
    assert tok.decode(tok(text).input_ids) == text
    assert tok("<|im_end|>", add_special_tokens=False).input_ids == [EOS_ID]
    assert tok.chat_template == CHAT_TEMPLATE
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # Later loads use the cache: nothing is converted again.
    def no_conversion(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(dapo_gguf, "_dequantise", no_conversion)
    notes.clear()
    assert resolve_model_path(str(path), log=notes.append) == str(out)
    assert "using the conversion cached in" in notes[0] and "Q4_1" in notes[0]


def test_the_tokenizers_special_tokens_are_the_files_whatever_transformers_reads(
    tiny_gguf, cache, monkeypatch
):
    """transformers 5.17 (the GPU image's) read this file's EOS as its BOS and no PAD; the
    conversion takes them from the file's metadata, by id."""
    from transformers import AutoTokenizer

    path, _ = tiny_gguf
    real = AutoTokenizer.from_pretrained

    def as_in_5_17(*args, **kwargs):
        tok = real(*args, **kwargs)
        tok.eos_token, tok.pad_token = tok.bos_token, None
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", as_in_5_17)
    out = Path(resolve_model_path(str(path), log=lambda _: None))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", real)
    tok = load_tokenizer(str(out))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert tok.eos_token_id == tok.pad_token_id == EOS_ID and tok.bos_token_id == 1
    info = json.loads((out / dapo_gguf.INFO_FILE).read_text())
    assert info["special_token_ids"] == {"bos": 1, "eos": EOS_ID, "unk": 0, "pad": EOS_ID}


def test_a_changed_file_gets_a_new_conversion(tmp_path, cache):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=1)
    first = dapo_gguf.cache_dir_for(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert dapo_gguf.cache_dir_for(path) != first
    # A file is also recognised by its magic bytes, whatever its name.
    other = tmp_path / "model.bin"
    other.write_bytes(path.read_bytes())
    assert Path(resolve_model_path(str(other), log=lambda _: None)).is_dir()


@pytest.mark.slow
def test_dapo_train_and_eval_take_a_gguf_file_and_save_transformers_format(
    tiny_gguf, cache, tmp_path, capsys
):
    path, reference = tiny_gguf
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            f"model.name_or_path={path}",
            f"output_dir={out}",
            "train.steps=1",
            "train.prompts_per_step=2",
            "train.mini_batch_size=2",
            "rollout.num_generations=2",
            "rollout.max_completion_length=8",
            "algorithm.overlong_buffer=4",
            "algorithm.dynamic_sampling=false",
            "evaluate=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "logging.console=false",
            "train.lr=1e-2",
            "reward.num_workers=0",
        ]
    )
    assert rc == 0
    assert "GGUF (llama, Q4_1) dequantised to float32" in capsys.readouterr().out
    final = out / "final_model"
    config = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(final)
    moved = [
        k for k, v in reference.state_dict().items() if not torch.equal(trained.state_dict()[k], v)
    ]
    assert moved  # the policy trained: the saved weights are the trained ones
    assert load_tokenizer(str(final)).chat_template == CHAT_TEMPLATE

    report = tmp_path / "eval.json"
    rc = main(
        [
            "eval",
            str(path),
            "--data",
            "builtin:addition",
            "--max-problems",
            "3",
            "--k",
            "2",
            "--max-tokens",
            "4",
            "--output",
            str(report),
        ]
    )
    assert rc == 0
    result = json.loads(report.read_text())
    assert result["problems"] == 3 and result["k"] == 2
    assert "using the conversion cached in" in capsys.readouterr().out


def test_gguf_errors_name_the_problem_and_the_fix(tmp_path, cache, monkeypatch):
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf file")
    with pytest.raises(ModelError, match="is named .gguf but is not a GGUF file"):
        resolve_model_path(str(fake))
    with pytest.raises(ModelError, match="no such file"):
        resolve_model_path(str(tmp_path / "missing.gguf"))

    import gguf

    odd = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(odd, "rwkv6")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ModelError, match=r"the GGUF architecture 'rwkv6' cannot be read by transformers .* llama"
    ):
        resolve_model_path(str(odd))

    monkeypatch.setattr(dapo_gguf, "gguf_available", lambda: False)
    with pytest.raises(ModelError, match=r"needs the `gguf` package.*pip install 'dapo\[gguf\]'"):
        resolve_model_path(str(odd))
    assert not (cache / "gguf").exists() or not any(
        (cache / "gguf").iterdir()
    )  # nothing half-written
