"""Masked fp32 reductions shared by the losses.

Every loss is written as `sum(per_token) / normalizer` so that a backend can split the global
batch into micro-batches (and ranks) and add their shares. The helpers here keep that
convention in one place.
"""

from __future__ import annotations

import torch

# A normalizer of 0 only happens when the whole global batch has no loss token; the sum is
# then 0 too and the loss should be 0 (no signal), not NaN.
_TINY = torch.finfo(torch.float32).tiny


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise ValueError naming both tensors when their shapes differ (a caller bug)."""
    if a.shape != b.shape:
        raise ValueError(f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}")


def as_normalizer(normalizer: torch.Tensor | float | int, like: torch.Tensor) -> torch.Tensor:
    """fp32 scalar tensor on `like`'s device, clamped away from 0."""
    n = torch.as_tensor(normalizer, dtype=torch.float32, device=like.device)
    return n.clamp_min(_TINY)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(mask * values) in fp32; positions with mask == 0 are dropped with `where` first so that
    a non-finite value in padding cannot turn the sum into NaN."""
    m = mask.to(torch.float32)
    v = torch.where(m != 0, values.to(torch.float32), torch.zeros((), dtype=torch.float32, device=values.device))
    return (v * m).sum()


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over masked positions (fp32, detached); -inf when the mask is empty (max identity)."""
    neg_inf = torch.full((), float("-inf"), dtype=torch.float32, device=values.device)
    return torch.where(mask != 0, values.detach().float(), neg_inf).max()


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min over masked positions (fp32, detached); +inf when the mask is empty (min identity)."""
    pos_inf = torch.full((), float("inf"), dtype=torch.float32, device=values.device)
    return torch.where(mask != 0, values.detach().float(), pos_inf).min()
