"""The rollout server's HTTP API, the weight channel and the client's errors (no vLLM needed).

The server here holds a stand-in engine (``generate_many`` answers from the prompts and
seeds; a stand-in vLLM worker mixes in the real ``WeightReceiver``), so that the HTTP
layer, the batching of concurrent requests, the gloo weight channel and the client's
retries and messages are tested in seconds. ``tests/test_vllm.py`` runs the real thing:
``dapo vllm-serve`` with vLLM in a subprocess, trained against, killed and resumed.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from dapo.data.images import ImagePrompt
from dapo.errors import RolloutServerError
from dapo.rollout import Group, SamplingParams
from dapo.rollout.fingerprint import Fingerprint
from dapo.rollout.server import RolloutServer
from dapo.rollout.server_client import ServerEngine
from dapo.rollout.weight_channel import WeightGroup, WeightReceiver, free_port, host_store

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

    max_model_len, eos_token_id, on_cpu = 256, 1, True

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
                Group(
                    p,
                    [[len(p), params.seed, i]] * params.n,
                    [[-1 / 3, -2 / 7, -0.1]] * params.n,
                    [i % 2 == 1] * params.n,
                )
                for i, p in enumerate(prompts)
            ]
            for prompts, params in calls
        ]

    def reset_caches(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        pass


# The stand-in model: what `test_weights_go_over_the_weight_channel` pushes.
MODEL = Fingerprint(
    vocab_size=32,
    eos_token_id=1,
    name="fake",
    parameters=(("0.weight", (4, 3)), ("0.bias", (4,)), ("1.weight", (2, 4)), ("1.bias", (2,))),
)


@pytest.fixture
def server():
    """A RolloutServer with the stand-in engine on 127.0.0.1 (threads)."""
    engine = FakeEngine()
    srv = RolloutServer(engine, model="fake", fingerprint=MODEL)
    port = free_port()
    srv.start("127.0.0.1", port)
    yield srv, engine, f"http://127.0.0.1:{port}"
    srv.close()


def client(url: str, **kw) -> ServerEngine:
    return ServerEngine(url, max_model_len=kw.pop("max_model_len", 32), eos_token_id=1, **kw)


def test_generate_over_http_returns_the_engines_groups_exactly(server):
    _, engine, url = server
    eng = client(url)
    assert eng.info["max_model_len"] == 256 and eng.info["weight_version"] == -1
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
        calls = [
            pool.submit(eng.generate, [[r + 3] * (r + 1)], SamplingParams(n=1, seed=r))
            for r in range(3)
        ]
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
    with pytest.raises(
        RolloutServerError,
        match=r"answered POST /generate with 400: .*`prompts\[0\]` has 200 tokens",
    ):
        eng.generate([[1] * 200], SamplingParams(max_tokens=128))
    assert engine.batches == []  # rejected before reaching the engine


def _image_prompt(colour: tuple[int, int, int], size: tuple[int, int] = (5, 3)):
    from PIL import Image

    from dapo.data.images import ImagePrompt

    image = Image.new("RGB", size, colour)
    image.putpixel((1, 2), (1, 2, 3))
    return ImagePrompt([5, 9, 9, 9, 6], [image], None, spans=[(1, 4)], raw=[5, 9, 6])


def test_a_prompt_s_images_reach_the_engine_pixel_for_pixel_and_come_back(server):
    """Over HTTP the server gets each prompt's expanded ids (what the trainer trains on),
    its unexpanded ids and its images, exactly; the groups come back holding the
    trainer's own prompt (its images, spans and pixel source)."""
    _, engine, url = server
    seen = []
    real = engine.generate_many
    engine.generate_many = lambda calls: seen.extend(calls) or real(calls)
    prompts = [_image_prompt((200, 10, 10)), [7, 8]]
    groups = client(url).generate(prompts, SamplingParams(n=2, seed=1))
    ((got, params),) = seen
    assert isinstance(got[0], ImagePrompt) and not isinstance(got[1], ImagePrompt)
    assert list(got[0]) == [5, 9, 9, 9, 6] and got[0].raw == (5, 9, 6)
    assert [im.tobytes() for im in got[0].images] == [im.tobytes() for im in prompts[0].images]
    assert got[0].digest == prompts[0].digest and got[1] == [7, 8]
    assert groups[0].prompt_ids.spans == ((1, 4),) and groups[0].prompt_ids.raw == (5, 9, 6)
    assert groups[0].response_ids == [[5, 1, 0]] * 2


