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


# Transformer Engine's FP8 GEMMs need every dimension, the token count included, to be a
# multiple of 16.
FP8_SEQ_MULTIPLE = 16


def seq_multiple(tp: int, sequence_parallel: bool, fp8: bool) -> int:
    """What the row length S must be a multiple of: TP under sequence parallelism (the sequence
    is split over TP ranks), and under FP8 each rank's share of the sequence a multiple of 16."""
    per_rank = FP8_SEQ_MULTIPLE if fp8 else 1
    return per_rank * (tp if sequence_parallel else 1)


def seq_len(prompts: list[list[int]], responses: list[list[int]], multiple: int = 1) -> int:
    """Common row length S for these samples, rounded up to `multiple` (`seq_multiple`)."""
    S = max(len(p) + len(r) for p, r in zip(prompts, responses))
    return -(-S // multiple) * multiple


def build_rows(
    prompts: list[list[int]], responses: list[list[int]], T: int, S: int, pad_id: int, device: torch.device
) -> Rows:
    """Rows of one micro-batch on `device`; T is the global batch's response length. The rows
    are assembled as Python lists and copied once per tensor (no per-row host-to-device copies)."""
    b = len(prompts)
    tokens, gather, targets = [], [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not p:
            raise DataError(f"prompt {i} is empty: every sample needs at least one prompt token")
        if len(r) > T or len(p) + len(r) > S:
            raise DataError(f"sample {i} ({len(p)} + {len(r)} tokens) does not fit T={T}, S={S}")
        row = p + r
        tokens.append(row + [pad_id] * (S - len(row)))
        # Columns past the response end point at the last real column; their mask is 0.
        gather.append([min(j + len(p) - 1, len(row) - 1) for j in range(T)])
        targets.append(list(r) + [pad_id] * (T - len(r)))
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device).view(b, -1)  # noqa: E731
    positions = torch.arange(S, dtype=torch.long, device=device).unsqueeze(0).expand(b, S).contiguous()
    return Rows(as_long(tokens), positions, as_long(gather), as_long(targets))


def micro_batches(idx: list[int], size: int, equal: bool) -> list[list[int]]:
    """Split `idx` into micro-batches of `size`; with `equal` the last one is padded with -1
    (a dummy row whose tensors are zero), as the pipeline schedule needs one shape."""
    out = [idx[i : i + size] for i in range(0, len(idx), size)]
    if equal and out and len(out[-1]) < size:
        out[-1] = out[-1] + [-1] * (size - len(out[-1]))
    return out
