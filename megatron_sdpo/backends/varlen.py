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

Shared prompts (`share_prompts=True`): a GRPO/SDPO batch holds each prompt G times (one per
sample of its group), so most of a step's tokens are prompt copies (the tiny run: 4,456 prompt
tokens for 1,493 response tokens per step). Samples with identical prompts then form one
segment: the prompt once, then each response after it with positions continuing from the
prompt's length, and an explicit attention mask in which a response token sees the prompt and
its own earlier tokens only (a tree, not a chain). Each response's hidden states are then those
of prompt + response run alone, and the backward sums the prompt's gradient over its samples,
which is what G separate copies would accumulate. A varlen kernel's `cu_seqlens` cannot state
that mask, so the shared layout carries the mask instead (`attention_mask` [R, 1, W, W] bool,
True = attend) and no `cu_seqlens`.
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
    the THD format expects), None with shared prompts; attention_mask: None (the positions
    delimit the samples) or, with shared prompts, [R, 1, W, W] bool (True = query attends to
    key); hidden_index: [B, T] int64 flat index of the hidden state predicting response token j
    of sample i; response_ids: [B, T] int64; response_mask: [B, T] float32."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    hidden_index: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    real_tokens: int  # tokens the model sees that belong to a sample (the row tails excluded)
    attention_mask: torch.Tensor | None = None


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


def _segments(prompts: list[list[int]], share: bool) -> list[list[int]]:
    """Sample indices per segment, in order of first appearance: samples with identical
    prompts together when `share`, else one sample each."""
    if not share:
        return [[i] for i in range(len(prompts))]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    return list(groups.values())


def pack_varlen(
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    response_len: int,
    pad_id: int,
    row_tokens: int = 0,
    multiple: int = 1,
    share_prompts: bool = False,
    width: int = 0,
    device: torch.device | str | None = None,
) -> VarlenBatch:
    """Pack the samples (prompt_i + response_i) into rows of at most `row_tokens` tokens; with
    `share_prompts`, samples with identical prompts share one copy of it (module docstring).

    `response_len` is the global T (as in `layout.pack`); `multiple` rounds the row width W up
    (tensor parallelism with sequence parallelism splits the sequence over ranks, FP8 GEMMs
    want multiples of 16); `width` is a lower bound on W (the megatron backend's packed rows
    under pipeline parallelism share the step's width). Tensors are built as Python lists and
    copied once each."""
    if len(prompts) != len(responses):
        raise DataError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise DataError("pack_varlen needs at least one sample")
    if row_tokens < 0 or multiple < 1 or width < 0:
        raise DataError(f"row_tokens and width must be >= 0 and multiple >= 1, got {row_tokens}, {width}, {multiple}")
    T = response_len
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if not p:
            raise DataError(f"prompt {i} is empty: every sample needs at least one prompt token")
        if len(r) > T:
            raise DataError(f"response {i} has {len(r)} tokens, more than the batch's T={T}")
    segments = _segments(prompts, share_prompts)
    seg_len = [len(prompts[seg[0]]) + sum(len(responses[i]) for i in seg) for seg in segments]
    rows = _rows(seg_len, row_tokens)
    W = max(width, max(sum(seg_len[k] for k in row) for row in rows))
    W = -(-W // multiple) * multiple
    ids: list[int] = []
    pos: list[int] = []
    # Per token: its segment (row tails are segments too) and branch (0: the prompt, k: the
    # k-th response of the segment); only the shared layout's mask reads them.
    seg_of: list[int] = []
    branch: list[int] = []
    cu = [0]
    index = [[0] * T for _ in prompts]
    targets = [list(r) + [pad_id] * (T - len(r)) for r in responses]
    for row in rows:
        start = len(ids)
        for k in row:
            p = prompts[segments[k][0]]
            P = len(p)
            ids.extend(p)
            pos.extend(range(P))
            seg_of.extend([len(cu)] * P)
            branch.extend([0] * P)
            prompt_end = len(ids) - 1
            for b, i in enumerate(segments[k], start=1):
                r = responses[i]
                first = len(ids)
                ids.extend(r)
                pos.extend(range(P, P + len(r)))
                seg_of.extend([len(cu)] * len(r))
                branch.extend([b] * len(r))
                # Response token 0 is predicted by the prompt's last column, token j by the
                # response's column j - 1; beyond the response, its last real column (masked
                # out downstream).
                last = first + len(r) - 1 if r else prompt_end
                index[i] = [prompt_end if j == 0 else min(first + j - 1, last) for j in range(T)]
            cu.append(len(ids))
        tail = W - (len(ids) - start)
        if tail:
            ids.extend([pad_id] * tail)
            pos.extend(range(tail))
            seg_of.extend([len(cu)] * tail)
            branch.extend([0] * tail)
            cu.append(len(ids))
    R = len(rows)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (T - len(r)) for r in responses], dtype=torch.float32, device=device)
    attention = None
    if share_prompts:
        seg_t = torch.tensor(seg_of, dtype=torch.long, device=device).view(R, W)
        br = torch.tensor(branch, dtype=torch.long, device=device).view(R, W)
        col = torch.arange(W, device=device)
        causal = col[:, None] >= col[None, :]
        same_seg = seg_t[:, :, None] == seg_t[:, None, :]
        visible = (br[:, None, :] == 0) | (br[:, :, None] == br[:, None, :])
        attention = (same_seg & visible & causal).unsqueeze(1)
    return VarlenBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device).view(R, W),
        position_ids=torch.tensor(pos, dtype=torch.long, device=device).view(R, W),
        cu_seqlens=None if share_prompts else torch.tensor(cu, dtype=torch.int32, device=device),
        hidden_index=torch.tensor(index, dtype=torch.long, device=device).view(len(prompts), T),
        response_ids=torch.tensor(targets, dtype=torch.long, device=device).view(len(prompts), T),
        response_mask=mask.view(len(prompts), T),
        real_tokens=sum(seg_len),
        attention_mask=attention,
    )


def gather_hidden(hidden: torch.Tensor, hidden_index: torch.Tensor) -> torch.Tensor:
    """[R, W, H] hidden states of packed rows, flat indices of any shape ([B, T]; [N]) -> that
    shape + [H] (a gather: its backward scatters the positions' gradients back into the rows)."""
    R, W, H = hidden.shape
    return hidden.reshape(R * W, H).index_select(0, hidden_index.reshape(-1)).view(*hidden_index.shape, H)