@pytest.mark.parametrize(
    ("images", "needle"),
    [
        ([{"raw": [5, 6], "png": ["bm90IGEgcG5n"]}], r"`images\[0\].png\[0\]`: not a base64 PNG"),
        ([{"raw": [5, 6], "png": []}], r"`images\[0\].png` must be a non-empty list"),
        ([{"raw": [5, 99], "png": ["x"]}], r"`images\[0\].raw\[1\]` = 99 is not a token id"),
        ([None, None], r"`images` must be a list with one entry per prompt \(1\)"),
        ([{"raw": [5]}], r"`images\[0\]` must be null or"),
    ],
)
def test_a_bad_image_entry_gets_a_400_naming_it(server, images, needle):
    _, engine, url = server
    status, answer = post(url, "/generate", {"prompts": [[5, 6, 6]], "images": images})
    assert status == 400 and re.search(needle, answer["error"]), answer
    assert engine.batches == []


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


def test_rank_0s_store_listens_before_its_port_is_given_out():
    """The trainer's side of a gloo weight channel: the store is bound (no other process can
    take its port) before any member is told the port, and the group forms on it."""
    store = host_store("127.0.0.1", 2, timeout_s=30)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))  # already taken: by the store
    got: list = []

    def receiver() -> None:
        group = WeightGroup("127.0.0.1", store.port, 1, 2, timeout_s=30)
        got.extend(group.receive([("w", "float32", [3])]))
        group.close()

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = WeightGroup("127.0.0.1", store.port, 0, 2, timeout_s=30, store=store)
    sender.send([("w", torch.tensor([1.0, 2.0, 3.0]))])
    thread.join(30)
    sender.close()
    assert [(n, t.tolist()) for n, t in got] == [("w", [1.0, 2.0, 3.0])]


def test_weight_group_alone_sends_in_order():
    port = free_port()
    tensors = [
        ("a", torch.arange(6.0).reshape(2, 3)),
        ("b", torch.tensor([1, 2], dtype=torch.int64)),
    ]
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
    with pytest.raises(RolloutServerError, match="restart it with --max-model-len 300"):
        client(url, max_model_len=300)
    with pytest.raises(
        RolloutServerError, match="stops generation on token 1, the trainer's tokenizer on 2"
    ):
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


# --- requests checked before the engine ---------------------------------------------------------


