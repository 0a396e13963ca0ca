"""The rollout server's requests, checked before anything reaches vLLM.

Every request body is checked against the :class:`Limits` the server states in ``/health``
and against the served model (:class:`~dapo.rollout.fingerprint.Fingerprint`): known
fields only, numbers of the right type and range, token ids inside the vocabulary, prompt
plus ``max_tokens`` within ``max_model_len``, weight specs that name the model's parameters
with their shapes. A failure is a :class:`RequestError` (HTTP 400) that names the field,
the value and the limit, and costs that request only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from dapo.data.images import ImagePrompt, image_of_png_text, images_of, png_text
from dapo.rollout.base import SamplingParams
from dapo.rollout.fingerprint import Fingerprint

API_KEY_ENV = "DAPO_SERVER_API_KEY"  # the key of `dapo vllm-serve --api-key`, both sides
WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "float64")
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0  # vLLM's own bound


class RequestError(ValueError):
    """A bad request (HTTP 400); the message names the field, the value and the limit."""


class Unauthorized(Exception):
    """A request without the right API key (HTTP 401)."""


class Unavailable(Exception):
    """The server cannot take work (HTTP 503): it is unhealthy or stopping."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (stated in ``/health``).

    ``max_n``: responses per prompt (``--max-n``); ``max_request_bytes``: the request body
    (``--max-request-mb``); ``job_timeout_s``: how long one engine job (a generation batch,
    a weight load) may run before the watchdog declares the engine stuck and the server
    unhealthy (``--job-timeout-s``). ``max_tokens`` follows from ``max_model_len``.
    """

    max_model_len: int
    vocab_size: int
    max_n: int = 256
    max_request_bytes: int = 64 << 20
    job_timeout_s: float = 1800.0

    @property
    def max_tokens(self) -> int:
        return self.max_model_len - 1  # a prompt has at least one token

    def to_json(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "max_n": self.max_n,
            "max_tokens": self.max_tokens,
            "max_request_bytes": self.max_request_bytes,
            "job_timeout_s": self.job_timeout_s,
        }


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body (NaN and Infinity are not numbers here)."""

    def no_constants(name: str) -> Any:
        raise RequestError(f"the request body is not valid JSON: {name} is not a number")

    try:
        body = json.loads(raw or b"{}", parse_constant=no_constants)
    except RecursionError:
        raise RequestError("the request body is not valid JSON: nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _known(body: dict[str, Any], endpoint: str, fields: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(fields))
    if unknown:
        allowed = ", ".join(fields) if fields else "none"
        raise RequestError(f"unknown field `{unknown[0]}` in {endpoint}; its fields are: {allowed}")


def _int(
    body: dict[str, Any], key: str, default: int | None, lo: int, hi: int, limit: str = ""
) -> int:
    value = body.get(key, default)
    if type(value) is not int:  # bool is an int subclass: refused too
        raise RequestError(f"`{key}` must be an integer, got {_show(value)}")
    if not lo <= value <= hi:
        where = f" ({limit})" if limit else ""
        raise RequestError(f"`{key}` = {value} is outside [{lo}, {hi}]{where}")
    return value


def _number(
    body: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    value = body.get(key, default)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise RequestError(f"`{key}` must be a finite number, got {_show(value)}")
    if value < lo or (lo_open and value == lo) or value > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise RequestError(f"`{key}` = {value!r} is outside {interval}")
    return float(value)


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


GENERATE_FIELDS = ("prompts", "images", "n", "temperature", "top_p", "top_k", "max_tokens", "seed")


def parse_generate(body: dict[str, Any], limits: Limits) -> tuple[list[list[int]], SamplingParams]:
    """``POST /generate``: the prompts and the sampling parameters, checked."""
    _known(body, "POST /generate", GENERATE_FIELDS)
    defaults = SamplingParams()
    params = SamplingParams(
        n=_int(body, "n", defaults.n, 1, limits.max_n, "max_n in /health; dapo vllm-serve --max-n"),
        temperature=_number(body, "temperature", defaults.temperature, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0, lo_open=True),
        top_k=_int(
            body,
            "top_k",
            defaults.top_k,
            0,
            limits.vocab_size,
            "0 is off; at most the vocabulary size",
        ),
        max_tokens=_int(
            body,
            "max_tokens",
            defaults.max_tokens,
            1,
            limits.max_tokens,
            f"max_tokens in /health: max_model_len {limits.max_model_len} - 1",
        ),
        seed=_int(body, "seed", defaults.seed, 0, MAX_SEED),
    )
    if "prompts" not in body:
        raise RequestError("`prompts` is missing: a list of token-id lists")
    prompts = body["prompts"]
    if not isinstance(prompts, list):
        raise RequestError(f"`prompts` must be a list of token-id lists, got {_show(prompts)}")
    for i, p in enumerate(prompts):
        _check_prompt(i, p, params.max_tokens, limits)
    if body.get("images") is not None:
        prompts = _with_images(prompts, body["images"], limits)
    return prompts, params


def image_entries(prompts: list[list[int]]) -> list[dict[str, Any] | None] | None:
    """The ``images`` field of ``POST /generate`` for ``prompts``: per prompt, None for a
    text prompt, else its unexpanded token ids (``raw``) and its images as base64 PNGs
    (``png``); None when no prompt has images."""
    if not any(images_of(p) for p in prompts):
        return None
    return [
        {"raw": list(p.raw or []), "png": [png_text(im) for im in p.images]}  # type: ignore[attr-defined]
        if images_of(p)
        else None
        for p in prompts
    ]


def _with_images(prompts: list[list[int]], entries: Any, limits: Limits) -> list[list[int]]:
    """The prompts with their images (:class:`~dapo.data.images.ImagePrompt`): ``prompts[i]``
    is the expanded form the trainer trains on, ``images[i]`` the unexpanded ids and images
    that vLLM expands itself (it must arrive at ``prompts[i]``)."""
    if not isinstance(entries, list) or len(entries) != len(prompts):
        raise RequestError(
            f"`images` must be a list with one entry per prompt ({len(prompts)}), null for a "
            f"text prompt, got {_show(entries)}"
        )
    out = []
    for i, (p, entry) in enumerate(zip(prompts, entries, strict=True)):
        if entry is None:
            out.append(p)
            continue
        if not isinstance(entry, dict) or set(entry) != {"raw", "png"}:
            raise RequestError(
                f"`images[{i}]` must be null or {{'raw': token ids, 'png': base64 PNGs}}, "
                f"got {_show(entry)}"
            )
        _check_ids(f"images[{i}].raw", entry["raw"], 0, limits)
        pngs = entry["png"]
        if not isinstance(pngs, list) or not pngs or not all(isinstance(x, str) for x in pngs):
            raise RequestError(
                f"`images[{i}].png` must be a non-empty list of base64 PNG strings, got "
                f"{_show(pngs)}"
            )
        images = []
        for j, text in enumerate(pngs):
            try:
                images.append(image_of_png_text(text))
            except ValueError as exc:
                raise RequestError(f"`images[{i}].png[{j}]`: {exc}") from None
        out.append(ImagePrompt(p, images, None, raw=entry["raw"]))  # type: ignore[arg-type]
    return out


def _check_prompt(
    i: int, prompt: Any, max_tokens: int, limits: Limits, field: str = "prompts"
) -> None:
    _check_ids(f"{field}[{i}]", prompt, max_tokens, limits)


def _check_ids(name: str, prompt: Any, max_tokens: int, limits: Limits) -> None:
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(f"`{name}` must be a non-empty list of token ids, got {_show(prompt)}")
    if not all(type(t) is int for t in prompt):
        j = next(j for j, t in enumerate(prompt) if type(t) is not int)
        raise RequestError(f"`{name}[{j}]` must be an integer token id, got {_show(prompt[j])}")
    lo, hi = min(prompt), max(prompt)
    if lo < 0 or hi >= limits.vocab_size:
        bad = lo if lo < 0 else hi
        raise RequestError(
            f"`{name}[{prompt.index(bad)}]` = {bad} is not a token id of the served model: "
            f"ids run from 0 to {limits.vocab_size - 1} (vocab_size {limits.vocab_size} in "
            "/health). Is the trainer's tokenizer the served model's?"
        )
    if len(prompt) + max_tokens > limits.max_model_len:
        raise RequestError(
            f"`{name}` has {len(prompt)} tokens: with `max_tokens` = {max_tokens} that is "
            f"{len(prompt) + max_tokens}, over the server's max_model_len of {limits.max_model_len}; "
            "shorten the prompt, lower max_tokens, or restart the server with a larger "
            "--max-model-len"
        )


def parse_score(body: dict[str, Any], limits: Limits) -> list[list[int]]:
    """``POST /score``: the token sequences (prompt + response, at least 2 tokens each) whose
    tokens ``1..`` the served model scores, checked."""
    _known(body, "POST /score", ("sequences",))
    if "sequences" not in body:
        raise RequestError("`sequences` is missing: a list of token-id lists")
    sequences = body["sequences"]
    if not isinstance(sequences, list):
        raise RequestError(f"`sequences` must be a list of token-id lists, got {_show(sequences)}")
    for i, seq in enumerate(sequences):
        _check_prompt(i, seq, 0, limits, "sequences")
        if len(seq) < 2:
            raise RequestError(
                f"`sequences[{i}]` has {len(seq)} token: scoring needs at least 2 (the first "
                "has no log-prob)"
            )
    return sequences


def parse_init_weight_sync(
    body: dict[str, Any], limits: Limits, world_size: int, device: str
) -> tuple[str, int, int, str, float]:
    """``POST /init_weight_sync``: ``(host, port, world_size, backend, timeout_s)``."""
    _known(body, "POST /init_weight_sync", ("host", "port", "world_size", "backend", "timeout_s"))
    host = body.get("host")
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        raise RequestError(f"`host` must be the trainer's address (a string), got {_show(host)}")
    port = _int(body, "port", None, 1, 65535)
    size = _int(
        body,
        "world_size",
        None,
        world_size,
        world_size,
        f"1 trainer rank + {world_size - 1} tensor-parallel workers of this server",
    )
    backend = body.get("backend", "gloo")
    allowed = ("gloo",) if device == "cpu" else ("gloo", "nccl")
    if backend not in allowed:
        raise RequestError(
            f"`backend` = {_show(backend)} is not one of {list(allowed)} (the server runs on {device})"
        )
    timeout_s = _number(body, "timeout_s", 600.0, 0.0, limits.job_timeout_s, lo_open=True)
    return host, port, size, backend, timeout_s


def parse_update_weights(body: dict[str, Any], model: Fingerprint) -> tuple[list[list[Any]], int]:
    """``POST /update_weights``: the specs ``[name, dtype, shape]`` (checked against the
    served model's parameters) and the version."""
    _known(body, "POST /update_weights", ("specs", "version"))
    version = _int(body, "version", None, 0, MAX_SEED)
    specs = body.get("specs")
    if not isinstance(specs, list) or not specs:
        raise RequestError(
            f"`specs` must be a non-empty list of [name, dtype, shape], got {_show(specs)}"
        )
    shapes = None if model.parameters is None else dict(model.parameters)
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if not (
            isinstance(spec, list)
            and len(spec) == 3
            and isinstance(spec[0], str)
            and isinstance(spec[2], list)
            and all(type(d) is int and d >= 0 for d in spec[2])
        ):
            raise RequestError(f"`specs[{i}]` must be [name, dtype, shape], got {_show(spec)}")
        name, dtype, shape = spec
        if dtype not in WEIGHT_DTYPES:
            raise RequestError(
                f"`specs[{i}]` ({name}): dtype {_show(dtype)} is not one of {list(WEIGHT_DTYPES)}"
            )
        if name in seen:
            raise RequestError(f"`specs[{i}]`: {name} is sent twice")
        seen.add(name)
        if shapes is not None and name not in shapes:
            raise RequestError(f"`specs[{i}]`: {name} is not a parameter of the served model")
        if shapes is not None and tuple(shape) != shapes[name]:
            raise RequestError(
                f"`specs[{i}]`: {name} has shape {shape}, the served model's {list(shapes[name])}"
            )
    return specs, version


def parse_close_weight_sync(body: dict[str, Any]) -> None:
    _known(body, "POST /close_weight_sync", ())
