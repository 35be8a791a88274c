"""Which loss each `algorithm.name` trains with: name -> builder of its `LossFn`.

The spec table (config/algorithm_spec.py) says what an algorithm needs from the rest of the
system; this table says how its loss is built from the run's config. Their keys are the same
(tests/unit/algorithms/test_registry.py), so a new algorithm is a row in each and a loss in
`losses.py`: nothing in the trainer, the continual loop or the builders changes.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_sdpo.algorithms import losses
from megatron_sdpo.config.algorithm_spec import algorithm_spec
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.interfaces.backend import LossFn
from megatron_sdpo.interfaces.distillation import TopkSource

LossBuilder = Callable[[RunConfig, TopkSource], LossFn]


def _grpo(cfg: RunConfig, topk_source: TopkSource) -> losses.GRPOLoss:
    g = cfg.algorithm.grpo
    same = {k: getattr(g, k) for k in ("clip_low", "clip_high", "kl_coef", "tis_cap", "dual_clip")}
    # One optimizer step per rollout batch: the behaviour policy is the current one (detached);
    # with mini-batches the old log-probs are the rollout-time policy's (trainer.minibatch_update).
    return losses.GRPOLoss(**same, on_policy=g.mini_batches == 1)


def _sdpo(cfg: RunConfig, topk_source: TopkSource) -> losses.SDPOLoss:
    s = cfg.algorithm.sdpo
    mask_key = algorithm_spec(cfg.algorithm.name).distill_mask_key
    assert mask_key is not None, f"{cfg.algorithm.name} distils but its spec names no mask"
    same = {k: getattr(s, k) for k in ("alpha", "topk", "add_tail", "is_clip", "variant")}
    kernel = {k: getattr(cfg.kernel, k) for k in ("chunk_tokens", "chunk_vocab")}
    # Only the logits top-k path has ids to pick.
    source = topk_source if s.topk is not None and s.variant == "logits" else "logits"
    return losses.SDPOLoss(
        **same, **kernel, mask_key=mask_key, fused=cfg.kernel.fused_kl, kernel_impl=cfg.kernel.impl, topk_source=source
    )


def _hybrid(cfg: RunConfig, topk_source: TopkSource) -> losses.HybridLoss:
    """Both terms: lam * GRPO + (1 - lam) * SDPO."""
    return losses.HybridLoss(
        sdpo=_sdpo(cfg, topk_source), grpo=_grpo(cfg, topk_source), lam=cfg.algorithm.sdpo.hybrid_lambda
    )


LOSS_BUILDERS: dict[str, LossBuilder] = {
    "grpo": _grpo,
    "sdpo": _sdpo,
    "stable_sdpo": _sdpo,  # SDPO's loss; its teacher control (restart-and-freeze) is the spec's
    "hybrid": _hybrid,
}


def build_loss(cfg: RunConfig, *, topk_source: TopkSource) -> LossFn:
    """The LossFn of the configured algorithm, for a backend whose capability `topk_source`
    ("logits" or "shards", `Backend.topk_source`) says where it picks the student's top-k ids."""
    algorithm_spec(cfg.algorithm.name)  # the one-line error for an unknown name
    return LOSS_BUILDERS[cfg.algorithm.name](cfg, topk_source)
