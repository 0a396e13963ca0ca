"""Agent episodes: unmodified OpenAI-client agents as the environment of a training run.

:class:`AgentHost` is a run's endpoint (:class:`~dapo.agents.endpoint.AgentEndpoint`) and
agent runner (:class:`~dapo.agents.runners.AgentRunner`). :func:`run_agent_episodes` plays
``params.n`` episodes per record: it starts each episode's agent with a client pointed at
the episode's base URL, then serves their requests until every agent has returned:

- requests are gathered from all live episodes and sampled in one ``engine.generate``
  call as soon as every live episode waits on a request, so that which requests share a
  call (and so what each samples) does not depend on timing; only after ``gather_s``
  seconds (2) without a new request, an agent busy on work of its own, are the waiting
  ones sampled without it. Each engine call has its own seed (the round's, mixed with the
  call's place in the round), ``max_tokens`` the largest
  cap of its requests (each reply keeps its own cap's worth, as sampling with it would);
- each request is matched against its episode's token sequence
  (:class:`~dapo.agents.tracker.Conversation`): sampled ids are kept as sampled, new
  messages appended as rendered ids, a request that extends nothing starts a segment;
- limits: ``max_turns`` requests per episode, ``params.max_tokens`` tokens after the
  prompts over the whole episode (each request's ``max_tokens`` is capped by what is left),
  ``max_length`` tokens per sequence (the engine's context), and the runner's time-out. A
  request over a limit gets an error response the agent sees, and the episode ends as
  ``env_failure`` naming the limit; so does an agent that raises, hangs or dies.

Each group's ``prompt_ids`` is the longest prefix its episodes' final segments share up to
their first non-prompt token, ``response_ids`` the rest with ``model_mask`` 1 on sampled
tokens; an episode's other segments are in ``episode_stats[i]["extra_segments"]`` (trained
as samples of their own with the episode's advantage: :func:`dapo.training.batch.build_samples`).
End reasons: ``done`` (the agent returned), ``budget`` (its last reply was cut by the
episode budget: truncated) and ``env_failure``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dapo.agents.endpoint import AgentEndpoint, Call
from dapo.agents.protocol import ApiError, completion, parse_request, split_tool_calls
from dapo.agents.runners import AgentRunner
from dapo.agents.tracker import Conversation, Prepared, Segment, message_key
from dapo.environments import (
    ChatRenderer,
    EnvironmentWarning,
    RenderError,
    ToolCall,
    parse_hermes,
    prompt_messages,
)
from dapo.errors import ConfigError
from dapo.rollout.base import Group, RolloutEngine, SamplingParams
from dapo.seeding import mix_seed
from dapo.worker_output import UserOutput

_AGENT_SEED = 0x6167656E  # "agen": the seed stream of agent engine calls


class AgentHost:
    """A run's agent endpoint and runner, kept across rounds (close it at the end)."""

    def __init__(
        self,
        agent: Any,
        *,
        num_workers: int = 1,
        timeout_s: float = 300.0,
        parser: Callable[[str], list[ToolCall]] = parse_hermes,
        model: str = "dapo-policy",
        output: UserOutput | None = None,
    ) -> None:
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"`rollout.agent_timeout_s` must be > 0 seconds, got {timeout_s!r}")
        try:
            import openai  # noqa: F401 (the agents' client)
        except ImportError:
            raise ConfigError(
                "`rollout.agent`: agents get an openai client, and the openai package is not "
                "installed. Fix: pip install 'dapo[agents]' (or pip install openai)"
            ) from None
        self.events: queue.Queue = queue.Queue()
        self.runner = AgentRunner(
            agent, self.events, num_workers=num_workers, timeout_s=timeout_s, output=output
        )
        try:
            self.endpoint = AgentEndpoint(self.events, model, wait_s=timeout_s + 60.0)
        except BaseException:
            self.runner.close()  # its workers and the thread draining their output
            raise
        self.parser, self.timeout_s = parser, float(timeout_s)
        self._renderers: dict[tuple[int, str], ChatRenderer] = {}
        self._warned: set[str] = set()  # kinds of episode failure already warned about
        # One round at a time (a round generated ahead and an evaluation share the host).
        self.lock = threading.Lock()
        self.engine_calls = 0  # every engine call made for agents (tests and metrics)

    def renderer(self, tokenizer: Any, tools: list[dict[str, Any]] | None) -> ChatRenderer:
        key = (id(tokenizer), json.dumps(tools, sort_keys=True))
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(tokenizer, tools)
        return self._renderers[key]

    def warn_failures(self, failures: Sequence[str]) -> None:
        """One warning per kind of episode failure ("raised", "timeout", "max_turns", ...)
        over the run, with its first reason: the run goes on, the user learns why."""
        for failure in failures:
            kind = failure.split(":", 1)[0]
            if kind in self._warned:
                continue
            self._warned.add(kind)
            warnings.warn(
                f"an agent episode failed and costs its sample: {failure} (warned once per "
                "kind of failure; env/failures counts them)",
                EnvironmentWarning,
                stacklevel=4,
            )

    def close(self) -> None:
        self.endpoint.close()
        self.runner.close()


