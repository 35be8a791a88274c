"""Token layout of the megatron backend: packed rows (the default) or one right-padded row per sample.

Packed (`build_packed_rows`, packed.py): a micro-batch's samples end to end in one row [1, W],
THD params delimiting them; `gather_index` [b, T] holds each response token's predicting column
in that row. Under pipeline parallelism W is one width for the whole step (every micro-batch and
the riders' rows), as the stages' P2P buffers need one shape; otherwise each row is as wide as
its samples.

Padded: each row is prompt + response, right-padded to the micro-batch's common length S. With causal
attention, right padding never changes the real tokens' outputs, so no attention mask and no
position shift is needed (positions are 0..S-1 for every row). Response token j of sample i is
predicted at column len(prompt_i) + j - 1; `gather_index` holds those columns, [b, T]. Every
micro-batch of a step has the same [b, S] shape: the pipeline schedule's p2p buffers are sized
once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_sdpo.errors import DataError

if TYPE_CHECKING:  # packed.py imports megatron-core
    from megatron_sdpo.backends.megatron.packed import VarlenParams


@dataclass
class Rows:
    """tokens / positions: [r, S] int64 (r = b padded, 1 packed); gather_index / targets:
    [b, T] int64; packed: the THD params of a packed row (packed.VarlenParams), else None."""

    tokens: torch.Tensor
    positions: torch.Tensor
    gather_index: torch.Tensor
    targets: torch.Tensor
    packed: VarlenParams | None = None

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """[r, S, D] per-column values of these rows -> [b, T, D] at the columns predicting the
        response tokens (an index, so the backward scatters into the columns)."""
        b, T = self.gather_index.shape
        if self.packed is not None:
            return x[0].index_select(0, self.gather_index.reshape(-1)).view(b, T, x.shape[-1])
        return x.gather(1, self.gather_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


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
    S = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    return -(-S // multiple) * multiple


def build_rows(
    prompts: list[list[int]], responses: list[list[int]], T: int, S: int, pad_id: int, device: torch.device
) -> Rows:
    """Rows of one micro-batch on `device`; T is the global batch's response length. The rows
    are assembled as Python lists and copied once per tensor (no per-row host-to-device copies)."""
    b = len(prompts)
    tokens, gather, targets = [], [], []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if not p:
            raise DataError(f"prompt {i} is empty: every sample needs at least one prompt token")
        if len(r) > T or len(p) + len(r) > S:
            raise DataError(f"sample {i} ({len(p)} + {len(r)} tokens) does not fit T={T}, S={S}")
        row = p + r
        tokens.append(row + [pad_id] * (S - len(row)))
        # Columns past the response end point at the last real column; their mask is 0.
        gather.append([min(j + len(p) - 1, len(row) - 1) for j in range(T)])
        targets.append(list(r) + [pad_id] * (T - len(r)))
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device).view(b, -1)
    positions = torch.arange(S, dtype=torch.long, device=device).unsqueeze(0).expand(b, S).contiguous()
    return Rows(as_long(tokens), positions, as_long(gather), as_long(targets))


def packed_len(prompts: list[list[int]], responses: list[list[int]]) -> int:
    """Tokens of these samples end to end (a packed row's real part)."""
    return sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))


def build_packed_rows(
    prompts: list[list[int]], responses: list[list[int]], T: int, W: int, pad_id: int, device: torch.device
) -> Rows:
    """One packed row [1, W] of these samples (W >= `packed_len`, the step's common width) with
    its THD params; positions restart at 0 at each sample."""
    from megatron_sdpo.backends.megatron.packed import segment_lengths, varlen_params
    from megatron_sdpo.backends.varlen import pack_varlen

    if packed_len(prompts, responses) > W:
        raise DataError(f"{len(prompts)} samples ({packed_len(prompts, responses)} tokens) do not fit a row of W={W}")
    v = pack_varlen(prompts, responses, response_len=T, pad_id=pad_id, row_tokens=0, width=W, device=device)
    params = varlen_params(
        segment_lengths([len(p) + len(r) for p, r in zip(prompts, responses, strict=True)], W), device
    )
    return Rows(v.input_ids, v.position_ids, v.hidden_index, v.response_ids, packed=params)


def micro_batches(idx: list[int], size: int, equal: bool) -> list[list[int]]:
    """Split `idx` into micro-batches of `size`; with `equal` the last one is padded with -1
    (a dummy row whose tensors are zero), as the pipeline schedule needs one shape."""
    out = [idx[i : i + size] for i in range(0, len(idx), size)]
    if equal and out and len(out[-1]) < size:
        out[-1] = out[-1] + [-1] * (size - len(out[-1]))
    return out


def micro_batch_dicts(
    batch,
    T: int,
    prompts: list[list[int]],
    local: list[int],
    riders: tuple = (),
    *,
    size: int,
    equal: bool,
    packed: bool,
    multiple: int,
    pad_id: int,
    device: torch.device,
) -> tuple[list[dict], int]:
    """Micro-batches of `size` samples out of this DP rank's samples `local` of `batch` (a
    SequenceBatch), rows built from `prompts`; `riders` are further prompt lists (teacher,
    reference) built into `rider_rows` with the same samples: one packed row per micro-batch
    (`packed`), or one padded row per sample (padded rows of a step share one length S). `equal`
    (pipeline parallelism: the stages exchange buffers of one shape) pads
    the last micro-batch with dummy samples whose tensors are zero and gives every packed row the
    step's common width; without it each packed row is as wide as its samples (rounded up to
    `multiple`). Returns (micro-batch dicts, S: the row length, the widest where they differ)."""
    groups = micro_batches(local, size, equal=equal)
    # Dummy rows (-1) repeat the micro-batch's first real sample.
    filled = [[i if i >= 0 else [j for j in g if j >= 0][0] for i in g] for g in groups]
    lists = (prompts, *riders)
    build: Callable[..., Rows]
    if packed:
        # [micro-batch][student, riders...]: each row's own width, rounded up to `multiple`.
        widths = [
            [
                -(-packed_len([p[i] for i in idx], [batch.response_ids[i] for i in idx]) // multiple) * multiple
                for p in lists
            ]
            for idx in filled
        ]
        S = max(max(w) for w in widths)
        if equal:
            widths = [[S] * len(lists) for _ in filled]
        build = build_packed_rows
    else:
        responses = [batch.response_ids[i] for i in local]
        S = max(seq_len([p[i] for i in local], responses, multiple) for p in lists)
        widths = [[S] * len(lists) for _ in filled]
        build = build_rows
    out = []
    for g, rows_idx, row_widths in zip(groups, filled, widths, strict=True):
        real = [i for i in g if i >= 0]
        resp = [batch.response_ids[i] for i in rows_idx]
        rows, *rider_rows = [
            build([p[i] for i in rows_idx], resp, T, w, pad_id, device) for p, w in zip(lists, row_widths, strict=True)
        ]
        keep = torch.tensor([1.0 if i >= 0 else 0.0 for i in g], device=device)
        tensors = {}
        for k, v in batch.tensors.items():
            t = v[rows_idx].to(device, copy=True)
            tensors[k] = t * keep.view(-1, *([1] * (t.ndim - 1))).to(t.dtype) if (keep == 0).any() else t
        out.append({"rows": rows, "rider_rows": rider_rows, "tensors": tensors, "n_real": len(real)})
    return out, S
