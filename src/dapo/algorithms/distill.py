"""On-policy distillation: a teacher's per-token log-probs as a dense advantage.

The student samples; the teacher scores each sampled token; the student is trained to
lower the per-token reverse KL to the teacher on its own samples (Agarwal et al. 2024,
GKD; Lu & Thinking Machines 2025; slime ``--use-opd``; tinker-cookbook).
"""

from __future__ import annotations

import torch


def distill_advantages(
    task_advantages: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    sampled: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """Per-token advantages ``[b, R]`` mixing the task's with the teacher's signal::

        A_t = A_task + lambda * (log pi_teacher(o_t) - log pi_student(o_t))

    ``lambda * (log pi_teacher - log pi_student)`` is minus the k1 estimate of the reverse
    KL(pi_student || pi_teacher) at the sampled token ``o_t``: positive where the teacher
    likes the token more than the student, negative where less. Each token gets its own,
    undiscounted term (no sum over future tokens, as slime and tinker-cookbook); it enters
    the policy-gradient loss as an advantage, so it is clipped like any advantage by the
    ratio's clip range (Clip-Higher included) and carries no gradient itself.

    - ``task_advantages``: ``[b]`` (one per response, the group-normalised reward; zeros
      for distillation alone) or ``[b, R]``;
    - ``teacher_logprobs``, ``student_logprobs``: ``[b, R]`` of the sampled tokens at the
      same temperature; the student's are the policy that sampled the batch (the ratio's
      old policy), detached here;
    - ``sampled``: ``[b, R]``, 1 on the tokens the model sampled, 0 on environment and tool
      tokens and padding, which carry no teacher signal (they are not in the loss either).
    """
    task = task_advantages.unsqueeze(-1) if task_advantages.dim() == 1 else task_advantages
    gap = (teacher_logprobs.detach() - student_logprobs.detach()).to(torch.float32)
    signal = coef * gap * sampled.to(torch.float32)
    return task.to(torch.float32) + signal


def distill_sums(
    task_advantages: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> dict[str, float]:
    """Sums over the loss tokens ``mask`` (``[b, R]``) for the distillation metrics, to be
    added over micro-batches and ranks before dividing: ``tokens``, ``reverse_kl`` (k1:
    log pi_student - log pi_teacher), ``teacher_logprob``, and the absolute advantage
    parts ``teacher_abs`` (``|lambda * gap|``) and ``task_abs`` (``|A_task|``)."""
    m = mask.to(torch.float32)
    task = task_advantages.unsqueeze(-1) if task_advantages.dim() == 1 else task_advantages
    kl = (student_logprobs - teacher_logprobs).to(torch.float32)
    return {
        "tokens": float(m.sum()),
        "reverse_kl": float((kl * m).sum()),
        "teacher_logprob": float((teacher_logprobs.to(torch.float32) * m).sum()),
        "teacher_abs": float((coef * kl.abs() * m).sum()),
        "task_abs": float((task.to(torch.float32).abs() * m).sum()),
    }


def distill_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``distill/reverse_kl`` and ``distill/teacher_logprob`` (means over loss tokens) and
    ``distill/teacher_share`` (the teacher's share of the summed advantage magnitude,
    ``sum|lambda * gap| / (sum|lambda * gap| + sum|A_task|)``) from :func:`distill_sums`."""
    n = max(sums["tokens"], 1.0)
    total = sums["teacher_abs"] + sums["task_abs"]
    return {
        "distill/reverse_kl": sums["reverse_kl"] / n,
        "distill/teacher_logprob": sums["teacher_logprob"] / n,
        "distill/teacher_share": sums["teacher_abs"] / total if total > 0 else 0.0,
    }