@dataclass(eq=False)
class _Episode:
    group: int
    token: str
    conv: Conversation
    deadline: float
    calls: deque = field(default_factory=deque)  # requests waiting for a batch
    requests: int = 0
    tool_calls: int = 0
    text: str = ""  # the last assistant reply (what reward functions score)
    last: Segment | None = None  # the segment of the last reply
    reward: float | None = None
    end: str | None = None  # None while the agent runs
    failure: str | None = None
    over_limit: str | None = None  # the limit a request exceeded (the episode fails)
    cut_by_budget: bool = False
    seconds: float = 0.0

    def fail(self, failure: str) -> None:
        self.end, self.failure = "env_failure", failure
        for call in self.calls:
            call.answer(400, ApiError(400, f"the episode is over ({failure})").body())
        self.calls.clear()


def _record_dict(record: Any) -> Any:
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return dataclasses.asdict(record)
    return dict(record) if isinstance(record, Mapping) else record


def run_agent_episodes(
    engine: RolloutEngine,
    tokenizer: Any,
    records: Sequence[Any],
    params: SamplingParams,
    host: AgentHost,
    *,
    max_turns: int,
    max_length: int | None = None,
    gather_s: float = 2.0,
) -> list[Group]:
    """Play ``params.n`` agent episodes per record; one :class:`Group` per record, in order
    (as :func:`dapo.rollout.episodes.run_episodes` returns them)."""
    with host.lock:
        return _play(engine, tokenizer, records, params, host, max_turns, max_length, gather_s)


def _play(
    engine: RolloutEngine,
    tokenizer: Any,
    records: Sequence[Any],
    params: SamplingParams,
    host: AgentHost,
    max_turns: int,
    max_length: int | None,
    gather_s: float,
) -> list[Group]:
    now = time.monotonic()
    episodes: list[_Episode] = []
    by_token: dict[str, _Episode] = {}

    def renderer_for(tools: list[dict[str, Any]] | None) -> ChatRenderer:
        return host.renderer(tokenizer, tools)

    for g in range(len(records)):
        for _ in range(params.n):
            token = host.endpoint.new_token()
            e = _Episode(g, token, Conversation(renderer_for), now + host.timeout_s)
            episodes.append(e)
            by_token[token] = e
    loop = _Loop(engine, tokenizer, params, host, by_token, max_turns, max_length)
    try:
        for e in episodes:
            url = host.endpoint.base_url(e.token)
            host.runner.start(e.token, url, host.endpoint.key, _record_dict(records[e.group]))
            e.deadline = time.monotonic() + host.timeout_s  # a worker's start-up not included
        loop.run(gather_s)
    finally:
        for e in episodes:
            if e.end is None:
                e.fail("the run stopped the episode")
                host.runner.abandon(e.token)
        host.runner.settle()
    host.warn_failures([e.failure for e in episodes if e.failure is not None])
    return _groups(records, episodes, host.renderer(tokenizer, None))


