"""RMSNorm for megatron-core's local (non-Transformer-Engine) layer spec.

megatron-core's local spec falls back to `torch.nn.RMSNorm` through `WrappedTorchNorm` when Apex
is absent, and that wrapper refuses sequence parallelism. The norm itself needs nothing from SP
(it is per token): only its weight must be marked `sequence_parallel`, so that
`finalize_model_grads` sums the weight's gradient over the TP ranks, each of which saw a
different slice of the sequence. This module is that norm; numerically it is
`torch.nn.functional.rms_norm`, exactly what `torch.nn.RMSNorm` computes.
"""

from __future__ import annotations

from typing import Any, cast

import torch


def param_device(config) -> torch.device:
    """Where megatron's own layers put their parameters for this config (the backend never
    moves a model after building it)."""
    return torch.device("cpu") if config.use_cpu_initialization else torch.device("cuda", torch.cuda.current_device())


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim; x: [..., hidden_size]."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=param_device(config))
        )
        # Read by megatron's finalize_model_grads: all-reduce this grad over TP under SP.
        cast(Any, self.weight).sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
