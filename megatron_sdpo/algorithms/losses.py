"""LossFn adapters (see `megatron_sdpo.interfaces.backend.LossFn`) that the backends call.

Each adapter declares the model outputs it needs (`requires`), computes its global normalizer
from the batch's tensors, and maps (outputs, tensors, normalizer) to the pure maths of
`grpo` / `sdpo`. Losses and metrics are shares: the backend adds them over micro-batches and
ranks (metrics with `metric_reduce(name)`), which gives global token means.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from megatron_sdpo.algorithms.grpo import policy_loss
from megatron_sdpo.algorithms.reduction import as_normalizer
from megatron_sdpo.algorithms.sdpo import (
    importance_weights,
    reduce_token_loss,
    sampled_token_loss,
    token_distillation_loss,
    topk_distillation_loss,
)
from megatron_sdpo.interfaces.distillation import DistillationSpec, TopkSource

SDPO_VARIANTS = ("logits", "sampled")


def metric_reduce(name: str) -> str:
    """How a metric of these losses combines over micro-batches and ranks: "max" for names ending
    in `_max`, "min" for `_min`, otherwise "sum" (the metric is a share of a global mean)."""
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "sum"


def _tensor(tensors: dict[str, torch.Tensor], key: str, who: str) -> torch.Tensor:
    if key not in tensors:
        raise KeyError(f"{who} needs batch tensor {key!r}; the batch has {sorted(tensors)}")
    return tensors[key]


def _output(outputs: dict[str, torch.Tensor], key: str, who: str) -> torch.Tensor:
    if key not in outputs:
        raise KeyError(f"{who} needs model output {key!r} but the backend returned {sorted(outputs)}")
    return outputs[key]


class GRPOLoss:
    """Clipped policy-gradient loss (token-mean over the global batch).

    Reads tensors "advantages" [B] or [B, T], "old_logprobs" [B, T] (unless on_policy),
    the mask `mask_key` [B, T] and, with tis_cap, "rollout_logprobs" [B, T].

    Args:
        clip_low, clip_high: ratio clip range (see `grpo.policy_loss`).
        kl_coef: k3 KL-to-reference weight; > 0 adds "ref_logprobs" to `requires`.
        tis_cap: truncated importance-sampling cap, None to disable.
        mask_key: name of the loss mask tensor.
        on_policy: use the current logprobs, detached, as old_logprobs (exactly one update per
            batch); otherwise "old_logprobs" must be in the batch (several optimizer steps per
            rollout batch: the log-probs of the rollout-time policy, computed once).
        dual_clip: dual-clip bound c > 1 for negative advantages (None: off).
    """

    def __init__(
        self,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        kl_coef: float = 0.0,
        tis_cap: float | None = None,
        mask_key: str = "loss_mask",
        on_policy: bool = False,
        dual_clip: float | None = None,
    ) -> None:
        # Bounds config/validation.py checks (algorithm.grpo.*): a caller building the loss by
        # hand meets these asserts.
        assert dual_clip is None or dual_clip > 1.0, dual_clip
        assert 0.0 <= clip_low < 1.0 and clip_high >= 0 and kl_coef >= 0, (clip_low, clip_high, kl_coef)
        assert tis_cap is None or tis_cap > 0, tis_cap
        self.dual_clip = dual_clip
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)
        self.kl_coef, self.tis_cap = float(kl_coef), tis_cap
        self.mask_key, self.on_policy = mask_key, on_policy
        self.requires = frozenset({"logprobs", "ref_logprobs"} if kl_coef > 0 else {"logprobs"})
        self.distillation: DistillationSpec | None = None

    @property
    def mask_keys(self) -> tuple[str, ...]:
        return (self.mask_key,)

    def global_normalizer(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """fp32 count of loss tokens in `tensors` (call on the global batch)."""
        return _tensor(tensors, self.mask_key, "GRPOLoss").to(torch.float32).sum()

    def signal_rows(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B] bool: rows with a loss token whose advantage is not 0. Without the KL term every
        part of the per-token loss (clip, dual clip, TIS weight) multiplies the advantage, so
        another row's gradient is exactly 0; with it every row with a loss token counts."""
        mask = _tensor(tensors, self.mask_key, "GRPOLoss") != 0
        if self.kl_coef > 0:
            return mask.any(dim=1)
        adv = _tensor(tensors, "advantages", "GRPOLoss")
        adv = adv[:, None] if adv.dim() == 1 else adv
        return (mask & (adv != 0)).any(dim=1)

    def __call__(
        self, outputs: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], normalizer: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lp = _output(outputs, "logprobs", "GRPOLoss")
        old = lp.detach() if self.on_policy else _tensor(tensors, "old_logprobs", "GRPOLoss")
        return policy_loss(
            lp,
            old,
            _tensor(tensors, "advantages", "GRPOLoss"),
            _tensor(tensors, self.mask_key, "GRPOLoss"),
            normalizer=normalizer,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            ref_logprobs=_output(outputs, "ref_logprobs", "GRPOLoss") if self.kl_coef > 0 else None,
            kl_coef=self.kl_coef,
            rollout_logprobs=_tensor(tensors, "rollout_logprobs", "GRPOLoss") if self.tis_cap is not None else None,
            tis_cap=self.tis_cap,
            dual_clip=self.dual_clip,
        )


