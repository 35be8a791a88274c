"""Packed sequences (THD) in the megatron backend: a micro-batch's samples end to end in one row.

megatron-core runs a packed row when GPTModel's forward gets `packed_seq_params` with
`qkv_format="thd"`: the row is `[t, 1, H]` (the batch dimension is a dummy), each attention
layer squeezes it to `[t, heads, head_dim]`, restarts RoPE at every `cu_seqlens` offset
(`apply_rotary_pos_emb`) and hands its core attention the packed q/k/v with the params.
Transformer Engine's attention runs them through its varlen kernels (flash / cuDNN, with the
causal mask turned into `padding_causal` by megatron), so attention costs the real tokens only.
megatron-core's local `DotProductAttention` (CPU, no TE) asserts `packed_seq_params is None`;
`VarlenDotProductAttention` below is the local layer spec's core attention instead: unpacked
calls go to `DotProductAttention` unchanged, packed ones are gathered into
`[segments, longest segment]`, right-padded, so causal attention over each padded segment gives
every real query its own segment's earlier tokens and nothing else, run through SDPA, and
scattered back. There attention costs segments x longest^2 (what the padded layout spends on
attention), while the linear layers, the norms and the LM head run on the real tokens only.

The gather indices are built once per micro-batch on the host, with the rest of the row, and
ride in `VarlenParams` (megatron passes the params object through to core attention as it is;
TE reads only the fields it knows), so no layer syncs with the host.

The segments tile the row: the samples, then the row's unused tail, cut into pieces no longer
than the longest sample so that no tail segment sets the local path's padded length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_sdpo.errors import ConfigError


@dataclass
class VarlenParams(PackedSeqParams):
    """megatron's THD params plus the local attention's gather indices:
    `segment_index` [n_seg, L] int64, the row position of each padded segment slot (slots past a
    segment's end repeat its last token); `token_index` [t] int64, the flat slot of each row
    position in the [n_seg * L] padded layout."""

    segment_index: torch.Tensor | None = None
    token_index: torch.Tensor | None = None


def segment_lengths(sample_lengths: list[int], width: int) -> list[int]:
    """Segments of a row of `width` tokens holding samples of `sample_lengths` in order: the
    samples, then the tail in pieces of at most the longest sample."""
    used = sum(sample_lengths)
    if used > width or not sample_lengths or min(sample_lengths) < 1:
        raise ValueError(f"samples of lengths {sample_lengths} do not tile a row of {width} tokens")
    longest = max(sample_lengths)
    tail = width - used
    pieces = [longest] * (tail // longest) + ([tail % longest] if tail % longest else [])
    return list(sample_lengths) + pieces


def varlen_params(lengths: list[int], device: torch.device) -> VarlenParams:
    """THD params of a row whose segments have `lengths` (they sum to the row width)."""
    L = max(lengths)
    cu: list[int] = [0]
    seg_index: list[list[int]] = []
    token_index: list[int] = []
    for s, n in enumerate(lengths):
        start = cu[-1]
        seg_index.append([start + min(j, n - 1) for j in range(L)])
        token_index.extend(s * L + j for j in range(n))
        cu.append(start + n)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    return VarlenParams(
        qkv_format="thd",
        cu_seqlens_q=cu_t,
        cu_seqlens_kv=cu_t,
        max_seqlen_q=L,
        max_seqlen_kv=L,
        segment_index=torch.tensor(seg_index, dtype=torch.long, device=device),
        token_index=torch.tensor(token_index, dtype=torch.long, device=device),
    )


class VarlenDotProductAttention(DotProductAttention):
    """megatron's local core attention, plus packed (THD) rows (module docstring)."""

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        """Unpacked: `DotProductAttention.forward`. Packed: query [t, np, hn], key / value
        [t, ng, hn] -> context [t, np * hn]."""
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        p = packed_seq_params
        built = isinstance(p, VarlenParams) and p.segment_index is not None and p.token_index is not None
        if not built or p.qkv_format != "thd":
            raise ConfigError("the local attention takes packed rows built by the backend (VarlenParams, thd)")
        # Query-key layer scaling folds a factor into softmax_scale that the fused softmax undoes.
        plain = self.softmax_offset is None and not self.config.apply_query_key_layer_scaling
        if attention_bias is not None or not plain or self.config.window_size is not None:
            raise ConfigError("packed rows on the local attention support plain causal softmax attention only")
        if self.training and self.attention_dropout.p > 0:
            raise ConfigError("packed rows on the local attention need attention_dropout=0")
        t, heads, dim = query.shape
        groups = key.shape[1]
        if heads != groups:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
        n_seg, L = p.segment_index.shape
        flat = p.segment_index.reshape(-1)

        def padded(x: torch.Tensor) -> torch.Tensor:  # [t, np, hn] -> [n_seg, np, L, hn]
            return x.index_select(0, flat).view(n_seg, L, heads, dim).transpose(1, 2)

        out = torch.nn.functional.scaled_dot_product_attention(
            padded(query), padded(key), padded(value), is_causal=True, scale=self.softmax_scale
        )
        out = out.transpose(1, 2).reshape(n_seg * L, heads * dim)
        return out.index_select(0, p.token_index)
