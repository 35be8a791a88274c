"""The generalized Jensen-Shannon divergence of SDPO: the one definition every engine uses.

Per token, with s the student and q the teacher next-token distribution over the same outcomes:

    M   = (1 - alpha) * s + alpha * q
    D_a = (1 - alpha) * KL(s || M) + alpha * KL(q || M)      for 0 < alpha < 1
    D_0 = KL(q || s)  (forward),   D_1 = KL(s || q)  (reverse)

The interior expression tends to 0 (not to a KL) as alpha -> 0 or 1; like the SDPO and GKD code
(and TRL, Liger), the endpoints therefore *are* the two KLs, not limits. Temperature is not part
of the divergence: every caller divides both models' logits by the same temperature before the
log-softmax, and passes the resulting log-probabilities here.

The definition is split into the pieces the engines share, so that none of them re-derives it:

    mixture_log(a, b, alpha)        log M, elementwise (exactly a at alpha = 0, b at alpha = 1)
    jsd_part_sums(a, b, alpha)      (sum s (a - log M), sum q (b - log M)) over the last dim: over
                                    the whole vocabulary KL(s || M), KL(q || M); over a vocabulary
                                    tile or tensor-parallel shard partial sums that simply add up
    combine_jsd_parts(p_s, p_q, a)  the per-token divergence from the two (complete) sums
    jsd_logit_grad(a, b, alpha, R)  the gradient w.r.t. the student logits, up to `jsd_grad_scale`
    generalized_jsd(a, b, alpha)    all of the above on full-vocabulary log-probabilities

a = log s and b = log q are fp32 log-probabilities, finite (floor -inf entries first, as
`algorithms.sdpo` does for padded vocabulary rows: 0 * (-inf) would give NaN). The Triton kernel
(`megatron_sdpo_kernels.triton_kl`) necessarily restates the same expressions inside its kernel
body; the kernel tests hold it to this module through the reference engine.
"""

from __future__ import annotations

import math

import torch


def _check_alpha(alpha: float) -> None:
    # The one guard of alpha below the config (whose validation names the key): every JSD, the
    # kernels' and the vocab-parallel one included, is built from these pieces.
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


def mixture_log_coefs(alpha: float) -> tuple[float, float]:
    """(log(1 - alpha), log(alpha)), the shifts of log s and log q inside log M (-inf at the
    endpoint where a component vanishes)."""
    _check_alpha(alpha)
    return (math.log1p(-alpha) if alpha < 1.0 else float("-inf"), math.log(alpha) if alpha > 0.0 else float("-inf"))


def mixture_log(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """log M = log((1 - alpha) s + alpha q), elementwise; [..., V] -> [..., V].

    At the endpoints M is one of the two distributions, returned as is (no rounding)."""
    if alpha == 0.0:
        return a
    if alpha == 1.0:
        return b
    log_1ma, log_a = mixture_log_coefs(alpha)
    return torch.logaddexp(a + log_1ma, b + log_a)


def jsd_part_sums(a: torch.Tensor, b: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum s (a - log M), sum q (b - log M)) over the last dim; [..., V] -> ([...], [...]).

    Over the full vocabulary these are KL(s || M) and KL(q || M); over a vocabulary tile or shard
    they are the tile's share, and the shares add up. The part that vanishes identically at an
    endpoint (KL(s || s) at alpha = 0, KL(q || q) at alpha = 1) is returned as zeros without
    being evaluated."""
    _check_alpha(alpha)
    log_m = mixture_log(a, b, alpha)
    zeros = torch.zeros(a.shape[:-1], dtype=a.dtype, device=a.device)
    p_s = zeros if alpha == 0.0 else (a.exp() * (a - log_m)).sum(-1)
    p_q = zeros if alpha == 1.0 else (b.exp() * (b - log_m)).sum(-1)
    return p_s, p_q


def combine_jsd_parts(p_s: torch.Tensor, p_q: torch.Tensor, alpha: float) -> torch.Tensor:
    """The per-token divergence [...] from the complete sums of `jsd_part_sums` [...]:
    KL(q || s) = p_q at alpha = 0, KL(s || q) = p_s at alpha = 1, else (1 - a) p_s + a p_q."""
    _check_alpha(alpha)
    if alpha == 0.0:
        return p_q
    if alpha == 1.0:
        return p_s
    return (1.0 - alpha) * p_s + alpha * p_q


def generalized_jsd(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """The per-token generalized JSD, D_alpha(s, q) of the module docstring.

    Args:
        a: [..., V] fp32 student log-probabilities (normalized over the last dim; gets the gradient).
        b: [..., V] fp32 teacher log-probabilities over the same outcomes.
        alpha: in [0, 1]: 0 forward KL(q || s), 0.5 JSD, 1 reverse KL(s || q).

    Returns:
        [...] fp32 divergence, differentiable w.r.t. both inputs.
    """
    return combine_jsd_parts(*jsd_part_sums(a, b, alpha), alpha)


def jsd_grad_scale(alpha: float) -> float:
    """The factor between `jsd_logit_grad` and d D_alpha / d z (z the student logits): 1 - alpha
    inside (0, 1), 1 at the endpoints."""
    _check_alpha(alpha)
    return 1.0 - alpha if 0.0 < alpha < 1.0 else 1.0


def jsd_logit_grad(a: torch.Tensor, b: torch.Tensor, alpha: float, resid: torch.Tensor) -> torch.Tensor:
    """d D_alpha / d z over `jsd_grad_scale(alpha)`, elementwise, for z the student logits with
    a = log_softmax(z) (a temperature's 1/T is the caller's, like the scale).

    Args:
        a, b: [..., V] student / teacher log-probabilities (a tile or shard of the vocabulary is
            fine: the expression is elementwise given the global normalization).
        resid: [..., 1] the complete `jsd_part_sums` p_s of the token (KL(s || M); KL(s || q) at
            alpha = 1; unused at alpha = 0).

    Returns:
        [..., V]: s - q at alpha = 0, else s * (a - log M - resid).
    """
    if alpha == 0.0:
        return a.exp() - b.exp()
    return a.exp().mul_(a - mixture_log(a, b, alpha) - resid)