class SDPOLoss:
    """Self-distillation loss, mean over the masked tokens of the global batch.

    The mask `mask_key` must already be zero for samples without a teacher context.

    Args:
        variant: "logits" (full vocabulary or top-k over [B, T, V] logits; requires "logits",
            "teacher_logits") or "sampled" (reverse KL on the sampled tokens; requires
            "teacher_logprobs" and alpha == 1).
        alpha: generalized-JSD interpolation (0 forward KL, 0.5 JSD, 1 reverse KL).
        topk: None for the full vocabulary, else the student's top-k ids.
        add_tail: add the tail bucket to the top-k distributions.
        is_clip: clip of the importance weights exp(logprobs - rollout_logprobs), read from
            tensors "rollout_logprobs"; None disables them. With IS on, "logprobs" is required.
        temperature: logit temperature of the distillation.
        mask_key: name of the mask tensor.
        topk_source: with topk, "logits" (the loss picks the ids from [B, T, V] logits) or
            "shards" (the backend computes the k ids' log-probabilities from vocab-sharded
            logits: requires "topk_logprobs" and "teacher_topk_logprobs"; megatron TP).
        fused, kernel_impl, chunk_tokens, chunk_vocab: the fused-kernel path (see
            `DistillationSpec`); requires "fused_kl", which the backend fills.

    Attributes:
        distillation: the `DistillationSpec` built from these arguments, the only thing a
            backend reads off this loss (besides `requires`).
    """

    def __init__(
        self,
        *,
        variant: str = "logits",
        alpha: float = 0.5,
        topk: int | None = 100,
        add_tail: bool = True,
        is_clip: float | None = 2.0,
        temperature: float = 1.0,
        mask_key: str = "loss_mask",
        fused: bool = False,
        kernel_impl: str = "auto",
        chunk_tokens: int = 1024,
        chunk_vocab: int = 8192,
        topk_source: str = "logits",
    ) -> None:
        # Bounds and rules config/validation.py checks (algorithm.sdpo.*, kernel.fused_kl), and
        # the registry's choice of topk_source: a caller building the loss by hand meets these.
        assert topk_source in ("logits", "shards"), topk_source
        assert topk_source != "shards" or (topk is not None and variant == "logits" and not fused), (
            "topk_source='shards' is the top-k path: it needs variant=logits, a topk and no fused kernel"
        )
        assert not fused or (variant == "logits" and topk is None), "the fused kernel is the full-vocabulary path"
        assert variant in SDPO_VARIANTS, variant
        assert variant != "sampled" or alpha == 1.0, "the sampled variant is the reverse KL only (alpha = 1)"
        assert is_clip is None or is_clip > 0, is_clip
        self.variant, self.add_tail, self.is_clip = variant, add_tail, is_clip
        # The sampled variant scores only the sampled tokens: its top-k setting means nothing.
        k = topk if variant == "logits" else None
        # What the backend computes (and this loss reads back): declared once, checked there.
        self.distillation: DistillationSpec = DistillationSpec(
            alpha=float(alpha),
            temperature=float(temperature),
            topk=k,
            topk_source="full" if k is None else cast(TopkSource, topk_source),
            mask_key=mask_key,
            fused=fused,
            kernel_impl=kernel_impl,
            chunk_tokens=chunk_tokens,
            chunk_vocab=chunk_vocab,
        )
        self.on_policy = False  # reads no behaviour-policy log-probabilities
        if fused:
            needs = {"fused_kl"}
        elif self.distillation.topk_source == "shards":
            needs = {"topk_logprobs", "teacher_topk_logprobs"}
        elif variant == "logits":
            needs = {"logits", "teacher_logits"}
        else:
            needs = {"logprobs", "teacher_logprobs"}
        if is_clip is not None:
            needs.add("logprobs")
        self.requires = frozenset(needs)

    @property
    def mask_keys(self) -> tuple[str, ...]:
        return (self.distillation.mask_key,)

    def global_normalizer(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """fp32 count of distilled tokens in `tensors` (call on the global batch)."""
        return _tensor(tensors, self.distillation.mask_key, "SDPOLoss").to(torch.float32).sum()

    def signal_rows(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B] bool: rows with a distilled token (no context, chain-of-thought masking or
        `mask_ratio` can leave a row none; its loss and gradient are then exactly 0)."""
        return (_tensor(tensors, self.distillation.mask_key, "SDPOLoss") != 0).any(dim=1)

    def __call__(
        self, outputs: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], normalizer: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        spec = self.distillation
        mask = _tensor(tensors, spec.mask_key, "SDPOLoss")
        weights = None
        if self.is_clip is not None:
            weights = importance_weights(
                _output(outputs, "logprobs", "SDPOLoss"),
                _tensor(tensors, "rollout_logprobs", "SDPOLoss (is_clip is set)"),
                clip=self.is_clip,
            )
        if spec.fused:
            per_token = _output(outputs, "fused_kl", "SDPOLoss")
            return reduce_token_loss(per_token, mask, weights, as_normalizer(normalizer, per_token))
        # Both JSD losses (over the top-k shards, over the logits) take the spec the same way.
        jsd: dict[str, Any] = dict(alpha=spec.alpha, add_tail=self.add_tail, is_weights=weights, normalizer=normalizer)
        if spec.topk_source == "shards":
            return topk_distillation_loss(
                _output(outputs, "topk_logprobs", "SDPOLoss"),
                _output(outputs, "teacher_topk_logprobs", "SDPOLoss"),
                mask,
                **jsd,
            )
        if self.variant == "sampled":
            return sampled_token_loss(
                _output(outputs, "logprobs", "SDPOLoss"),
                _output(outputs, "teacher_logprobs", "SDPOLoss"),
                mask,
                normalizer=normalizer,
                is_weights=weights,
            )
        return token_distillation_loss(
            _output(outputs, "logits", "SDPOLoss"),
            _output(outputs, "teacher_logits", "SDPOLoss"),
            mask,
            topk=spec.topk,
            temperature=spec.temperature,
            **jsd,
        )


class HybridLoss:
    """lam * GRPO + (1 - lam) * SDPO distillation, each a token mean over its own mask.

    The convex weighting mirrors the SDPO paper's hybrid advantage (lam * A_GRPO +
    (1 - lam) * A_SDPO): lam = 1 is plain GRPO, lam = 0 plain SDPO.

    The two terms normally use different masks: GRPO every response token ("loss_mask"), SDPO
    only samples with a teacher context (e.g. "distill_mask"), so the normalizer is a [2] fp32
    tensor (GRPO count, SDPO count); a backend reduces it elementwise like a scalar one.
    """

    def __init__(self, sdpo: SDPOLoss, grpo: GRPOLoss, lam: float) -> None:
        assert 0.0 <= lam <= 1.0, lam  # algorithm.sdpo.hybrid_lambda, checked by config/validation.py
        self.sdpo, self.grpo, self.lam = sdpo, grpo, float(lam)
        self.requires = sdpo.requires | grpo.requires
        # The backend fills the distillation outputs for the SDPO term; the GRPO term decides
        # whether the loss reads behaviour-policy log-probabilities.
        self.distillation, self.on_policy = sdpo.distillation, grpo.on_policy

    @property
    def mask_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.grpo.mask_keys + self.sdpo.mask_keys))

    def global_normalizer(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """[2] fp32: (GRPO loss-token count, SDPO distilled-token count)."""
        return torch.stack([self.grpo.global_normalizer(tensors), self.sdpo.global_normalizer(tensors)])

    def signal_rows(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B] bool: rows with a signal in a term whose weight is not 0."""
        rows = self.grpo.signal_rows(tensors) if self.lam > 0 else None
        if self.lam < 1:
            sdpo = self.sdpo.signal_rows(tensors)
            rows = sdpo if rows is None else rows | sdpo
        assert rows is not None  # lam is in [0, 1]: at least one term has weight
        return rows

    def __call__(
        self, outputs: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], normalizer: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if normalizer.shape != (2,):
            raise ValueError(
                f"HybridLoss needs the [2] normalizer of its global_normalizer, got shape {tuple(normalizer.shape)}"
            )
        grpo_loss, grpo_metrics = self.grpo(outputs, tensors, normalizer[0])
        sdpo_loss, sdpo_metrics = self.sdpo(outputs, tensors, normalizer[1])
        metrics = {**grpo_metrics, **sdpo_metrics}
        metrics["hybrid/grpo_loss"] = grpo_loss.detach()
        metrics["hybrid/sdpo_loss"] = sdpo_loss.detach()
        return self.lam * grpo_loss + (1.0 - self.lam) * sdpo_loss, metrics
