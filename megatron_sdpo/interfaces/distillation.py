"""What a backend must compute for a distillation loss, declared once by the loss.

A loss that distills (SDPOLoss, HybridLoss) exposes one `DistillationSpec` as its `distillation`
attribute (part of the `LossFn` protocol in `megatron_sdpo.interfaces.backend`; None for losses that
do not distill). Backends read these fields and nothing else off the loss to fill the
distillation outputs ("fused_kl", "topk_logprobs", "teacher_topk_logprobs").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_sdpo.errors import ConfigError

# Where the k ids of top-k distillation are picked:
#   "full"   no top-k: the whole vocabulary;
#   "logits" the loss picks the student's top-k ids from [B, T, V] logits it is handed;
#   "shards" the backend picks them from vocab-sharded logits and hands the loss the k ids'
#            full-vocabulary log-probabilities ("topk_logprobs", "teacher_topk_logprobs").
TopkSource = Literal["full", "logits", "shards"]
TOPK_SOURCES: tuple[str, ...] = ("full", "logits", "shards")


@dataclass(frozen=True)
class DistillationSpec:
    """The distillation a loss asks of the backend.

    alpha: generalized-JSD interpolation in [0, 1] (`algorithms.divergence`): 0 forward KL,
        1 reverse KL.
    temperature: both models' logits are divided by it before the softmax.
    topk: None for the full vocabulary, else the number of student top-k ids.
    topk_source: see `TopkSource`; "full" exactly when topk is None.
    mask_key: the batch tensor [B, T] marking the distilled tokens.
    fused: the backend fills "fused_kl" [B, T] through the fused linear kernel
        (`megatron_sdpo_kernels.fused_linear_kl`) from hidden states; full vocabulary only.
    kernel_impl: the kernels' implementation (`megatron_sdpo_kernels.IMPLS`, checked there), also
        used for the fused logprob kernel on the same path.
    chunk_tokens, chunk_vocab: tile sizes of the chunked kernel engine.
    """

    alpha: float
    temperature: float = 1.0
    topk: int | None = None
    topk_source: TopkSource = "full"
    mask_key: str = "loss_mask"
    fused: bool = False
    kernel_impl: str = "auto"
    chunk_tokens: int = 1024
    chunk_vocab: int = 8192

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ConfigError(f"sdpo.temperature must be > 0, got {self.temperature}")
        if self.topk is not None and (isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1):
            raise ConfigError(f"sdpo.topk must be None or a positive integer, got {self.topk!r}")
        if self.topk_source not in TOPK_SOURCES:
            raise ConfigError(f"topk_source must be one of {', '.join(TOPK_SOURCES)}, got {self.topk_source!r}")
        if (self.topk is None) != (self.topk_source == "full"):
            raise ConfigError(
                f"topk_source 'full' goes with topk=None and only with it (topk={self.topk!r}, "
                f"topk_source={self.topk_source!r})"
            )
        if self.fused and self.topk is not None:
            raise ConfigError("kernel.fused_kl is the full-vocabulary path: it needs sdpo.topk=null")
        if self.chunk_tokens < 1 or self.chunk_vocab < 1:
            raise ConfigError(f"kernel chunk sizes must be >= 1, got {self.chunk_tokens} x {self.chunk_vocab}")


def distillation_of(loss, output: str) -> DistillationSpec:
    """`loss.distillation` (see `interfaces.backend.LossFn`) for a backend about to fill the model
    output `output` ("fused_kl" or "topk_logprobs"), or a ConfigError when the loss declares no
    spec or one that does not ask for that output; `loss` may be None (no loss at hand)."""
    spec = None if loss is None else loss.distillation
    if spec is None:
        raise ConfigError(f"{output!r} is only available to a distilling loss (one that declares a DistillationSpec)")
    if output == "fused_kl" and not spec.fused:
        raise ConfigError("'fused_kl' is only available to a loss whose distillation is fused (kernel.fused_kl=true)")
    if output == "topk_logprobs" and spec.topk is None:
        raise ConfigError("'topk_logprobs' is only available to a loss whose distillation has a top-k (sdpo.topk)")
    return spec
