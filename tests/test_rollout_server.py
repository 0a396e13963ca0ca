"""The rollout server's HTTP API, the weight channel and the client's errors (no vLLM needed).

The server here holds a stand-in engine (``generate_many`` answers from the prompts and
seeds; a stand-in vLLM worker mixes in the real ``WeightReceiver``), so that the HTTP
layer, the batching of concurrent requests, the gloo weight channel and the client's
retries and messages are tested in seconds. ``tests/test_vllm.py`` runs the real thing:
``dapo vllm-serve`` with vLLM in a subprocess, trained against, killed and resumed.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from dapo.errors import RolloutServerError
from dapo.rollout import Group, SamplingParams
from dapo.rollout.server import RolloutServer, WeightReceiver
from dapo.rollout.server_client import ServerEngine
from dapo.rollout.weight_channel import WeightGroup, free_port

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeWorker(WeightReceiver):
    """What vLLM's worker offers the extension: a rank, a device, ``reload_weights``."""

    rank = 0
    device = torch.device("cpu")
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace()))

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        for name, tensor in weights_iterator:
            self.loaded[name] = tensor.clone()


class FakeLLM:
    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self) -> None:
        pass


class FakeEngine:
    """Responses made from the request: [prompt length, seed, prompt index], log-probs
    that need every digit of a float64."""

    max_model_len, eos_token_id, on_cpu = 64, 1, True

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.worker = FakeWorker()
        self.llm = FakeLLM(self.worker)

    def check_prompts(self, prompts: list[list[int]]) -> None:
        if any(len(p) >= self.max_model_len for p in prompts):
            raise ValueError("a prompt leaves no room for a response")

    def generate_many(self, calls):
        self.batches.append(len(calls))
        return [
            [
                Group(p, [[len(p), params.seed, i]] * params.n, [[-1 / 3, -2 / 7, -0.1]] * params.n,
                      [i % 2 == 1] * params.n)
                for i, p in enumerate(prompts)
            ]
            for prompts, params in calls
        ]  # fmt: skip

    def close(self) -> None:
        pass


@pytest.fixture
def server():
    """A RolloutServer with the stand-in engine on 127.0.0.1 (a thread)."""
    engine = FakeEngine()
    srv = RolloutServer(engine, model="fake")
    port = free_port()
    ready = threading.Event()
    thread = threading.Thread(target=srv.serve, args=("127.0.0.1", port, ready), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield srv, engine, f"http://127.0.0.1:{port}"


def client(url: str, **kw) -> ServerEngine:
    return ServerEngine(url, max_model_len=kw.pop("max_model_len", 32), eos_token_id=1, **kw)


def test_generate_over_http_returns_the_engines_groups_exactly(server):
    _, engine, url = server
    eng = client(url)
    assert eng.info["max_model_len"] == 64 and eng.info["weight_version"] == -1
    groups = eng.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, seed=11))
    assert [g.prompt_ids for g in groups] == [[5, 6, 7], [8, 9]]
    assert groups[0].response_ids == [[3, 11, 0]] * 2 and groups[1].response_ids == [[2, 11, 1]] * 2
    assert groups[0].logprobs[0] == [-1 / 3, -2 / 7, -0.1]  # JSON keeps every digit
    assert groups[0].truncated == [False, False] and groups[1].truncated == [True, True]
    assert eng.generate([], SamplingParams()) == []


def test_requests_waiting_together_are_generated_in_one_batch(server):
    srv, engine, url = server
    eng = client(url)
    gate = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        blocker = pool.submit(srv.submit, "call", gate.wait)  # the engine thread is busy
        time.sleep(0.2)
        calls = [pool.submit(eng.generate, [[r + 3] * (r + 1)], SamplingParams(n=1, seed=r))
                 for r in range(3)]  # fmt: skip
        time.sleep(0.5)  # all three wait in the queue
        gate.set()
        results = [c.result() for c in calls]
        blocker.result()
    assert engine.batches == [3]  # one vLLM batch for the three "ranks"
    for r, groups in enumerate(results):  # each got its own prompts and seed back
        assert groups[0].response_ids == [[r + 1, r, 0]]