def post(url: str, path: str, body: bytes | dict, key: str | None = None) -> tuple[int, dict]:
    """One raw request: (status, JSON answer)."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(
        url + path, data=data, method="POST" if data else "GET", headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str, path: str, key: str | None = None) -> tuple[int, dict]:
    return post(url, path, b"", key)


BAD_GENERATE = [  # (body, what the 400 says); the stand-in model has 32 tokens, 256 positions
    (
        {"prompts": [[5, 99999999]]},
        "`prompts[0][1]` = 99999999 is not a token id of the served model: ids run from 0 to 31",
    ),
    ({"prompts": [[5], [-1]]}, "`prompts[1][0]` = -1 is not a token id"),
    ({"prompts": [[5]], "n": 0}, "`n` = 0 is outside [1, 256]"),
    (
        {"prompts": [[5]], "n": 100000},
        "`n` = 100000 is outside [1, 256] (max_n in /health; dapo vllm-serve --max-n)",
    ),
    ({"prompts": [[5]], "n": "2"}, '`n` must be an integer, got "2"'),
    ({"prompts": [[5]], "n": True}, "`n` must be an integer, got true"),
    ({"prompts": [[5]], "n": 2.0}, "`n` must be an integer, got 2.0"),
    ({"prompts": [[5]], "temperature": -5}, "`temperature` = -5 is outside [0, 2]"),
    ({"prompts": [[5]], "temperature": "hot"}, '`temperature` must be a finite number, got "hot"'),
    ({"prompts": [[5]], "top_p": 0}, "`top_p` = 0 is outside (0, 1]"),
    ({"prompts": [[5]], "top_k": 33}, "`top_k` = 33 is outside [0, 32]"),
    (
        {"prompts": [[5]], "max_tokens": 256},
        "`max_tokens` = 256 is outside [1, 255] (max_tokens in /health",
    ),
    ({"prompts": [[5]], "seed": -1}, "`seed` = -1 is outside [0, 9223372036854775807]"),
    (
        {"prompts": [[5] * 250], "max_tokens": 10},
        "`prompts[0]` has 250 tokens: with `max_tokens` = 10 that is 260, over the server's max_model_len of 256",
    ),
    (
        {"prompts": [[5]], "min_p": 0.1},
        "unknown field `min_p` in POST /generate; its fields are: prompts, images, n,",
    ),
    ({"prompts": "5"}, "`prompts` must be a list of token-id lists"),
    ({"prompts": [[]]}, "`prompts[0]` must be a non-empty list of token ids"),
    ({"prompts": [[5, "a"]]}, '`prompts[0][1]` must be an integer token id, got "a"'),
    ({}, "`prompts` is missing"),
    (b"[1, 2]", "the request body must be a JSON object, got list"),
    (b"{not json", "the request body is not valid JSON"),
    (b'{"prompts": [[5]], "temperature": NaN}', "NaN is not a number"),
    (b"[" * 100_000, "not valid JSON"),
]


@pytest.mark.parametrize(("body", "message"), BAD_GENERATE, ids=range(len(BAD_GENERATE)))
def test_a_bad_request_gets_a_400_naming_field_value_and_limit_and_costs_only_itself(
    server, body, message
):
    _, engine, url = server
    status, answer = post(url, "/generate", body)
    assert status == 400 and answer["error"].startswith("bad request to /generate: "), answer
    assert message in answer["error"], answer
    assert engine.batches == []  # nothing reached the engine
    status, answer = post(
        url, "/generate", {"prompts": [[5, 6]], "n": 1, "seed": 3, "max_tokens": 8}
    )
    assert status == 200 and answer["groups"][0]["response_ids"] == [[2, 3, 0]]


def test_health_states_the_limits_and_the_fingerprint(server):
    srv, _, url = server
    status, health = get(url, "/health")
    assert status == 200 and health["status"] == "ok" and health["auth"] is False
    assert health["limits"] == {
        "max_model_len": 256,
        "vocab_size": 32,
        "max_n": 256,
        "max_tokens": 255,
        "max_request_bytes": 64 << 20,
        "job_timeout_s": 1800.0,
    }
    assert health["fingerprint"] == {
        "vocab_size": 32,
        "eos_token_id": 1,
        "num_tensors": 4,
        "num_elements": 12 + 4 + 8 + 2,
        "hash": MODEL.digest,
    }
    status, params = get(url, "/parameters")
    assert status == 200 and Fingerprint.from_json(params) == MODEL


def test_a_body_over_the_limit_is_refused_unread():
    from dapo.rollout.protocol import Limits

    srv = RolloutServer(
        FakeEngine(), model="fake", fingerprint=MODEL, limits=Limits(256, 32, max_request_bytes=100)
    )
    port = free_port()
    srv.start("127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}"
        body = {"prompts": [[5] * 40]}
        status, answer = post(url, "/generate", body)
        size = len(json.dumps(body))  # 135
        assert (
            status == 400
            and f"the request body of {size} bytes is over the server's limit of 100 bytes"
            in answer["error"]
        )
        assert post(url, "/generate", {"prompts": [[5]], "max_tokens": 4})[0] == 200
    finally:
        srv.close()


def test_weight_requests_are_checked(server):
    _, _, url = server
    status, answer = post(
        url, "/update_weights", {"specs": [["0.bias", "float32", [4]]], "version": 1}
    )
    assert status == 400 and "call /init_weight_sync first" in answer["error"]
    cases = [
        (
            {"host": "127.0.0.1", "port": 1234, "world_size": 3},
            "`world_size` = 3 is outside [2, 2] (1 trainer rank + 1 tensor-parallel workers",
        ),
        (
            {"host": "127.0.0.1", "port": 1234, "world_size": 2, "backend": "nccl"},
            "`backend` = \"nccl\" is not one of ['gloo'] (the server runs on cpu)",
        ),
        (
            {"host": "127.0.0.1", "port": 70000, "world_size": 2},
            "`port` = 70000 is outside [1, 65535]",
        ),
        (
            {"host": "127.0.0.1", "port": 1234, "world_size": 2, "timeout_s": 1e9},
            "`timeout_s` = 1000000000.0 is outside (0, 1800]",
        ),
        ({"host": 5, "port": 1234, "world_size": 2}, "`host` must be the trainer's address"),
        ({"host": "h", "port": 1, "world_size": 2, "rank": 0}, "unknown field `rank`"),
    ]
    for body, message in cases:
        status, answer = post(url, "/init_weight_sync", body)
        assert status == 400 and message in answer["error"], answer


def test_a_push_of_other_shapes_is_refused_and_does_not_hang(server):
    srv, engine, url = server
    eng = client(url)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))  # 5, not 4
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError) as err:
        eng.load_weights(model.named_parameters())
    assert time.monotonic() - t0 < 20
    msg = str(err.value)
    assert "answered POST /update_weights with 400" in msg
    assert (
        "0.weight has shape [5, 3], the served model's [4, 3] (the server left the weight group)"
        in msg
    )
    assert engine.worker.loaded == {} and srv.weight_version == -1


def test_every_endpoint_but_health_needs_the_api_key():
    srv = RolloutServer(FakeEngine(), model="fake", fingerprint=MODEL, api_key="s3cret")
    port = free_port()
    srv.start("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    try:
        assert get(url, "/health")[0] == 200 and get(url, "/health")[1]["auth"] is True
        body = {"prompts": [[5]], "max_tokens": 4}
        for path, payload in [
            ("/generate", body),
            ("/init_weight_sync", {}),
            ("/update_weights", {}),
            ("/close_weight_sync", {}),
            ("/parameters", b""),
        ]:
            status, answer = post(url, path, payload)
            assert status == 401 and "requires an API key" in answer["error"], (path, answer)
            status, answer = post(url, path, payload, key="wrong")
            assert status == 401 and "does not match" in answer["error"], (path, answer)
        assert post(url, "/generate", body, key="s3cret")[0] == 200
        with pytest.raises(RolloutServerError) as err:  # a trainer without the key: at connect
            client(url)
        assert "answered GET /parameters with 401" in str(err.value)
        assert "rollout.server_api_key=KEY or the DAPO_SERVER_API_KEY environment variable" in str(
            err.value
        )
        assert (
            client(url, api_key="s3cret")
            .generate([[5]], SamplingParams(max_tokens=4))[0]
            .response_ids
        )
    finally:
        srv.close()


# --- a failing or stuck engine, stopping ----------------------------------------------------


class BrokenEngine(FakeEngine):
    """Raises inside generation (``fail``) or blocks until ``release`` is set (``stuck``)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.release = mode, threading.Event()

    def generate_many(self, calls):
        if any(params.seed == 666 for _, params in calls):
            if self.mode == "fail":
                raise IndexError("index out of range in self")
            self.release.wait(60)
        return super().generate_many(calls)


