"""Plain-torch reference for the fused linear KL and logprob kernels: the specification.

Everything here materializes full ``[N, V]`` fp32 logits and lets torch autograd do the
backward. It exists to define the numbers the chunked and Triton paths must reproduce, and to be
the readable statement of the maths; never use it at scale.

Loss convention (the generalized JSD of the SDPO/GKD papers, per token, s = student, q = teacher):

    M = (1 - alpha) * s + alpha * q
    loss = (1 - alpha) * KL(s || M) + alpha * KL(q || M)

alpha = 0 is computed exactly as the forward KL(q || s) and alpha = 1 as the reverse KL(s || q)
(the mixture formula degenerates to 0 at the endpoints, so they are special-cased, not limits).
"""
from __future__ import annotations

import math

import torch

from .validation import check_kl_inputs, check_logprob_inputs


def _logits_fp32(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # Upcast before the GEMM: a bf16 GEMM output rounded before the fp32 cast loses the
    # small logit differences the KL is made of.
    return (hidden.float() @ weight.float().t()) / temperature


def generalized_jsd_from_logprobs(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, alpha: float
) -> torch.Tensor:
    """Per-row generalized JSD between two log-distributions.

    Args:
        student_logp: ``[N, V]`` fp32 log-probabilities of the student.
        teacher_logp: ``[N, V]`` fp32 log-probabilities of the teacher.
        alpha: interpolation in ``[0, 1]`` (0 forward KL(q||s), 1 reverse KL(s||q)).

    Returns:
        ``[N]`` fp32 loss per row.
    """
    if alpha == 0.0:
        return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    if alpha == 1.0:
        return (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)
    log_m = torch.logaddexp(student_logp + math.log1p(-alpha), teacher_logp + math.log(alpha))
    kl_s = (student_logp.exp() * (student_logp - log_m)).sum(-1)
    kl_q = (teacher_logp.exp() * (teacher_logp - log_m)).sum(-1)
    return (1.0 - alpha) * kl_s + alpha * kl_q


def reference_linear_kl(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    alpha: float,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token generalized JSD from hidden states and LM-head weights (materializes logits).

    Args:
        student_hidden: ``[N, H]`` student hidden states (gets gradients).
        teacher_hidden: ``[N, H]`` teacher hidden states (treated as constant).
        student_weight: ``[V, H]`` student LM head (gets gradients).
        teacher_weight: ``[V, H]`` teacher LM head (treated as constant).
        alpha: see the module docstring.
        temperature: logits are divided by it for both models.
        mask: optional ``[N]`` bool; masked-out tokens get loss 0 and no gradient.

    Returns:
        ``[N]`` fp32 per-token loss.
    """
    check_kl_inputs(student_hidden, teacher_hidden, student_weight, teacher_weight, alpha, temperature, mask)
    s_logp = torch.log_softmax(_logits_fp32(student_hidden, student_weight, temperature), dim=-1)
    with torch.no_grad():
        t_logp = torch.log_softmax(_logits_fp32(teacher_hidden, teacher_weight, temperature), dim=-1)
    loss = generalized_jsd_from_logprobs(s_logp, t_logp, float(alpha))
    if mask is not None:
        loss = torch.where(mask, loss, torch.zeros_like(loss))
    return loss


def reference_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probability of ``labels`` and entropy of the softmax (materializes logits).

    Args:
        hidden: ``[N, H]`` hidden states.
        weight: ``[V, H]`` LM head.
        labels: ``[N]`` int64 token ids in ``[0, V)``.
        temperature: logits are divided by it.
        mask: optional ``[N]`` bool; masked-out tokens return 0 for both outputs.

    Returns:
        ``(logprobs [N], entropy [N])``, both fp32 and differentiable.
    """
    check_logprob_inputs(hidden, weight, labels, temperature, mask)
    logp = torch.log_softmax(_logits_fp32(hidden, weight, temperature), dim=-1)
    # Masked tokens may carry an ignore index such as -100: clamp so gather stays in range.
    safe = labels.long().clamp(0, weight.shape[0] - 1)
    lp = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    if mask is not None:
        lp = torch.where(mask, lp, torch.zeros_like(lp))
        ent = torch.where(mask, ent, torch.zeros_like(ent))
    return lp, ent
