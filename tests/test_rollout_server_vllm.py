"""The rollout server with vLLM in a subprocess on 127.0.0.1: bad requests, a failing or
stuck engine, stopping, the API key and the model check.

One server (``builtin:tiny``, an API key, a fault that makes a generation with seed
``HANG_SEED`` hang; ``tests/serve_with_faults.py``) is shared by the tests of this module;
a test that ends it leaves the next one to start another. The engine-failure test starts
its own, whose token ids are not checked, so that an out-of-vocabulary id fails inside
vLLM's forward pass, as users met it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ranks import forked_popen  # tests/ranks.py
from serve_with_faults import HANG_SEED  # tests/serve_with_faults.py
from vllm_check import needs_vllm  # tests/vllm_check.py

pytestmark = [needs_vllm, pytest.mark.usefixtures("one_thread")]

KEY = "test-key-31"
FAULTS = [sys.executable, str(Path(__file__).with_name("serve_with_faults.py"))]
PROMPTS = [[3 + i % 90 for i in range(k, k + 9)] for k in range(3)]  # token ids of builtin:tiny
REFERENCE = {"prompts": PROMPTS, "n": 2, "temperature": 1.0, "max_tokens": 12, "seed": 7}


def request(
    url: str,
    path: str,
    body: bytes | dict | None = None,
    key: str | None = KEY,
    timeout: float = 120,
) -> tuple[int, dict]:
    """(status, JSON answer) of one request (GET without a body)."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(
        url + path, data=data, method="GET" if data is None else "POST", headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class Server:
    """``dapo vllm-serve builtin:tiny`` (with faults) in a process of its own, forked from
    the tests' zygote (tests/ranks.py); started on demand."""

    def __init__(self, tiny: Path, logs: Path, faults: str, key: str | None = KEY) -> None:
        self.tiny, self.logs, self.faults, self.key = tiny, logs, faults, key
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def ensure(self) -> str:
        from dapo.rollout.server import launch
        from dapo.rollout.weight_channel import free_port

        if self.proc is None or self.proc.poll() is not None:
            self.starts += 1
            self.port = free_port()
            self.log = self.logs / f"server-{self.faults or 'plain'}-{self.starts}.log"
            env = dict(
                os.environ,
                DAPO_CACHE=str(self.tiny.parent),
                OMP_NUM_THREADS="1",
                DAPO_TEST_FAULTS=self.faults,
            )
            env.pop("DAPO_SERVER_API_KEY", None)
            if self.key:
                env["DAPO_SERVER_API_KEY"] = self.key
            self.proc = launch(
                str(self.tiny),
                self.port,
                log=self.log,
                max_model_len=256,
                env=env,
                timeout_s=300,
                command=FAULTS,
                popen=forked_popen,  # forked from a process that has imported vLLM
            )
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    from dapo.models import resolve_model_path

    return Path(resolve_model_path("builtin:tiny", log=lambda _: None))


@pytest.fixture(scope="module")
def shared(tiny_path, tmp_path_factory):
    server = Server(tiny_path, tmp_path_factory.mktemp("servers"), "hang")
    yield server
    server.stop()


@pytest.fixture
def url(shared) -> str:
    return shared.ensure()


def tokens(answer: dict) -> list:
    return [g["response_ids"] for g in answer["groups"]]


def test_an_out_of_vocabulary_id_gets_a_400_and_the_next_request_is_served(url):
    status, before = request(url, "/generate", REFERENCE)
    assert status == 200, before
    status, answer = request(url, "/generate", {**REFERENCE, "prompts": [[5, 99999999]]})
    assert status == 400, answer
    assert (
        "`prompts[0][1]` = 99999999 is not a token id of the served model: ids run from 0 to 98"
        in answer["error"]
    )
    status, after = request(url, "/generate", REFERENCE)
    assert status == 200 and tokens(after) == tokens(before)
    status, health = request(url, "/health", key=None)
    assert status == 200 and health["status"] == "ok"


def test_fuzzed_bad_requests_leave_the_server_generating_the_same_tokens(url):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    status, before = request(url, "/generate", REFERENCE)
    assert status == 200
    weird = st.one_of(
        st.integers(-3, 140),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=4),
        st.booleans(),
        st.none(),
        st.lists(st.integers(-2, 3), max_size=2),
    ).filter(lambda v: v != HANG_SEED)
    prompt = st.one_of(
        st.lists(weird, max_size=5), st.lists(st.integers(0, 120), max_size=5), weird
    )
    fields = {
        "prompts": st.one_of(st.lists(prompt, max_size=3), weird),
        "n": weird,
        "temperature": weird,
        "top_p": weird,
        "top_k": weird,
        "max_tokens": weird,
        "seed": weird,
    }
    bodies = st.one_of(
        st.fixed_dictionaries({}, optional=fields),
        st.dictionaries(st.sampled_from([*fields, "min_p", "stream", ""]), weird, max_size=4),
        st.binary(max_size=40),
    )
    answered: list[int] = []

    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(bodies)
    def send(body) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, answer = request(url, "/generate", data)
        answered.append(status)
        assert status in (200, 400), (body, answer)  # never a 500 or a broken server
        if status == 400:
            assert answer["error"].startswith("bad request to /generate: "), answer

    t0 = time.monotonic()
    send()
    assert time.monotonic() - t0 < 120 and answered.count(400) >= 100, answered
    status, after = request(url, "/generate", REFERENCE)
    assert status == 200 and tokens(after) == tokens(before)