def broken_server(mode: str, **kw):
    from dapo.rollout.protocol import Limits

    engine = BrokenEngine(mode)
    limits = Limits(256, 32, job_timeout_s=kw.pop("job_timeout_s", 1800.0))
    srv = RolloutServer(engine, model="fake", fingerprint=MODEL, limits=limits, **kw)
    port = free_port()
    srv.start("127.0.0.1", port)
    return srv, engine, f"http://127.0.0.1:{port}"


def wait_in_thread(srv):
    pool = ThreadPoolExecutor(1)
    return pool.submit(srv.wait)


def test_an_engine_failure_makes_the_server_unhealthy_then_it_exits():
    srv, engine, url = broken_server("fail", exit_after_s=1.0)
    waited = wait_in_thread(srv)
    ok = {"prompts": [[5]], "max_tokens": 4}
    assert post(url, "/generate", ok)[0] == 200
    status, answer = post(url, "/generate", {**ok, "seed": 666})
    reason = "the engine failed during generate (IndexError: index out of range in self)"
    assert status == 503 and answer["error"] == f"the rollout server is unhealthy: {reason}"
    status, health = get(url, "/health")
    assert status == 503 and health["status"] == "unhealthy" and health["reason"] == reason
    status, answer = post(url, "/generate", ok)  # every later request: 503, naming it
    assert status == 503 and reason in answer["error"]
    t0 = time.monotonic()
    code, message = waited.result(timeout=10)
    assert code == 1 and message == f"{reason}; exiting so that a supervisor restarts the server"
    assert time.monotonic() - t0 < 3


