"""The teacher of on-policy distillation (``algorithm.teacher``): loaded once, checked
against the student before any training, and asked for the log-probs of the tokens the
student sampled.

Two kinds: :class:`ModelTeacher`, a frozen model in the trainer's process, scored with the
policy's own batched shared-prompt forward
(:func:`~dapo.training.forward.compute_logprobs`) in the run's precision and at the sampling
temperature, without optimizer state, optionally kept in CPU memory between scorings
(``algorithm.teacher_offload``); and :class:`ServerTeacher`, a ``dapo vllm-serve`` of the
teacher (``server:URL``), scored with ``POST /score`` (vLLM's prompt log-probs, temperature
1). :meth:`Teacher.attach` turns the scores into each sample's per-token advantages
(:func:`dapo.algorithms.distill_advantages`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from dapo import algorithms as alg
from dapo.config import Config
from dapo.errors import ModelError, RolloutServerError, TrainingError
from dapo.models import hidden_size, load_policy, load_tokenizer, packing, resolve_model_path
from dapo.models.precision import load_dtype, reference_copy, resolve_precision, set_precision
from dapo.parallel import distributed as D
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs, prompt_cache

SERVER_PREFIX = "server:"


class TeacherScorer(Protocol):
    """What scores sampled tokens: one float tensor ``[len(response_ids)]`` per sample."""

    def logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor]: ...

    def close(self) -> None: ...


class ModelTeacher:
    """A frozen teacher model in this process, on ``device`` (or in CPU memory between
    scorings with ``offload``), scored as the policy's old log-probs are."""

    def __init__(
        self,
        model: torch.nn.Module,
        options: ForwardOptions,
        device: torch.device | str = "cpu",
        offload: bool = False,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.options, self.device, self.offload = options, torch.device(device), offload
        if not offload:
            self.model.to(self.device)

    def logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        if self.offload:
            self.model.to(self.device)
        try:
            out = compute_logprobs(self.model, samples, self.options)
        finally:
            if self.offload and self.device.type != "cpu":
                self.model.to("cpu")
                torch.cuda.empty_cache()
        return [x.float().cpu() for x in out]

    def close(self) -> None:
        pass


class ServerTeacher:
    """A teacher served by ``dapo vllm-serve`` (``algorithm.teacher=server:URL``): the log-probs
    of each sample's response tokens from ``POST /score`` on prompt + response."""

    def __init__(self, client: Any) -> None:
        self.client = client  # a dapo.rollout.server_client.ServerEngine

    def logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        todo = [i for i, s in enumerate(samples) if s.response_ids]
        scores = self.client.score([samples[i].prompt_ids + samples[i].response_ids for i in todo])
        out = [torch.zeros(0) for _ in samples]
        for i, lp in zip(todo, scores, strict=True):
            out[i] = torch.tensor(lp[-len(samples[i].response_ids) :], dtype=torch.float32)
        return out

    def close(self) -> None:
        pass


class Teacher:
    """The teacher and the mixing of its signal into the samples' advantages."""

    def __init__(self, scorer: TeacherScorer, coef: float, distill_only: bool) -> None:
        self.scorer, self.coef, self.distill_only = scorer, coef, distill_only

    def attach(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Score ``samples`` (this rank's, with their old log-probs attached) and set their
        ``token_advantages``; the step's ``distill/*`` and ``perf/teacher_s`` metrics, over
        all ranks (every rank must call this)."""
        t0 = time.perf_counter()
        teacher = self.scorer.logprobs(samples) if samples else []
        seconds = time.perf_counter() - t0
        keys = ("reverse_kl", "task_abs", "teacher_abs", "teacher_logprob", "tokens")
        totals = dict.fromkeys(keys, 0.0)
        for s, t in zip(samples, teacher, strict=True):
            if s.old_logprobs is None:
                raise TrainingError("distillation needs the student's old log-probs first")
            student = s.old_logprobs.detach().float().cpu()[None]
            task = torch.tensor([0.0 if self.distill_only else float(s.advantage)])
            t = t.to(student)[None]
            s.token_advantages = alg.distill_advantages(
                task, t, student, s.sampled()[None], self.coef
            )[0]
            if self.distill_only:
                s.advantage = 0.0
            sums = alg.distill_sums(task, t, student, s.train_mask()[None], self.coef)
            for key, value in sums.items():
                totals[key] += value
        summed = dict(zip(keys, D.all_reduce_sum([totals[k] for k in keys]), strict=True))
        return {**alg.distill_metrics(summed), "perf/teacher_s": _slowest(seconds)}

    def close(self) -> None:
        self.scorer.close()


def _slowest(seconds: float) -> float:
    """The longest of the ranks' scoring times (they wait for the slowest)."""
    if not D.current().enabled:
        return seconds
    return max(float(x) for x in D.all_gather_objects(seconds))


def check_tokenizers(student: Any, teacher: Any, student_name: str, teacher_name: str) -> None:
    """Refuse a teacher whose tokenizer differs from the student's (vocabulary: every token
    and its id; special tokens: EOS, BOS, UNK and the rest, padding aside) in one message
    naming both. A cross-tokenizer method is out of scope: the teacher scores the student's
    token ids as they are."""
    problems = []
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        differ = sorted(k for k in sv.keys() | tv.keys() if sv.get(k) != tv.get(k))
        k = differ[0]
        problems.append(
            f"vocabularies of {len(sv)} and {len(tv)} tokens with {len(differ)} entries "
            f"different (e.g. {k!r}: id {sv.get(k)} in the student's, {tv.get(k)} in the "
            "teacher's)"
        )
    for role in ("eos", "bos", "unk"):
        a, b = getattr(student, f"{role}_token", None), getattr(teacher, f"{role}_token", None)
        if a != b:
            problems.append(f"{role.upper()} token {a!r} in the student's, {b!r} in the teacher's")
    pads = {student.pad_token, teacher.pad_token}
    extra_s = set(student.all_special_tokens) - pads
    extra_t = set(teacher.all_special_tokens) - pads
    if extra_s != extra_t:
        problems.append(
            f"special tokens only in the student's: {sorted(extra_s - extra_t)}, only in the "
            f"teacher's: {sorted(extra_t - extra_s)}"
        )
    if problems:
        raise TrainingError(
            f"the teacher's tokenizer ({teacher_name}, algorithm.teacher) is not the "
            f"student's ({student_name}, model.name_or_path): {'; '.join(problems)}. "
            "On-policy distillation scores the student's token ids under the teacher, so both "
            "must share one tokenizer (distilling across tokenizers is not supported); use a "
            "teacher of the student's model family"
        )


def load_teacher(cfg: Config, tokenizer: Any, log: Callable[[str], None] = print) -> Teacher | None:
    """The teacher of ``cfg.algorithm.teacher``, checked against the student's ``tokenizer``
    (None: no teacher). Every failure is one :class:`TrainingError` naming the teacher,
    raised before any training."""
    a = cfg.algorithm
    if a.teacher is None:
        return None
    name, student = a.teacher, cfg.model.tokenizer or cfg.model.name_or_path
    if name.startswith(SERVER_PREFIX):
        scorer: TeacherScorer = _server_teacher(cfg, tokenizer, name.removeprefix(SERVER_PREFIX))
        log(f"teacher: the rollout server at {name.removeprefix(SERVER_PREFIX)}")
    else:
        scorer = _model_teacher(cfg, tokenizer, name, student, log)
    return Teacher(scorer, a.distill_coef, a.distill_only)


def _model_teacher(
    cfg: Config, tokenizer: Any, name: str, student: str, log: Callable[[str], None]
) -> ModelTeacher:
    """The teacher model of ``name``: its tokenizer checked first, then its weights loaded
    in the run's precision, frozen."""
    trust = cfg.model.trust_remote_code
    try:
        path = resolve_model_path(name, log=log)
        teacher_tok = load_tokenizer(path, trust_remote_code=trust)
    except ModelError as exc:
        raise TrainingError(_named(name, exc)) from exc
    check_tokenizers(tokenizer, teacher_tok, student, name)
    cuda = torch.cuda.is_available()
    size = hidden_size(path, trust_remote_code=trust)
    precision = resolve_precision(cfg.train.precision, cuda, hidden_size=size)
    try:
        model = load_policy(path, dtype=load_dtype(precision), trust_remote_code=trust)
    except ModelError as exc:
        raise TrainingError(_named(name, exc)) from exc
    model = reference_copy(set_precision(model, precision))  # frozen, cheapest exact form
    device = f"cuda:{D.current().local_rank}" if cuda else "cpu"
    r = cfg.rollout
    whole_rows = not cfg.train.shared_prompt_forward or prompt_cache(model) is None
    packed, line = packing.choose(cfg.train.packing, model, whole_rows=whole_rows)
    options = ForwardOptions(
        tokenizer.pad_token_id,
        r.temperature,  # the student's log-probs are taken at the sampling temperature too
        cfg.train.micro_batch_tokens,
        cfg.train.logits_chunk_size,
        cfg.train.shared_prompt_forward,
        packed,
    )
    params = sum(p.numel() for p in model.parameters())
    log(f"teacher: {name} ({params:,} parameters, {precision}, on {device}); {line}")
    return ModelTeacher(model, options, device, offload=cfg.algorithm.teacher_offload and cuda)


def _server_teacher(cfg: Config, tokenizer: Any, url: str) -> ServerTeacher:
    """A client of the teacher's server, checked at connect: it answers, accepts the key,
    stops on the student's EOS, holds prompt + response, and covers the student's
    vocabulary."""
    from dapo.rollout.protocol import API_KEY_ENV
    from dapo.rollout.server_client import ServerEngine

    r = cfg.rollout
    try:
        client = ServerEngine(
            url,
            max_model_len=cfg.data.max_prompt_length + r.max_completion_length,
            eos_token_id=tokenizer.eos_token_id,
            api_key=cfg.algorithm.teacher_api_key or os.environ.get(API_KEY_ENV) or None,
            timeout_s=r.server_timeout_s,
        )
        served = client.served_fingerprint()
    except RolloutServerError as exc:
        raise TrainingError(_named(f"server:{url}", exc)) from exc
    if served.vocab_size < len(tokenizer):
        raise TrainingError(
            f"`algorithm.teacher` = 'server:{url}' serves another model than a teacher of the "
            f"student: {served.name or 'its model'} has a vocabulary of {served.vocab_size} "
            f"tokens, the student's tokenizer {len(tokenizer)}. Serve a teacher that shares "
            "the student's tokenizer"
        )
    return ServerTeacher(client)


def _named(name: str, exc: Exception) -> str:
    """A loading or connection error reworded for the teacher's fields."""
    text = str(exc)
    for student, teacher in (
        ("`model.name_or_path`", "`algorithm.teacher`"),
        ("rollout.server_api_key", "algorithm.teacher_api_key"),
        ("fix rollout.server_url", "fix algorithm.teacher"),
    ):
        text = text.replace(student, teacher)
    if text.startswith(f"`algorithm.teacher` = {name!r}"):
        return text
    return f"`algorithm.teacher` = {name!r} cannot be used: {text}"
