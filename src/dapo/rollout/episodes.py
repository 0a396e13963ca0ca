"""Multi-turn episodes over any rollout engine, token-in/token-out.

:func:`run_episodes` plays ``params.n`` episodes per prompt record against an
:class:`~dapo.environments.EnvironmentPool`, turn by turn, and returns one
:class:`~dapo.rollout.base.Group` per record:

- turn 1 samples the ``n`` responses of every prompt in one engine call (the opening is
  one prompt; its prefill is shared as for single-turn groups);
- each later turn samples one continuation of every live episode in one engine call, the
  prompt being the episode's whole sequence so far; finished episodes drop out;
- between turns the environments answer all live episodes in one batched pool call, and
  their replies are rendered with the chat template and appended as ids
  (:class:`~dapo.environments.ChatRenderer`); nothing sampled is ever re-tokenized. A reply
  with images (a vision-language policy) appends its image tokens and carries the images:
  the episode's ids are then an :class:`~dapo.data.images.ImagePrompt`, so the next turn's
  prefill and the training forward put each image's features on exactly its tokens.

Only ``engine.generate`` is used, so ``hf``, ``vllm`` and ``vllm-server`` all work.

Limits. ``max_turns`` assistant turns at most; ``params.max_tokens`` (the trainer's
``rollout.max_completion_length``) is the budget of the whole episode after the prompt,
model and environment tokens together: each turn may sample what is left of it, and an
environment reply that does not fit (leaving no room for one more model token) ends the
episode. An episode ended by a limit is ``truncated``. A turn's sampling budget is the
largest left among the round's episodes (one engine call takes one ``max_tokens``); an
episode with less left keeps only its budget's worth of the sampled tokens, which is what
sampling with its own budget would have given.

End reasons (``episode_stats[i]["end"]``): ``done`` (the environment ended it),
``max_turns``, ``budget`` (both ``truncated``), ``env_failure`` (the environment raised,
hung, died or returned malformed output; ``failure`` says which), ``bad_tool_call``
(the model wrote a tool call that does not parse) and ``engine_refused`` (``truncated``: an
engine that expands images itself, vLLM, cannot take the next prompt; ``failure`` says why).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dapo.data.images import prompt_key
from dapo.environments import (
    ChatRenderer,
    EnvironmentPool,
    EnvironmentWarning,
    RenderError,
    prompt_messages,
)
from dapo.rollout.base import Group, RolloutEngine, SamplingParams
from dapo.seeding import mix_seed

END_REASONS = ("done", "max_turns", "budget", "env_failure", "bad_tool_call", "engine_refused")
_TURN_SEED = 0x7475726E  # "turn": the seed stream of turns after the first


@dataclass
class _Episode:
    group: int
    slot: int  # which of the group's n samples
    pool_id: int | None
    ids: list[int] = field(default_factory=list)  # everything after the prompt (and images)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # of each token (see Group.versions)
    text: str = ""  # the last assistant turn
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_seconds: float = 0.0
    env_tokens: int = 0
    reward: float | None = None
    end: str | None = None  # None while live
    failure: str | None = None
    truncated: bool = False

    def stats(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "env_seconds": self.env_seconds,
            "env_tokens": self.env_tokens,
            "tokens": len(self.ids),
            "end": self.end,
            "failure": self.failure,
        }


def run_episodes(
    engine: RolloutEngine,
    tokenizer: Any,
    records: Sequence[Any],
    params: SamplingParams,
    pool: EnvironmentPool,
    *,
    max_turns: int,
    renderer: ChatRenderer | None = None,
    max_prompt_length: int | None = None,
) -> list[Group]:
    """Play ``params.n`` episodes per record; one :class:`Group` per record, in order.

    Each group's ``prompt_ids`` is the opening (the environment's ``reset`` messages with
    the tools, rendered once); ``response_ids`` every token after it, ``logprobs`` the
    engine's on sampled tokens and 0.0 on environment tokens, ``model_mask`` 1 on sampled
    tokens; ``final_texts`` the last assistant turns (what reward functions score),
    ``env_rewards`` the environment's rewards (``None``: score the text) and
    ``episode_stats`` per-episode counts and the end reason. An opening longer than
    ``max_prompt_length`` tokens (reset's messages rendered with the tools) ends its episodes
    as ``env_failure``: the prompt limit holds for what the model sees.
    """
    if max_turns < 1:
        raise ValueError(f"`rollout.max_turns` must be at least 1, got {max_turns}")
    renderer = renderer or ChatRenderer(tokenizer, pool.tool_schemas)
    n, budget = params.n, params.max_tokens
    openings, episodes = _open(renderer, records, n, pool, max_prompt_length)
    live = [e for e in episodes if e.end is None]
    turn = 1
    while live:
        if turn == 1:
            # Groups all of whose episodes failed to open are not generated for.
            groups = sorted({e.group for e in live})
            out = engine.generate([openings[g] for g in groups], params)
            by_group = dict(zip(groups, out, strict=True))
            samples = [_sampled(by_group[e.group], e.slot) for e in live]
        else:
            left = max(budget - len(e.ids) for e in live)
            seed = mix_seed(params.seed, _TURN_SEED, turn)
            turn_params = replace(params, n=1, max_tokens=left, seed=seed)
            live = _sendable(engine, live, openings, pool)
            if not live:
                break
            out = engine.generate([openings[e.group] + e.ids for e in live], turn_params)
            samples = [_sampled(g, 0) for g in out]
        stepping, cut = [], []
        for e, (ids, logprobs, versions) in zip(live, samples, strict=True):
            took = _take_turn(e, ids, logprobs, budget, renderer, versions)
            (stepping if took else cut).append(e)
        if cut:
            pool.end([e.pool_id for e in cut])
            for e in cut:
                _end(e, "budget", truncated=True)
        if stepping:
            _answer(stepping, pool, renderer, budget, max_turns)
        live = [e for e in live if e.end is None]
        turn += 1
    wanted = sum(e.end == "max_turns" for e in episodes)
    if max_turns == 1 and wanted:
        pool.warn_once(
            "max_turns",
            f"environment {pool.spec.name!r}: {wanted} of {len(episodes)} episodes wanted "
            "another turn (step did not end them), but rollout.max_turns is 1, so the "
            "environment never answered the model; raise rollout.max_turns (e.g. 3) for "
            "multi-turn episodes (warned once)",
        )
    return _groups(records, openings, episodes, n)


def _open(
    renderer: ChatRenderer,
    records: Sequence[Any],
    n: int,
    pool: EnvironmentPool,
    max_prompt_length: int | None = None,
) -> tuple[list[list[int]], list[_Episode]]:
    """Reset ``n`` environments per record; each record's opening ids (its first good
    episode's) and the episodes (those whose reset failed, or opened differently, end)."""
    outcomes = pool.reset([r for r in records for _ in range(n)])
    openings: list[list[int]] = []
    episodes: list[_Episode] = []
    for g, record in enumerate(records):
        mine = outcomes[g * n : (g + 1) * n]
        opening: list[int] | None = None
        for slot, o in enumerate(mine):
            e = _Episode(group=g, slot=slot, pool_id=o.episode, env_seconds=o.seconds)
            episodes.append(e)
            if o.failure is not None:
                _end(e, "env_failure", failure=o.failure)
                continue
            try:
                ids = renderer.opening(o.messages, _images(record))
            except RenderError as exc:
                _end(e, "env_failure", failure=f"render: reset's messages: {exc}")
                pool.end([o.episode])
                continue
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                text = (
                    f"prompt: reset's opening is {len(ids)} tokens with the chat template and the "
                    f"tools, over data.max_prompt_length={max_prompt_length}; raise the limit or "
                    "shorten the opening"
                )
                warnings.warn(text, EnvironmentWarning, stacklevel=3)
                _end(e, "env_failure", failure=text)
                pool.end([o.episode])
                continue
            if opening is None:
                opening = ids
            elif prompt_key(ids) != prompt_key(opening):
                _end(
                    e,
                    "env_failure",
                    failure=(
                        "opening: reset gave this episode other messages than the first episode of "
                        "its group; the n episodes of a prompt must open alike"
                    ),
                )
                pool.end([o.episode])
        if opening is None:  # no episode opened: the record's own prompt stands in
            try:
                opening = renderer.opening(prompt_messages(record), _images(record))
            except (RenderError, AttributeError, KeyError, TypeError):
                opening = []
        openings.append(opening)
    return openings, episodes


def _images(record: Any) -> list[Any]:
    """A prompt record's images (a mapping's ``images``), for its opening's image parts."""
    images = record.get("images") if isinstance(record, dict) else getattr(record, "images", None)
    return list(images or [])


def _sendable(
    engine: Any, live: list[_Episode], openings: list[list[int]], pool: EnvironmentPool
) -> list[_Episode]:
    """The episodes whose next prompt the engine can take. An engine that expands images
    itself (vLLM) cannot take an image placeholder the policy wrote as text before a later
    image: such an episode ends there (``engine_refused``, truncated; its sample is kept)."""
    if not getattr(engine, "expands_images", False):
        return live
    from dapo.rollout.vllm_images import refusal

    refused = [(e, refusal(openings[e.group] + e.ids)) for e in live]
    ended = [e for e, why in refused if why is not None]
    if ended:
        pool.end([e.pool_id for e in ended])
        for e, why in refused:
            if why is not None:
                _end(e, "engine_refused", failure=why, truncated=True)
    return [e for e, why in refused if why is None]


def _end(e: _Episode, reason: str, *, failure: str | None = None, truncated: bool = False) -> None:
    e.end, e.failure, e.truncated = reason, failure, truncated
    e.pool_id = None


def _sampled(g: Group, j: int) -> tuple[list[int], list[float], list[int] | None]:
    """Response ``j`` of an engine's group: ids, log-probs and versions (when tagged)."""
    return g.response_ids[j], g.logprobs[j], g.versions[j] if g.versions is not None else None


def _take_turn(
    e: _Episode,
    ids: list[int],
    logprobs: list[float],
    budget: int,
    renderer: ChatRenderer,
    versions: list[int] | None = None,
) -> bool:
    """Append one sampled turn; False when it ended the episode (the budget ran out)."""
    ids, logprobs = list(ids[: budget - len(e.ids)]), list(logprobs[: budget - len(e.ids)])
    e.versions += list(versions[: len(ids)]) if versions is not None else [0] * len(ids)
    e.ids = e.ids + ids
    e.logprobs += logprobs
    e.mask += [1] * len(ids)
    e.turns += 1
    e.text = renderer.assistant_text(ids)
    # Not ended by EOS: cut by the budget (or the engine's context length).
    return bool(ids) and ids[-1] == renderer.eos_token_id


def _answer(
    stepping: list[_Episode],
    pool: EnvironmentPool,
    renderer: ChatRenderer,
    budget: int,
    max_turns: int,
) -> None:
    """The environments' answers to one turn of every stepping episode."""
    outcomes = pool.step([(e.pool_id, e.text) for e in stepping])
    release = []
    for e, o in zip(stepping, outcomes, strict=True):
        e.env_seconds += o.seconds
        e.tool_calls += o.tool_calls
        e.tool_errors += o.tool_errors
        if o.failure is not None:
            _end(e, "env_failure", failure=o.failure)
        elif o.bad_tool_call is not None:
            _end(e, "bad_tool_call", failure=o.bad_tool_call)
        elif o.done:
            e.reward = o.reward
            _end(e, "done")
        elif e.turns >= max_turns:
            release.append(e.pool_id)
            _end(e, "max_turns", truncated=True)
        else:
            start = time.perf_counter()
            try:
                reply = renderer.reply(o.messages)
            except RenderError as exc:
                release.append(e.pool_id)
                _end(e, "env_failure", failure=f"render: {exc}")
                continue
            e.env_seconds += time.perf_counter() - start
            if len(e.ids) + len(reply) >= budget:  # no room left for the model
                release.append(e.pool_id)
                _end(e, "budget", truncated=True)
                continue
            e.ids = e.ids + reply  # keeps the reply's images (list += would drop them)
            e.logprobs += [0.0] * len(reply)
            e.mask += [0] * len(reply)
            e.versions += [e.versions[-1] if e.versions else 0] * len(reply)
            e.env_tokens += len(reply)
    if release:
        pool.end(release)


def _groups(
    records: Sequence[Any], openings: list[list[int]], episodes: list[_Episode], n: int
) -> list[Group]:
    groups = []
    for g in range(len(records)):
        mine = episodes[g * n : (g + 1) * n]
        groups.append(
            Group(
                prompt_ids=openings[g],
                response_ids=[e.ids for e in mine],
                logprobs=[e.logprobs for e in mine],
                truncated=[e.truncated for e in mine],
                model_mask=[e.mask for e in mine],
                env_rewards=[e.reward for e in mine],
                final_texts=[e.text for e in mine],
                episode_stats=[e.stats() for e in mine],
                versions=[e.versions for e in mine],
            )
        )
    return groups
