"""Fused token-level KL and logprob kernels (installed as ``megatron_sdpo_kernels``).

Public API:
    fused_linear_kl(student_hidden, teacher_hidden, student_weight, teacher_weight, *, alpha,
                    temperature=1.0, mask=None, impl="auto", tp_group=None) -> Tensor [N]
    fused_linear_logprobs(hidden, weight, labels, *, temperature=1.0, mask=None, impl="auto",
                          tp_group=None) -> (logprobs [N], entropy [N])
    reference_linear_kl / reference_linear_logprobs: plain torch, materializing the logits; the
        divergence itself is megatron_sdpo.algorithms.divergence (the specification).
"""

from .chunked import ChunkSizes
from .fused import IMPLS, fused_linear_kl, fused_linear_logprobs, resolve_impl
from .reference import reference_linear_kl, reference_linear_logprobs

__all__ = [
    "IMPLS",
    "ChunkSizes",
    "fused_linear_kl",
    "fused_linear_logprobs",
    "reference_linear_kl",
    "reference_linear_logprobs",
    "resolve_impl",
]
