"""Plain-torch reference for the fused linear KL and logprob kernels: the specification.

Everything here materializes full ``[N, V]`` fp32 logits and lets torch autograd do the
backward. It exists to define the numbers the chunked and Triton paths must reproduce, and to be
the readable statement of the maths; never use it at scale.

The divergence is `megatron_sdpo.algorithms.divergence.generalized_jsd` (the generalized JSD of
the SDPO/GKD papers; alpha = 0 the forward KL(q || s), alpha = 1 the reverse KL(s || q)): this
module only adds the LM head, the temperature and the log-softmax around it, so the engines are
tested against that one definition.
"""

from __future__ import annotations

import torch

from megatron_sdpo.algorithms.divergence import generalized_jsd

from .validation import check_kl_inputs, check_logprob_inputs


def _logits_fp32(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # Upcast before the GEMM: a bf16 GEMM output rounded before the fp32 cast loses the
    # small logit differences the KL is made of.
    return (hidden.float() @ weight.float().t()) / temperature


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
        alpha: in [0, 1]; see `megatron_sdpo.algorithms.divergence`.
        temperature: logits are divided by it for both models.
        mask: optional ``[N]`` bool; masked-out tokens get loss 0 and no gradient.

    Returns:
        ``[N]`` fp32 per-token loss.
    """
    check_kl_inputs(student_hidden, teacher_hidden, student_weight, teacher_weight, alpha, temperature, mask)
    s_logp = torch.log_softmax(_logits_fp32(student_hidden, student_weight, temperature), dim=-1)
    with torch.no_grad():
        t_logp = torch.log_softmax(_logits_fp32(teacher_hidden, teacher_weight, temperature), dim=-1)
    loss = generalized_jsd(s_logp, t_logp, float(alpha))
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
