"""Token layout of the megatron backend: one right-padded row per sample.

Each row is prompt + response, right-padded to the micro-batch's common length S. With causal
attention, right padding never changes the real tokens' outputs, so no attention mask and no
position shift is needed (positions are 0..S-1 for every row). Response token j of sample i is
predicted at column len(prompt_i) + j - 1; `gather_index` holds those columns, [b, T]. Every
micro-batch of a step has the same [b, S] shape: the pipeline schedule's p2p buffers are sized
once per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sdpo.errors import DataError


@dataclass
class Rows:
    """tokens / positions: [b, S] int64; gather_index / targets: [b, T] int64."""

    tokens: torch.Tensor
    positions: torch.Tensor
    gather_index: torch.Tensor
    targets: torch.Tensor


def seq_len(prompts: list[list[int]], responses: list[list[int]], multiple: int = 1) -> int:
    """Common row length S for these samples (rounded up to `multiple`, e.g. TP under SP)."""
    S = max(len(p) + len(r) for p, r in zip(prompts, responses))
    return -(-S // multiple) * multiple


def build_rows(prompts: list[list[int]], responses: list[list[int]], T: int, S: int, pad_id: int) -> Rows:
    """Rows of one micro-batch; T is the global batch's response length."""
    b = len(prompts)
    tokens = torch.full((b, S), pad_id, dtype=torch.long)
    gather = torch.zeros((b, T), dtype=torch.long)
    targets = torch.full((b, T), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not p:
            raise DataError(f"prompt {i} is empty: every sample needs at least one prompt token")
        if len(r) > T or len(p) + len(r) > S:
            raise DataError(f"sample {i} ({len(p)} + {len(r)} tokens) does not fit T={T}, S={S}")
        row = p + r
        tokens[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        # Columns past the response end point at the last real column; their mask is 0.
        gather[i] = (torch.arange(T) + len(p) - 1).clamp(max=len(row) - 1)
        if r:
            targets[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    positions = torch.arange(S, dtype=torch.long).unsqueeze(0).expand(b, S).contiguous()
    return Rows(tokens, positions, gather, targets)


def dp_slice(n: int, dp: int, rank: int) -> list[int]:
    """Contiguous near-equal split of n samples over dp ranks (the HF backend's order)."""
    if n < dp:
        raise DataError(f"global batch of {n} samples is smaller than the data-parallel size {dp}")
    base, extra = divmod(n, dp)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


def micro_batches(idx: list[int], size: int, equal: bool) -> list[list[int]]:
    """Split `idx` into micro-batches of `size`; with `equal` the last one is padded with -1
    (a dummy row whose tensors are zero), as the pipeline schedule needs one shape."""
    out = [idx[i : i + size] for i in range(0, len(idx), size)]
    if equal and out and len(out[-1]) < size:
        out[-1] = out[-1] + [-1] * (size - len(out[-1]))
    return out