class _Loop:
    """Serves the requests of one round's episodes until all of their agents returned."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        params: SamplingParams,
        host: AgentHost,
        by_token: dict[str, _Episode],
        max_turns: int,
        max_length: int | None,
    ) -> None:
        self.engine, self.params, self.host = engine, params, host
        self.by_token, self.max_turns, self.max_length = by_token, max_turns, max_length
        self.renderer = host.renderer(tokenizer, None)
        self.eos = self.renderer.eos_token_id
        self.live = {t for t, e in by_token.items() if e.end is None}
        # Engine calls of this round: each call's seed depends on the round's seed and its
        # place in the round only, so a resumed run or an extra evaluation samples the same.
        self.calls = 0

    def run(self, gather_s: float) -> None:
        last_event = time.monotonic()
        while self.live:
            waiting = [self.by_token[t] for t in self.live if self.by_token[t].calls]
            try:
                item = self.host.events.get(timeout=gather_s if waiting else 0.2)
            except queue.Empty:
                item = None
            if item is not None:
                self.handle(item)
                last_event = time.monotonic()
            self.time_outs()
            waiting = [e for t, e in self.by_token.items() if t in self.live and e.calls]
            if waiting and (
                len(waiting) == len(self.live) or time.monotonic() - last_event >= gather_s
            ):
                self.generate(waiting)

    def handle(self, item: Any) -> None:
        if isinstance(item, Call):
            e = self.by_token.get(item.token)
            if e is None or e.end is not None:
                item.answer(404, ApiError(404, "no such episode, or it is over").body())
                return
            e.calls.append(item)
            return
        kind, *rest = item
        if kind == "finished":
            token, reward, error, seconds = rest
            e = self.by_token.get(token)
            if e is None or e.end is not None:
                return  # an abandoned episode, or one of an earlier round
            e.seconds = seconds
            if e.over_limit is not None:
                e.fail(e.over_limit)
            elif error is not None:
                e.fail(error)
            else:
                e.reward = reward
                e.end = "budget" if e.cut_by_budget else "done"
                for call in e.calls:  # requests the agent left behind
                    call.answer(404, ApiError(404, "the episode is over").body())
                e.calls.clear()
            self.live.discard(token)
        elif kind == "worker_exit":
            tokens, text = rest
            for token in tokens:
                e = self.by_token.get(token)
                if e is not None and e.end is None:
                    e.fail(text)
                    self.live.discard(token)

    def time_outs(self) -> None:
        now = time.monotonic()
        for token in list(self.live):
            e = self.by_token[token]
            if now > e.deadline:
                e.seconds = self.host.timeout_s
                e.fail(f"timeout: the agent ran past rollout.agent_timeout_s={self.host.timeout_s}")
                self.host.runner.abandon(token)
                self.live.discard(token)

    def admit(self, e: _Episode) -> tuple[Call, Prepared, int, bool] | None:
        """The episode's next request made ready to sample: its prompt, cap and whether the
        cap is the episode's own budget; None (answered) when it is refused."""
        call = e.calls.popleft()
        budget = self.params.max_tokens
        try:
            req = parse_request(call.body, self.params.temperature, self.params.top_p)
            if e.requests >= self.max_turns:
                e.over_limit = (
                    f"max_turns: request {e.requests + 1} is over rollout.max_turns="
                    f"{self.max_turns} requests per episode"
                )
                raise ApiError(400, e.over_limit, None, "episode_limit")
            try:
                prepared = e.conv.prepare(req.messages, req.tools)
            except RenderError as exc:
                raise ApiError(400, f"messages: {exc}", "messages") from None
            left = budget - e.conv.used - len(prepared.appended)
            room = (
                math.inf if self.max_length is None else self.max_length - len(prepared.prompt_ids)
            )
            own = min(left, room)
            if own < 1:
                e.over_limit = (
                    f"budget: request {e.requests + 1} has no tokens left of the episode budget "
                    f"(rollout.max_completion_length={budget} tokens after the prompts)"
                )
                raise ApiError(400, e.over_limit, "max_tokens", "episode_limit")
        except ApiError as exc:
            call.answer(exc.status, exc.body())
            return None
        e.requests += 1
        cap = int(own if req.max_tokens is None else min(own, req.max_tokens))
        return call, prepared, cap, cap == own

    def generate(self, waiting: list[_Episode]) -> None:
        batch = []
        for e in waiting:
            ready = self.admit(e)
            if ready is not None:
                batch.append((e, *ready))
        if not batch:
            return
        seed = mix_seed(self.params.seed, _AGENT_SEED, self.calls)
        self.calls += 1
        self.host.engine_calls += 1
        params = replace(self.params, n=1, max_tokens=max(b[3] for b in batch), seed=seed)
        try:
            out = self.engine.generate([b[2].prompt_ids for b in batch], params)
        except BaseException:
            for _, call, *_ in batch:
                call.answer(500, ApiError(500, "the engine failed").body())
            raise
        for (e, call, prepared, cap, own), group in zip(batch, out, strict=True):
            ids, logprobs = list(group.response_ids[0][:cap]), list(group.logprobs[0][:cap])
            self.reply(e, call, prepared, ids, logprobs, own)

    def reply(
        self,
        e: _Episode,
        call: Call,
        prepared: Prepared,
        ids: list[int],
        logprobs: list[float],
        own: bool,
    ) -> None:
        raw = self.renderer.assistant_text(ids)
        content, calls = split_tool_calls(raw, self.host.parser)
        key = message_key({"role": "assistant", "content": content}, calls)
        e.conv.apply(prepared, ids, logprobs, self.eos, key, raw)
        eos = bool(ids) and ids[-1] == self.eos
        e.cut_by_budget = not eos and own
        e.tool_calls += len(calls)
        e.text, e.last = raw, prepared.segment
        finish = ("tool_calls" if calls else "stop") if eos else "length"
        ident = f"{e.token}-{e.requests}"
        body = completion(
            ident,
            self.host.endpoint.model,
            content,
            calls,
            finish,
            len(prepared.prompt_ids),
            len(ids),
        )
        call.answer(200, body)