def test_the_watchdog_declares_a_stuck_engine_unhealthy():
    srv, engine, url = broken_server("stuck", job_timeout_s=0.5, exit_after_s=0.5)
    waited = wait_in_thread(srv)
    t0 = time.monotonic()
    status, answer = post(url, "/generate", {"prompts": [[5]], "max_tokens": 4, "seed": 666})
    assert time.monotonic() - t0 < 5
    assert (
        status == 503
        and "one generate job has run for 1 s, over the limit of 0.5 s" in answer["error"]
    )
    assert "(dapo vllm-serve --job-timeout-s): the engine is stuck" in answer["error"]
    assert waited.result(timeout=10)[0] == 1
    engine.release.set()


def test_stopping_with_a_stuck_engine_takes_seconds(monkeypatch):
    from dapo.rollout import server as server_module

    monkeypatch.setattr(server_module, "STOP_WAIT_S", 1.0)
    srv, engine, url = broken_server("stuck")
    waited = wait_in_thread(srv)
    with ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(
            post, url, "/generate", {"prompts": [[5]], "max_tokens": 4, "seed": 666}
        )
        time.sleep(0.5)
        queued = pool.submit(post, url, "/generate", {"prompts": [[5]], "max_tokens": 4})
        time.sleep(0.2)
        t0 = time.monotonic()
        srv.stop("SIGTERM received")
        code, message = waited.result(timeout=10)
        assert time.monotonic() - t0 < 3
        assert code == 1 and message.startswith(
            "stopped (SIGTERM received) while the engine was still running a generate job"
        )
        engine.release.set()
        assert stuck.result(timeout=10)[0] == 200  # it finished after all; the reply still went out
        assert queued.result(timeout=10)[0] == 503


def test_an_unhealthy_server_is_reported_at_once_not_after_the_timeout():
    srv, engine, url = broken_server("fail")
    eng = client(url, timeout_s=600)
    srv.fail("the engine failed during generate (IndexError: index out of range in self)")
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError) as err:
        eng.generate([[5]], SamplingParams(max_tokens=4))
    with pytest.raises(RolloutServerError) as at_connect:
        client(url, timeout_s=600)
    assert time.monotonic() - t0 < 5
    assert (
        "answered POST /generate with 503: the rollout server is unhealthy: the engine failed"
        in str(err.value)
    )
    assert "resume=true" in str(err.value)
    assert "answered GET /health with 503: the engine failed during generate" in str(
        at_connect.value
    )
    srv.stop("test")
    srv.wait()


# --- the trainer checks it talks to its model --------------------------------------------------


def test_a_client_of_another_model_stops_naming_both(server):
    _, _, url = server
    other = Fingerprint(
        32,
        1,
        (("0.weight", (4, 3)), ("0.bias", (4,)), ("1.weight", (3, 4)), ("1.bias", (3,))),
        name="mine",
    )
    with pytest.raises(RolloutServerError) as err:
        client(url, policy=other)
    msg = str(err.value)
    assert (
        f"the rollout server at {url} serves another model than the trainer's: 1.weight is [2, 4] on the server, [3, 4] in the trainer"
        in msg
    )
    assert (
        f"The server's model fake has vocabulary 32, EOS 1, 4 tensors (26 elements, hash {MODEL.digest})"
        in msg
    )
    assert (
        f"the trainer's mine has vocabulary 32, EOS 1, 4 tensors (31 elements, hash {other.digest})"
        in msg
    )
    assert "Serve the trainer's model (dapo vllm-serve mine --port" in msg
    extended = Fingerprint(40, 1, MODEL.parameters, name="mine")
    with pytest.raises(
        RolloutServerError, match="vocabulary size 32 on the server, 40 in the trainer"
    ):
        client(url, policy=extended)
    assert (
        client(url, policy=Fingerprint(32, 1, MODEL.parameters, name="mine")).info["status"] == "ok"
    )


