"""Packed ("varlen") token layout: a micro-batch's sequences concatenated without padding.

`layout.pack` builds a [B, P + T] rectangle (left-padded prompts, right-padded responses), so
the work of a forward is B x (longest prompt + longest response) whatever the real lengths.
`pack_varlen` instead lays every sample's prompt + response end to end in rows of at most
`row_tokens` tokens (first-fit by decreasing length; `row_tokens=0`: one row holding every
sample), with position ids restarting at 0 at each sample, so that a position-aware block-
diagonal causal mask (transformers builds one from the position ids when no attention mask is
given; flash-attention varlen kernels take `cu_seqlens`) keeps samples from seeing each other.

Why rows of bounded length and not always one row: attention over a row with a dense block-
diagonal mask (torch SDPA on CPU, eager) costs O(row length^2) however sparse the mask, so
one row of N tokens spends N^2 where the padded rectangle spends B x L^2. Rows of a few
hundred tokens keep the linear layers' work at the real token count (plus the tail of each
row) while attention stays near the padded cost. With a varlen kernel, one row is the best.

The per-token outputs the losses consume keep the [B, T] response layout: `hidden_index[i, j]`
is the flat index (row * W + column) of the hidden state that predicts response token j of
sample i. Columns past a sample's response point at its last real token (finite values that
the response mask zeroes), as the padded layout's pad columns hold finite values too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sdpo.errors import DataError


@dataclass
class VarlenBatch:
    """input_ids / position_ids: [R, W] int64 (each row's unused tail is `pad_id` with its own
    positions 0.., a separate segment); cu_seqlens: [S + 1] int32 segment offsets into the
    row-major flattened [R * W] tokens (samples and row tails alike, so they tile every token, as
    the THD format expects); hidden_index: [B, T] int64 flat index of the hidden state predicting
    response token j of sample i; response_ids: [B, T] int64; response_mask: [B, T] float32."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    hidden_index: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    real_tokens: int  # tokens that belong to a sample (the row tails excluded)


def _rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Sample indices per row: first-fit over samples sorted by decreasing length (ties by
    index, so the layout is deterministic); a sample longer than `row_tokens` gets a row of its
    own; row_tokens=0: one row."""
    if row_tokens == 0:
        return [list(range(len(lengths)))]
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for r, used in enumerate(fill):
            if used + lengths[i] <= row_tokens:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    return rows


def pack_varlen(
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    response_len: int,
    pad_id: int,
    row_tokens: int = 0,
    multiple: int = 1,
    device: torch.device | str | None = None,
) -> VarlenBatch:
    """Pack the samples (prompt_i + response_i) into rows of at most `row_tokens` tokens.

    `response_len` is the global T (as in `layout.pack`); `multiple` rounds the row width W up
    (tensor parallelism with sequence parallelism splits the sequence over ranks, FP8 GEMMs
    want multiples of 16). Tensors are built as Python lists and copied once each."""
    if len(prompts) != len(responses):
        raise DataError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise DataError("pack_varlen needs at least one sample")
    if row_tokens < 0 or multiple < 1:
        raise DataError(f"row_tokens must be >= 0 and multiple >= 1, got {row_tokens}, {multiple}")
    T = response_len
    lengths = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not p:
            raise DataError(f"prompt {i} is empty: every sample needs at least one prompt token")
        if len(r) > T:
            raise DataError(f"response {i} has {len(r)} tokens, more than the batch's T={T}")
        lengths.append(len(p) + len(r))
    rows = _rows(lengths, row_tokens)
    W = max(sum(lengths[i] for i in row) for row in rows)
    W = -(-W // multiple) * multiple
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    index = [[0] * T for _ in prompts]
    targets = [list(r) + [pad_id] * (T - len(r)) for r in responses]
    for row in rows:
        start = len(ids)
        for i in row:
            p, r = prompts[i], responses[i]
            base = len(ids)
            ids.extend(p)
            ids.extend(r)
            pos.extend(range(lengths[i]))
            cu.append(len(ids))
            # Response token j is predicted at column len(p) + j - 1; beyond the response, the
            # last real column (masked out downstream).
            last = base + lengths[i] - 1
            index[i] = [min(base + len(p) + j - 1, last) for j in range(T)]
        tail = W - (len(ids) - start)
        if tail:
            ids.extend([pad_id] * tail)
            pos.extend(range(tail))
            cu.append(len(ids))
    R = len(rows)
    long = dict(dtype=torch.long, device=device)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (T - len(r)) for r in responses], dtype=torch.float32, device=device)
    return VarlenBatch(
        input_ids=torch.tensor(ids, **long).view(R, W),
        position_ids=torch.tensor(pos, **long).view(R, W),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        hidden_index=torch.tensor(index, **long).view(len(prompts), T),
        response_ids=torch.tensor(targets, **long).view(len(prompts), T),
        response_mask=mask.view(len(prompts), T),
        real_tokens=sum(lengths),
    )


def gather_hidden(hidden: torch.Tensor, hidden_index: torch.Tensor) -> torch.Tensor:
    """[R, W, H] hidden states of packed rows, [B, T] flat indices -> [B, T, H] (a gather:
    its backward scatters the response positions' gradients back into the rows)."""
    R, W, H = hidden.shape
    B, T = hidden_index.shape
    return hidden.reshape(R * W, H).index_select(0, hidden_index.reshape(-1)).view(B, T, H)
