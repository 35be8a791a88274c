"""SDPO: token-level self-distillation from a teacher that sees privileged context.

The student s = pi_theta(. | x, y_<t) and the teacher q = pi_T(. | x, c, y_<t) score the same
response tokens; the teacher prompt differs but the response columns line up token for token
(see `megatron_sdpo.interfaces.backend`). The divergence itself is defined once, in
`megatron_sdpo.algorithms.divergence`; this module applies it to logits (temperature, top-k,
masking, importance weights, normalization).

Aggregation follows the SDPO paper: mean over the masked tokens of the *global* batch
(`sum(mask * w * loss_t) / normalizer`); TRL's trainer instead averages per sequence first.
"""

from __future__ import annotations

import math

import torch

from megatron_sdpo.algorithms.divergence import (
    combine_jsd_parts,
    generalized_jsd,
    jsd_grad_scale,
    jsd_logit_grad,
    jsd_part_sums,
)
from megatron_sdpo.algorithms.reduction import as_normalizer, check_same_shape, masked_sum
from megatron_sdpo.errors import ConfigError

# Log-probabilities below this have probability exactly 0 in fp32 (exp(-1e4) == 0). Flooring them
# keeps -inf logits (padded vocabulary rows) from producing 0 * -inf = NaN in KL sums and their
# gradients, and changes no finite probability.
_LOGP_FLOOR = -1.0e4
# The top-k log-mass is clamped to at most log(1 - 1e-6): rounding in the fp32 logsumexp can put
# it at (or above) 0 when the k ids hold virtually all the mass, and log(1 - mass) would be -inf.
_TOPK_LOG_MASS_MAX = math.log1p(-1.0e-6)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2 (Maechler's log1mexp)."""
    x = x.clamp(max=_TOPK_LOG_MASS_MAX)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def token_distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float,
    topk: int | None = None,
    add_tail: bool = True,
    is_weights: torch.Tensor | None = None,
    normalizer: torch.Tensor | float | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token generalized JSD between student and teacher next-token distributions.

    Args:
        student_logits: [B, T, V] student logits at the response tokens (gets the gradient).
        teacher_logits: [B, T, V] teacher logits at the same tokens (detached here).
        mask: [B, T] 1 on tokens to distill (zero for samples without a teacher context).
        alpha: interpolation in [0, 1]: 0 = forward KL(q || s), 0.5 = JSD, 1 = reverse KL(s || q).
        topk: None for the full vocabulary, else k: the *student's* top-k ids, teacher
            log-probabilities gathered at them.
        add_tail: with topk, add one bucket log(1 - sum of the k probabilities) to each
            distribution (k + 1 outcomes); without it both are renormalized over the k ids.
        is_weights: [B, T] importance weights (detached here) multiplying the per-token loss.
        normalizer: divisor of the masked sum; defaults to mask.sum() (mean over masked tokens).
            Pass the global token count when this is one micro-batch of a larger batch.
        temperature: both logit sets are divided by it before the softmax.

    Returns:
        (loss, metrics): loss = sum(mask * w * loss_t) / normalizer, fp32 scalar, whatever the
        input dtype. Metrics (detached fp32, shares of the same normalizer):
        "sdpo/loss_per_token" (unweighted), "sdpo/student_entropy", "sdpo/teacher_entropy"
        (full-vocabulary), with topk "sdpo/topk_mass_student" / "sdpo/topk_mass_teacher" (mass of
        the student's top-k ids under each model), with is_weights "sdpo/is_weight_mean".
    """
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    check_same_shape("student_logits", student_logits, "teacher_logits", teacher_logits)
    if student_logits.dim() != 3:
        raise ValueError(f"student_logits must be [B, T, V], got shape {tuple(student_logits.shape)}")
    check_same_shape("mask", mask, "student_logits[..., 0]", student_logits[..., 0])
    vocab = student_logits.shape[-1]
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= vocab):
        raise ConfigError(f"topk must be None or an integer in [1, vocab size {vocab}], got {topk!r}")

    s = student_logits.to(torch.float32)
    t = teacher_logits.detach().to(torch.float32)
    if temperature != 1.0:
        s = s / temperature
        t = t / temperature
    logp_t_full = torch.log_softmax(t, dim=-1).clamp_min(_LOGP_FLOOR)

    norm = as_normalizer(mask.to(torch.float32).sum() if normalizer is None else normalizer, s)
    if topk is None:
        per_token, student_entropy = _FullVocabularyJSD.apply(s, logp_t_full, float(alpha))
        loss, metrics = reduce_token_loss(per_token, mask, is_weights, norm)
    else:
        logp_s_full = torch.log_softmax(s, dim=-1).clamp_min(_LOGP_FLOOR)
        ids = logp_s_full.detach().topk(topk, dim=-1).indices
        loss, metrics = topk_distillation_loss(
            logp_s_full.gather(-1, ids),
            logp_t_full.gather(-1, ids),
            mask,
            alpha=alpha,
            add_tail=add_tail,
            is_weights=is_weights,
            normalizer=norm,
        )
        student_entropy = _entropy(logp_s_full.detach())
    with torch.no_grad():
        metrics["sdpo/student_entropy"] = masked_sum(student_entropy, mask) / norm
        metrics["sdpo/teacher_entropy"] = masked_sum(_entropy(logp_t_full), mask) / norm
    return loss, metrics


class _FullVocabularyJSD(torch.autograd.Function):
    """(D_alpha per token, the student's entropy per token) from fp32 student logits z [..., V]
    and teacher log-probabilities b [..., V] (floored, no gradient).

    The value is `generalized_jsd` of the floored log-softmax; the backward is the closed form
    `jsd_grad_scale * jsd_logit_grad` (the gradient the fused kernels use) instead of autograd's
    chain through the mixture's logaddexp, the two expectations and the log-softmax: one
    elementwise pass over [..., V] where autograd kept and walked about ten (the loss's forward
    and backward 0.8x the time at 64 x 32 tokens x 718 ids, 2 threads). Flooring a log-probability changes its gradient
    from autograd's 0 to s * (...), and s = exp(floor) is 0 in fp32: the same gradient."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, b: torch.Tensor, alpha: float):
        a = torch.log_softmax(z, dim=-1).clamp_min(_LOGP_FLOOR)
        p_s, p_q = jsd_part_sums(a, b, alpha)
        ctx.save_for_backward(a, b, p_s)
        ctx.alpha = alpha
        entropy = _entropy(a)
        ctx.mark_non_differentiable(entropy)
        return combine_jsd_parts(p_s, p_q, alpha), entropy

    @staticmethod
    def backward(ctx, grad, _grad_entropy):
        a, b, p_s = ctx.saved_tensors
        scale = grad.unsqueeze(-1) * jsd_grad_scale(ctx.alpha)
        return jsd_logit_grad(a, b, ctx.alpha, p_s.unsqueeze(-1)).mul_(scale), None, None


def reduce_token_loss(
    per_token: torch.Tensor, mask: torch.Tensor, is_weights: torch.Tensor | None, norm: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum(mask * w * per_token) / norm with the loss-per-token and IS-weight metrics.
    per_token, mask, is_weights: [B, T]; norm: the global normalizer."""
    metrics: dict[str, torch.Tensor] = {}
    weighted = per_token
    if is_weights is not None:
        check_same_shape("is_weights", is_weights, "mask", mask)
        w = is_weights.detach().to(torch.float32)
        weighted = per_token * w
        metrics["sdpo/is_weight_mean"] = masked_sum(w, mask) / norm
    loss = masked_sum(weighted, mask) / norm
    with torch.no_grad():
        metrics["sdpo/loss_per_token"] = masked_sum(per_token, mask) / norm
    return loss, metrics


def topk_distillation_loss(
    top_s: torch.Tensor,
    top_t: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float,
    add_tail: bool = True,
    is_weights: torch.Tensor | None = None,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The top-k generalized JSD from the k ids' full-vocabulary log-probabilities.

    Args:
        top_s: [B, T, k] student log-probabilities (normalized over the whole vocabulary) of the
            student's top-k ids; gets the gradient.
        top_t: [B, T, k] teacher log-probabilities of the same ids (detached here).
        mask, alpha, add_tail, is_weights, normalizer: as in `token_distillation_loss`.

    This is the part of the top-k loss that needs no vocabulary: a backend whose logits are
    vocab-sharded (megatron TP) computes top_s / top_t from shards and calls this directly.
    Returns (loss, metrics) with "sdpo/topk_mass_student" / "sdpo/topk_mass_teacher".
    """
    check_same_shape("top_s", top_s, "top_t", top_t)
    check_same_shape("mask", mask, "top_s[..., 0]", top_s[..., 0])
    top_s = top_s.to(torch.float32).clamp_min(_LOGP_FLOOR)
    top_t = top_t.detach().to(torch.float32).clamp_min(_LOGP_FLOOR)
    norm = as_normalizer(mask.to(torch.float32).sum() if normalizer is None else normalizer, top_s)
    mass_s = torch.logsumexp(top_s, dim=-1, keepdim=True)
    mass_t = torch.logsumexp(top_t, dim=-1, keepdim=True)
    if add_tail:
        logp_s = torch.cat([top_s, _log1mexp(mass_s)], dim=-1)
        logp_t = torch.cat([top_t, _log1mexp(mass_t)], dim=-1)
    else:
        logp_s = top_s - mass_s
        logp_t = top_t - mass_t
    loss, metrics = reduce_token_loss(generalized_jsd(logp_s, logp_t, float(alpha)), mask, is_weights, norm)
    with torch.no_grad():
        metrics["sdpo/topk_mass_student"] = masked_sum(mass_s.squeeze(-1).exp(), mask) / norm
        metrics["sdpo/topk_mass_teacher"] = masked_sum(mass_t.squeeze(-1).exp(), mask) / norm
    return loss, metrics


def importance_weights(logp_now: torch.Tensor, logp_rollout: torch.Tensor, clip: float = 2.0) -> torch.Tensor:
    """min(exp(logp_now - logp_rollout), clip), detached fp32 [B, T].

    Corrects the distillation loss for tokens sampled by a different policy (the rollout engine,
    or the policy before earlier updates on the same batch).
    """
    if clip <= 0:
        raise ConfigError(f"importance-weight clip must be > 0, got {clip}")
    check_same_shape("logp_now", logp_now, "logp_rollout", logp_rollout)
    # Clamping in log space first avoids exp overflow to inf (min(inf, clip) is fine, but its
    # neighbours in a fused graph are not).
    d = (logp_now.detach().to(torch.float32) - logp_rollout.detach().to(torch.float32)).clamp(max=math.log(clip))
    return torch.exp(d)


def sampled_token_loss(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalizer: torch.Tensor | float,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reverse KL on the sampled tokens only: per_token = (log s(y_t) - log q(y_t)).detach() * log s(y_t).

    Its gradient is the score-function estimate of grad KL(s || q) from the sampled y_t, so it
    needs only [B, T] logprobs (no logits), e.g. when the teacher is scored by the rollout engine.

    Args:
        student_logprobs: [B, T] log s(y_t) (gets the gradient).
        teacher_logprobs: [B, T] log q(y_t) (detached).
        mask: [B, T].
        normalizer: global count of distilled tokens.
        is_weights: [B, T] optional importance weights (detached).

    Returns:
        (loss, metrics) with "sdpo/sampled_kl" = share of sum(mask * (log s - log q)), the
        per-token Monte-Carlo estimate of KL(s || q).
    """
    check_same_shape("student_logprobs", student_logprobs, "teacher_logprobs", teacher_logprobs)
    check_same_shape("student_logprobs", student_logprobs, "mask", mask)
    lp_s = student_logprobs.to(torch.float32)
    gap = (lp_s - teacher_logprobs.to(torch.float32)).detach()
    per_token = gap * lp_s
    norm = as_normalizer(normalizer, lp_s)
    metrics: dict[str, torch.Tensor] = {"sdpo/sampled_kl": masked_sum(gap, mask) / norm}
    if is_weights is not None:
        check_same_shape("is_weights", is_weights, "mask", mask)
        w = is_weights.detach().to(torch.float32)
        per_token = per_token * w
        metrics["sdpo/is_weight_mean"] = masked_sum(w, mask) / norm
    return masked_sum(per_token, mask) / norm, metrics


def distill_mask(
    response_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    reasoning_end_ids: list[int] | None,
    distill_cot: bool,
) -> torch.Tensor:
    """Which response tokens to distill: all of them, or only the answer after the reasoning.

    Args:
        response_ids: [B, T] response token ids (right-padded).
        mask: [B, T] 1 on real response tokens (typically already zero for samples without a
            teacher context).
        reasoning_end_ids: token ids of the reasoning-end marker (e.g. the ids of `</think>`);
            required when distill_cot is False.
        distill_cot: True distills every response token (the chain of thought included).

    Returns:
        [B, T] fp32 mask. With distill_cot=False, tokens up to and including the *last* complete
        occurrence of the marker (inside the masked region) are zeroed. A sample without the
        marker keeps all its tokens: in non-thinking mode, or on short tool-use traces, the whole
        response is the answer and dropping it would silently remove the sample's signal.
        (A truncated, never-closed reasoning span is therefore distilled in full.)
    """
    check_same_shape("response_ids", response_ids, "mask", mask)
    out = mask.to(torch.float32).clone()
    if distill_cot:
        return out
    if not reasoning_end_ids:
        raise ConfigError("distill_cot=False needs reasoning_end_ids (the token ids that close the reasoning span)")
    L = len(reasoning_end_ids)
    B, T = response_ids.shape
    if T < L:
        return out
    marker = torch.as_tensor(reasoning_end_ids, dtype=response_ids.dtype, device=response_ids.device)
    windows = response_ids.unfold(1, L, 1)  # [B, T - L + 1, L]
    valid = (mask != 0).unfold(1, L, 1).all(-1)
    found = (windows == marker).all(-1) & valid
    pos = torch.arange(L - 1, T, device=response_ids.device).expand(B, -1)
    last_end = torch.where(found, pos, torch.full_like(pos, -1)).amax(dim=1, keepdim=True)  # [B, 1]
    keep = torch.arange(T, device=response_ids.device).unsqueeze(0) > last_end
    return out * keep.to(torch.float32)


def random_token_keep(shape: tuple[int, ...], mask_ratio: float, seed: int) -> torch.Tensor:
    """[B, T] fp32 0/1 mask keeping each token with probability 1 - `mask_ratio` (the paper
    code's `mask_ratio`: keep where u >= mask_ratio, u ~ U[0, 1) i.i.d. per token), drawn from
    its own generator seeded with `seed` so a step's mask is reproducible and no other random
    stream moves. mask_ratio 0 keeps every token without drawing."""
    if not 0.0 <= mask_ratio < 1.0:
        raise ConfigError(f"mask_ratio must be in [0, 1), got {mask_ratio!r}")
    if mask_ratio == 0.0:
        return torch.ones(shape, dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(seed))
    return (torch.rand(shape, generator=gen, dtype=torch.float32) >= mask_ratio).to(torch.float32)