def test_bad_request_names_the_problem_and_fails_alone(server):
    _, engine, url = server
    eng = client(url)
    with pytest.raises(RolloutServerError, match=r"answered POST /generate with 400: .*no room"):
        eng.generate([[1] * 64], SamplingParams())
    assert engine.batches == []  # rejected before reaching the engine


def test_weights_go_over_the_weight_channel(server):
    srv, engine, url = server
    eng = client(url)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    for version in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        eng.load_weights(model.named_parameters())
        assert srv.weight_version == version
        assert engine.worker.loaded.keys() == dict(model.named_parameters()).keys()
        for name, p in model.named_parameters():
            assert engine.worker.loaded[name].dtype == torch.float64
            assert torch.equal(engine.worker.loaded[name], p.detach())
    eng.close()
    assert engine.worker._dapo_group is None and eng.group is None


def test_weight_group_alone_sends_in_order():
    port = free_port()
    tensors = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.tensor([1, 2], dtype=torch.int64))]
    specs = [("a", "float32", [2, 3]), ("b", "int64", [2])]
    got: list = []

    def receiver() -> None:
        group = WeightGroup("127.0.0.1", port, 1, 2, timeout_s=30)
        got.extend(group.receive(specs))
        group.close()

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = WeightGroup("127.0.0.1", port, 0, 2, timeout_s=30)
    assert sender.send(tensors) == 6 * 4 + 2 * 8
    thread.join(30)
    sender.close()
    assert [n for n, _ in got] == ["a", "b"]
    for (_, want), (_, have) in zip(tensors, got, strict=True):
        assert torch.equal(want, have) and want.dtype == have.dtype


def test_no_server_is_a_clear_error_that_names_the_url():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError) as err:
        client(f"http://127.0.0.1:{port}", timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    msg = str(err.value)
    assert f"no rollout server answers at http://127.0.0.1:{port}" in msg
    assert "rollout.server_timeout_s = 1 s" in msg and f"dapo vllm-serve MODEL --port {port}" in msg
    with pytest.raises(RolloutServerError, match="not of the form http://HOST:PORT"):
        client("localhost")


def test_a_server_that_does_not_fit_is_refused(server):
    _, _, url = server
    with pytest.raises(RolloutServerError, match="restart it with --max-model-len 100"):
        client(url, max_model_len=100)
    with pytest.raises(RolloutServerError, match="stops generation on token 1, the trainer's tokenizer on 2"):
        ServerEngine(url, max_model_len=32, eos_token_id=2)


def test_a_server_gone_mid_run_is_retried_then_named(monkeypatch, server):
    _, _, url = server
    eng = client(url, backoff_s=0.01)
    calls = []
    real = eng._once

    def flaky(method, path, body, *, timeout):
        calls.append(path)
        if len(calls) <= 2:  # refused twice, then back
            from dapo.rollout.server_client import _Transient

            raise _Transient("ConnectionRefusedError: [Errno 111] Connection refused")
        return real(method, path, body, timeout=timeout)

    monkeypatch.setattr(eng, "_once", flaky)
    assert eng.generate([[5]], SamplingParams(n=1))[0].response_ids == [[1, 0, 0]]
    assert calls == ["/generate"] * 3
    eng.url = f"http://127.0.0.1:{free_port()}"  # now it is gone for good
    monkeypatch.setattr(eng, "_once", real)
    with pytest.raises(RolloutServerError) as err:
        eng.generate([[5]], SamplingParams(n=1))
    msg = str(err.value)
    assert f"the rollout server at {eng.url} did not answer POST /generate after 4 tries" in msg
    assert "resume=true" in msg and "dapo vllm-serve" in msg