def test_the_policy_fingerprint_is_the_model_directorys_also_with_lora(tmp_path):
    from dapo.config import LoraConfig
    from dapo.models import lora
    from dapo.models.tiny import build_model, build_tokenizer
    from dapo.rollout.fingerprint import of_model_dir, of_module

    model = build_model(len(build_tokenizer()), seed=0)
    model.save_pretrained(tmp_path)
    served = of_model_dir(tmp_path, 1)
    assert served.vocab_size == model.config.vocab_size and served.parameters
    assert of_module(model, 1) == Fingerprint(served.vocab_size, 1, served.parameters, name="")
    lora.apply_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=["all-linear"]))
    assert any("lora_A" in n for n, _ in model.named_parameters())
    assert of_module(model, 1, name="x").parameters == served.parameters  # the pushed names
    bigger = build_model(len(build_tokenizer()) + 8, seed=0)
    assert (
        served.difference(of_module(bigger, 1))
        == f"vocabulary size {served.vocab_size} on the server, {served.vocab_size + 8} in the trainer"
    )


def test_a_vision_model_directory_s_fingerprint_is_its_policy_s(tmp_path):
    from dapo.models import tiny_vlm
    from dapo.rollout.fingerprint import of_model_dir, of_module

    processor = tiny_vlm.build_processor()
    model = tiny_vlm.build_model(processor, seed=0)
    model.save_pretrained(tmp_path)
    served = of_model_dir(tmp_path, 1)
    assert served.parameters and any(
        n.startswith("model.vision_model") for n, _ in served.parameters
    )
    assert of_module(model, 1, name="") == Fingerprint(served.vocab_size, 1, served.parameters)


def test_the_trainer_takes_the_key_from_the_config_or_the_environment_and_never_writes_it(
    monkeypatch,
):
    from dataclasses import replace

    from dapo.config import load_config
    from dapo.rollout import make_engine

    srv = RolloutServer(FakeEngine(), model="fake", fingerprint=MODEL, api_key="s3cret")
    port = free_port()
    srv.start("127.0.0.1", port)
    try:
        policy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        policy.config = SimpleNamespace(vocab_size=32, _name_or_path="mine")  # what of_module reads
        tok = SimpleNamespace(eos_token_id=1, pad_token_id=0)
        cfg = load_config(
            None,
            [
                "rollout.engine=vllm-server",
                f"rollout.server_url=http://127.0.0.1:{port}",
                "rollout.server_api_key=s3cret",
            ],
        )
        monkeypatch.delenv("DAPO_SERVER_API_KEY", raising=False)
        eng = make_engine(cfg.rollout, policy, tok, max_model_len=32)
        assert eng.generate([[5]], SamplingParams(max_tokens=4))[0].response_ids == [[1, 0, 0]]
        assert "s3cret" not in cfg.to_yaml() and "server_api_key: null" in cfg.to_yaml()
        assert (
            cfg.to_dict()["rollout"]["server_api_key"] is None
            and cfg.rollout.server_api_key == "s3cret"
        )
        keyless = replace(cfg.rollout, server_api_key=None)
        with pytest.raises(RolloutServerError, match="answered GET /parameters with 401"):
            make_engine(keyless, policy, tok, max_model_len=32)
        monkeypatch.setenv("DAPO_SERVER_API_KEY", "s3cret")
        assert make_engine(keyless, policy, tok, max_model_len=32).info["auth"] is True
    finally:
        srv.close()


def test_vllm_serve_listens_on_127_0_0_1_by_default_and_a_taken_port_fails_at_once(capsys):
    import socket

    from dapo.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        assert main(["vllm-serve", "builtin:tiny", "--port", str(port)]) == 1
    assert time.monotonic() - t0 < 5  # before the engine is built
    err = capsys.readouterr().err.strip()
    assert err == (
        f"dapo: error: cannot listen on 127.0.0.1:{port} (Address already in use): "
        "choose another --port, or stop what listens there"
    )