def _segment_dict(s: Segment) -> dict[str, Any]:
    return {
        "prompt_ids": list(s.prompt_ids),
        "response_ids": list(s.ids),
        "logprobs": list(s.logprobs),
        "model_mask": list(s.mask),
    }


def _groups(
    records: Sequence[Any], episodes: list[_Episode], renderer: ChatRenderer
) -> list[Group]:
    groups = []
    n = len(episodes) // max(1, len(records))
    for g, record in enumerate(records):
        mine = episodes[g * n : (g + 1) * n]
        finals = [e.last for e in mine]
        seqs = [s.prompt_ids + s.ids for s in finals if s is not None]
        if seqs:
            limit = min(len(s.prompt_ids) for s in finals if s is not None)
            prefix = _common_prefix(seqs, limit)
            if not prefix:  # openings differ from their first token: the first one's
                # prompt is the group's; the episodes it does not open train their final
                # segment as an extra one.
                prefix = next(s for s in finals if s is not None).prompt_ids
                finals = [
                    s if s is not None and s.prompt_ids[: len(prefix)] == prefix else None
                    for s in finals
                ]
        else:
            try:
                prefix = renderer.opening(prompt_messages(record))
            except (RenderError, AttributeError, KeyError, TypeError):
                prefix = []
        response_ids, logprobs, masks, stats = [], [], [], []
        for e, s in zip(mine, finals, strict=True):
            if s is None:
                ids, lps, mask = [], [], []
            else:
                p = len(s.prompt_ids)
                ids = (s.prompt_ids + s.ids)[len(prefix) :]
                lps = ([0.0] * p + s.logprobs)[len(prefix) :]
                mask = ([0] * p + s.mask)[len(prefix) :]
            response_ids.append(ids)
            logprobs.append(lps)
            masks.append(mask)
            extra = [_segment_dict(x) for x in e.conv.segments if x is not s]
            stats.append(
                {
                    "turns": e.requests,
                    "requests": e.requests,
                    "segments": len(e.conv.segments),
                    "tool_calls": e.tool_calls,
                    "tool_errors": 0,
                    "env_seconds": 0.0,
                    "agent_seconds": e.seconds,
                    "env_tokens": len(mask) - sum(mask),
                    "tokens": len(ids),
                    "end": e.end,
                    "failure": e.failure,
                    "extra_segments": extra,
                }
            )
        groups.append(
            Group(
                prompt_ids=prefix,
                response_ids=response_ids,
                logprobs=logprobs,
                truncated=[e.end == "budget" for e in mine],
                model_mask=masks,
                env_rewards=[e.reward for e in mine],
                final_texts=[e.text for e in mine],
                episode_stats=stats,
            )
        )
    return groups


def _common_prefix(seqs: list[list[int]], limit: int) -> list[int]:
    first = seqs[0][:limit]
    k = len(first)
    for s in seqs[1:]:
        k = min(k, len(s))
        for i in range(k):
            if s[i] != first[i]:
                k = i
                break
    return first[:k]
