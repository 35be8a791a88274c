"""GRPO: group-relative advantages and the clipped policy-gradient loss.

Conventions shared with the backends (see `megatron_sdpo.interfaces.backend`):
- samples of one prompt are grouped consecutively (prompt 0's n samples, then prompt 1's ...);
- a loss returns the micro-batch's *share* `sum(per_token) / normalizer`; with `normalizer` the
  number of loss tokens in the whole global batch, adding the shares of all micro-batches and
  ranks gives the token-mean over the global batch (the "token-mean" aggregation of DAPO/verl);
- metrics are shares too (`sum(metric_t) / normalizer`), except those whose name ends in `_max`
  or `_min`, which reduce by max / min (see `losses.metric_reduce`).
"""

from __future__ import annotations

import torch

from megatron_sdpo.algorithms.reduction import (
    as_normalizer,
    check_same_shape,
    masked_max,
    masked_min,
    masked_sum,
)
from megatron_sdpo.errors import ConfigError

# exp() of a log-ratio beyond this is either inf or a sign of a broken rollout; clamping (as verl
# does) keeps one bad token from producing inf * 0 = NaN in the backward pass.
_LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards: torch.Tensor, *, group_size: int, norm_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards: [G*n] rewards, the n samples of each prompt consecutive.
        group_size: n, samples per prompt.
        norm_by_std: divide by (group std + eps) (GRPO) or not (Dr. GRPO / RLOO-style mean only).
        eps: added to the std.

    Returns:
        [G*n] fp32: reward - group mean, optionally / (std + eps). The std is the *unbiased*
        (Bessel-corrected) sample std, as torch.std / verl / TRL compute it; a group of one sample
        has no spread and gets advantage 0. A group whose rewards are all equal gets exactly 0
        (not a rounding residue divided by eps).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size must be a positive integer, got {group_size!r}")
    if eps < 0:
        raise ConfigError(f"eps must be >= 0, got {eps}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [G*n], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} (group_size must divide the batch)"
        )
    r = rewards.detach().to(torch.float32).view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if norm_by_std and group_size > 1:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalizer: torch.Tensor | float,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with decoupled clip range, k3 KL and truncated importance sampling.

    With dual_clip = c (> 1), tokens with a negative advantage are further bounded by -A * c
    (dual-clip PPO): a huge ratio on a bad token cannot make an unbounded step.

    per_token = tis_w * max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)) + kl_coef * k3
    with r = exp(logprobs - old_logprobs), k3 = exp(ref - lp) - (ref - lp) - 1 (Schulman's
    unbiased, non-negative KL(pi || ref) estimator) and tis_w = min(exp(old - rollout), tis_cap),
    detached: it corrects for the sampler (e.g. vLLM in bf16) and the trainer disagreeing on the
    probabilities of the sampled tokens.

    Args:
        logprobs: [B, T] current policy logprobs of the sampled tokens (carries the gradient).
        old_logprobs: [B, T] logprobs of the policy that the advantages belong to (detached).
        advantages: [B] (one per sample) or [B, T] (per token).
        mask: [B, T] 1 on loss tokens.
        normalizer: global count of loss tokens (token-mean over the global batch).
        clip_low, clip_high: ratio clip range [1 - clip_low, 1 + clip_high] (DAPO's clip-higher).
        ref_logprobs: [B, T] reference logprobs; required when kl_coef > 0.
        kl_coef: weight of the k3 KL term.
        rollout_logprobs: [B, T] the sampler's logprobs; required when tis_cap is set.
        tis_cap: cap of the truncated importance weight; None disables TIS.
        dual_clip: the dual-clip bound c > 1 for negative advantages; None disables it.

    Returns:
        (loss, metrics): loss = sum(mask * per_token) / normalizer (fp32 scalar); metrics are
        detached fp32 scalars: "grpo/pg_loss", "grpo/clip_frac" (tokens where the clipped branch
        is active), "grpo/clip_frac_low", "grpo/clip_frac_high", "grpo/approx_kl" (k3 of the
        old policy to the current one), "grpo/ratio_mean", "grpo/ratio_max", "grpo/ratio_min",
        "grpo/kl" (k3 to the reference, when given) and "grpo/tis_weight_mean" (when TIS is on).
    """
    if clip_low < 0 or clip_low >= 1:
        raise ConfigError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ConfigError(f"clip_high must be >= 0, got {clip_high}")
    if kl_coef < 0:
        raise ConfigError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ConfigError("kl_coef > 0 needs ref_logprobs (the reference model's logprobs)")
    if tis_cap is not None and tis_cap <= 0:
        raise ConfigError(f"tis_cap must be > 0 or None, got {tis_cap}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ConfigError(f"dual_clip must be > 1 or None, got {dual_clip}")
    if tis_cap is not None and rollout_logprobs is None:
        raise ConfigError("tis_cap is set but rollout_logprobs (the sampler's logprobs) were not given")
    check_same_shape("logprobs", logprobs, "old_logprobs", old_logprobs)
    check_same_shape("logprobs", logprobs, "mask", mask)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")

    lp = logprobs.to(torch.float32)
    old = old_logprobs.detach().to(torch.float32)
    adv = advantages.detach().to(torch.float32)
    if adv.dim() == 1:
        if adv.shape[0] != lp.shape[0]:
            raise ValueError(f"advantages has {adv.shape[0]} entries for a batch of {lp.shape[0]}")
        adv = adv.unsqueeze(-1)
    else:
        check_same_shape("advantages", adv, "logprobs", lp)
    norm = as_normalizer(normalizer, lp)

    log_ratio = (lp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * clipped
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (pg > bound)
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)

    metrics: dict[str, torch.Tensor] = {}
    if tis_cap is not None and rollout_logprobs is not None:  # both or neither (checked above)
        check_same_shape("rollout_logprobs", rollout_logprobs, "logprobs", lp)
        tis_log = (old - rollout_logprobs.detach().to(torch.float32)).clamp(max=_LOG_RATIO_CLAMP)
        tis_w = torch.exp(tis_log).clamp(max=tis_cap)
        pg = pg * tis_w
        metrics["grpo/tis_weight_mean"] = masked_sum(tis_w, mask).detach() / norm

    per_token = pg
    pg_loss = masked_sum(pg, mask) / norm
    if ref_logprobs is not None:
        check_same_shape("ref_logprobs", ref_logprobs, "logprobs", lp)
        d = (ref_logprobs.detach().to(torch.float32) - lp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        k3 = torch.exp(d) - d - 1.0
        metrics["grpo/kl"] = masked_sum(k3, mask).detach() / norm
        if kl_coef > 0:
            per_token = per_token + kl_coef * k3
    loss = masked_sum(per_token, mask) / norm

    with torch.no_grad():
        # The clipped branch is the active one exactly where it is strictly larger.
        active = (pg_clipped > pg_unclipped).to(torch.float32)
        low = active * (ratio < 1.0 - clip_low).to(torch.float32)
        high = active * (ratio > 1.0 + clip_high).to(torch.float32)
        neg_log_ratio = -log_ratio
        metrics.update(
            {
                "grpo/pg_loss": pg_loss.detach(),
                "grpo/clip_frac": masked_sum(active, mask) / norm,
                "grpo/clip_frac_low": masked_sum(low, mask) / norm,
                "grpo/clip_frac_high": masked_sum(high, mask) / norm,
                "grpo/approx_kl": masked_sum(torch.exp(neg_log_ratio) - neg_log_ratio - 1.0, mask) / norm,
                "grpo/ratio_mean": masked_sum(ratio, mask) / norm,
                "grpo/ratio_max": masked_max(ratio, mask),
                "grpo/ratio_min": masked_min(ratio, mask),
            }
        )
        if dual_clip is not None:
            metrics["grpo/clip_frac_dual"] = masked_sum(dual_active.to(torch.float32), mask) / norm
    return loss, metrics