def test_every_endpoint_but_health_needs_the_key(url):
    assert request(url, "/health", key=None)[0] == 200
    ok = {"prompts": PROMPTS[:1], "max_tokens": 4}
    for key, says in [(None, "requires an API key"), ("wrong", "does not match")]:
        for path, body in [
            ("/generate", ok),
            ("/update_weights", {}),
            ("/init_weight_sync", {}),
            ("/close_weight_sync", {}),
            ("/parameters", None),
        ]:
            status, answer = request(url, path, body, key=key)
            assert status == 401 and says in answer["error"], (path, answer)
    assert request(url, "/generate", ok)[0] == 200


def test_a_trainer_of_another_model_stops_with_the_mismatch_in_seconds(url, tiny_path, monkeypatch):
    from dapo.config import RolloutConfig
    from dapo.errors import RolloutServerError
    from dapo.models import load_policy, load_tokenizer
    from dapo.models.tiny import build_model
    from dapo.parallel.sharding import full_named_parameters
    from dapo.rollout import make_engine

    monkeypatch.setenv("DAPO_SERVER_API_KEY", KEY)
    r = RolloutConfig(engine="vllm-server", server_url=url, server_timeout_s=600)
    tok = load_tokenizer(str(tiny_path))
    served = load_policy(str(tiny_path))  # the served model itself: accepted, and its push too
    eng = make_engine(r, served, tok, max_model_len=64)
    before = eng.generate(PROMPTS[:2], _params())
    eng.load_weights(full_named_parameters(served))  # every name and shape passes the check
    assert request(url, "/health", key=None)[1]["weight_version"] == eng.version >= 1
    assert [g.response_ids for g in eng.generate(PROMPTS[:2], _params())] == [
        g.response_ids for g in before
    ]
    eng.close()
    other = build_model(len(tok) + 8)  # a vocabulary extended by 8 tokens
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError) as err:
        make_engine(r, other, tok, max_model_len=64)
    assert time.monotonic() - t0 < 10
    msg = str(err.value)
    assert msg.startswith(
        f"the rollout server at {url} serves another model than the trainer's: "
        "vocabulary size 99 on the server, 107 in the trainer. The server's model "
    )
    assert (
        "has vocabulary 99, EOS 1, 38 tensors" in msg
        and "has vocabulary 107, EOS 1, 38 tensors" in msg
    )


def _params():
    from dapo.rollout import SamplingParams

    return SamplingParams(n=1, max_tokens=4, seed=1)


def test_sigterm_during_a_stuck_job_ends_the_server_within_10_s(shared, url):
    with ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(
            request, url, "/generate", {"prompts": PROMPTS[:1], "seed": HANG_SEED}, timeout=60
        )
        time.sleep(2)
        assert not stuck.done()
        status, health = request(url, "/health", key=None)
        assert status == 200 and health["status"] == "ok"  # busy, within --job-timeout-s
        t0 = time.monotonic()
        shared.proc.send_signal(signal.SIGTERM)
        code = shared.proc.wait(timeout=10)
        assert time.monotonic() - t0 < 10
        with pytest.raises(OSError):  # the connection went with the process
            stuck.result(timeout=30)
    assert code == 1
    last = shared.log.read_text().strip().splitlines()[-1]
    assert last.startswith(
        "dapo vllm-serve: error: stopped (SIGTERM received) while the engine "
        "was still running a generate job"
    ), last


def test_a_failure_inside_the_engine_gives_503s_and_a_non_zero_exit(tiny_path, tmp_path):
    server = Server(tiny_path, tmp_path, "no-vocab-check", key=None)
    url = server.ensure()
    try:
        ok = {"prompts": PROMPTS[:1], "max_tokens": 4, "seed": 1}
        assert request(url, "/generate", ok)[0] == 200
        status, answer = request(url, "/generate", {**ok, "prompts": [[5, 99999999]]})
        reason = "the engine failed during generate (IndexError: index out of range in self)"
        assert status == 503 and answer["error"] == f"the rollout server is unhealthy: {reason}"
        status, health = request(url, "/health")
        assert status == 503 and health["status"] == "unhealthy" and health["reason"] == reason
        status, answer = request(url, "/generate", ok)
        assert status == 503 and reason in answer["error"]
        assert server.proc.wait(timeout=20) == 1
        last = server.log.read_text().strip().splitlines()[-1]
        assert (
            last
            == f"dapo vllm-serve: error: {reason}; exiting so that a supervisor restarts the server"
        )
    finally:
        server.stop()


def test_multi_turn_episodes_are_generated_on_the_server(url, tiny_path):
    """run_episodes on the rollout server: each turn is one /generate for the live episodes;
    the environment's ids are appended between the model's turns; seeded, it repeats."""
    from dapo.data.tasks.calculator import CHAT_TEMPLATE
    from dapo.environments import EnvironmentPool, load_environment
    from dapo.models.tiny import build_tokenizer
    from dapo.rollout import SamplingParams
    from dapo.rollout.episodes import run_episodes
    from dapo.rollout.server_client import ServerEngine

    tok = build_tokenizer(CHAT_TEMPLATE)  # builtin:tiny's vocabulary, with a chat template
    engine = ServerEngine(url, max_model_len=256, eos_token_id=tok.eos_token_id, api_key=KEY)
    spec = load_environment(f"{Path(__file__).with_name('sample_environments.py')}:TwoTurns")
    records = [{"prompt": [{"role": "user", "content": f"Add {i}+{i}."}]} for i in range(3)]
    params = SamplingParams(n=2, max_tokens=120, seed=3)
    runs = []
    for _ in range(2):
        with EnvironmentPool(spec, num_workers=0) as pool:
            runs.append(run_episodes(engine, tok, records, params, pool, max_turns=2))
    groups = runs[0]
    assert [g.response_ids for g in groups] == [g.response_ids for g in runs[1]]
    two = [(g, i) for g in groups for i, s in enumerate(g.episode_stats) if s["turns"] == 2]
    assert two, "no episode reached its second turn"
    for g, i in two:
        mask, ids = g.model_mask[i], g.response_ids[i]
        first = ids.index(tok.eos_token_id) + 1
        assert mask[:first] == [1] * first and 0 in mask[first:] and mask[-1] == 1
        assert all(lp == 0.0 for lp, m in zip(g.logprobs[i], mask, strict=True) if not m)


def test_agent_episodes_are_sampled_on_the_server_with_the_policys_log_probs(url, tiny_path):
    """rollout.agent with vllm-server: an openai-client agent's requests (tool replies, a
    history rewrite) are sampled on the server, every episode's request of a round in one
    /generate; seeded, it repeats; the server's log-probs of each sampled token are those
    of the policy's weights (transformers, fp32), extra segments included."""
    import torch
    from transformers import AutoModelForCausalLM

    from dapo.agents import AgentHost, run_agent_episodes
    from dapo.data.tasks.calculator import CHAT_TEMPLATE
    from dapo.models.tiny import build_tokenizer
    from dapo.rollout import SamplingParams
    from dapo.rollout.server_client import ServerEngine

    tok = build_tokenizer(CHAT_TEMPLATE)  # builtin:tiny's vocabulary, with a chat template
    engine = ServerEngine(url, max_model_len=256, eos_token_id=tok.eos_token_id, api_key=KEY)
    agent = f"{Path(__file__).with_name('sample_agents.py')}:three_requests"
    records = [{"prompt": [{"role": "user", "content": f"Add {i}+{i}."}]} for i in range(3)]
    runs, calls = [], []
    for _ in range(2):
        host = AgentHost(agent, num_workers=0, timeout_s=120.0)
        try:
            params = SamplingParams(n=2, max_tokens=60, seed=3)
            runs.append(
                run_agent_episodes(engine, tok, records, params, host, max_turns=3, gather_s=5.0)
            )
            calls.append(host.engine_calls)
        finally:
            host.close()
    groups = runs[0]
    assert [g.response_ids for g in groups] == [g.response_ids for g in runs[1]]
    assert calls == [3, 3]  # 6 episodes x 3 requests: one /generate per round of requests
    stats = [s for g in groups for s in g.episode_stats]
    assert [(s["end"], s["requests"], s["segments"]) for s in stats] == [("done", 3, 2)] * 6
    segments = [
        (g.prompt_ids, g.response_ids[i], g.logprobs[i], g.model_mask[i])
        for g in groups
        for i in range(len(g.response_ids))
    ] + [
        (x["prompt_ids"], x["response_ids"], x["logprobs"], x["model_mask"])
        for s in stats
        for x in s["extra_segments"]
    ]
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    gap, sampled = 0.0, 0
    for prompt, ids, logprobs, mask in segments:
        seq = torch.tensor([list(prompt) + list(ids)])
        with torch.no_grad():
            logits = model(seq).logits[0, len(prompt) - 1 : -1].float()
        policy = torch.log_softmax(logits, -1).gather(1, seq[0, len(prompt) :, None])[:, 0]
        keep = torch.tensor(mask, dtype=torch.bool)
        if keep.any():
            gap = max(gap, float((policy - torch.tensor(logprobs))[keep].abs().max()))
        sampled += int(keep.sum())
    assert sampled > 0 and gap < 1e-4, (sampled, gap)
    assert any(0 in mask for *_, mask in segments)  # the tool replies: in the sequence, not sampled
