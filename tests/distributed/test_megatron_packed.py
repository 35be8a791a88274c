"""Packed (THD) rows in the megatron backend: the row layout, the local core attention on packed
q/k/v against megatron's own attention run on each sample alone, and Olmo's refusal.

The backend's packed train steps are held to the HF reference (and to the padded layout) in
test_megatron_backend.py."""

import pytest
import torch

pytestmark = [pytest.mark.megatron]


def test_segments_tile_the_row_and_cut_the_tail():
    from megatron_sdpo.backends.megatron.packed import segment_lengths

    assert segment_lengths([3, 5, 2], 10) == [3, 5, 2]
    # A tail of 12 after samples of at most 5 tokens: pieces of 5, 5 and 2.
    assert segment_lengths([3, 5, 2], 22) == [3, 5, 2, 5, 5, 2]
    assert sum(segment_lengths([4, 1], 17)) == 17 and max(segment_lengths([4, 1], 17)) == 4
    with pytest.raises(ValueError):
        segment_lengths([6, 5], 10)
    with pytest.raises(ValueError):
        segment_lengths([3, 0], 10)


def test_varlen_params_index_each_segment_slot():
    from megatron_sdpo.backends.megatron.packed import varlen_params

    p = varlen_params([3, 1, 2], torch.device("cpu"))
    assert p.qkv_format == "thd" and p.cu_seqlens_q.tolist() == [0, 3, 4, 6] and p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_kv is p.cu_seqlens_q and p.max_seqlen_q == p.max_seqlen_kv == 3
    # Slots past a segment's end repeat its last token (finite, and never seen by a real query).
    assert p.segment_index.tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 5]]
    assert p.token_index.tolist() == [0, 1, 2, 3, 6, 7]
    x = torch.arange(6)
    assert x[p.segment_index.reshape(-1)][p.token_index].tolist() == x.tolist()  # the round trip


def test_packed_row_puts_each_response_token_after_its_own_prompt():
    from megatron_sdpo.backends.megatron.batching import build_packed_rows, packed_len
    from megatron_sdpo.errors import DataError

    prompts, responses = [[5, 6, 7], [8]], [[1, 2], [3, 4, 9]]
    assert packed_len(prompts, responses) == 9
    rows = build_packed_rows(prompts, responses, T=3, W=12, pad_id=0, device=torch.device("cpu"))
    assert rows.tokens.tolist() == [[5, 6, 7, 1, 2, 8, 3, 4, 9, 0, 0, 0]]
    assert rows.positions.tolist()[0][:9] == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert rows.packed.cu_seqlens_q.tolist() == [0, 5, 9, 12]
    assert rows.targets.tolist() == [[1, 2, 0], [3, 4, 9]]
    # The column predicting response token j of sample i holds the token before it.
    picked = rows.tokens[0][rows.gather_index + 1]
    assert picked[0, :2].tolist() == [1, 2] and picked[1].tolist() == [3, 4, 9]
    # select() gathers those columns from [1, W, D] values into [b, T, D].
    vals = torch.arange(12.0).view(1, 12, 1)
    assert rows.select(vals)[..., 0].tolist() == rows.gather_index.float().tolist()
    with pytest.raises(DataError, match="do not fit"):
        build_packed_rows(prompts, responses, T=3, W=8, pad_id=0, device=torch.device("cpu"))


def _attention_worker() -> dict:
    """VarlenDotProductAttention on one packed row vs megatron's DotProductAttention run on each
    segment alone (GQA: 4 query heads over 2 groups), outputs and input gradients."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_sdpo.backends.megatron.packed import VarlenDotProductAttention, varlen_params
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig, initialize

    initialize(ParallelConfig(), seed=0)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
    )
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    packed, plain = VarlenDotProductAttention(**kw), DotProductAttention(**kw)
    lengths = [5, 1, 7, 3, 4]  # the last segment stands for a row's tail
    t = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(t, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(t, 2, 8, generator=g, requires_grad=True)
    w = torch.randn(t, 32, generator=g)  # grad_output != 1
    out = packed(q, k, v, None, packed_seq_params=varlen_params(lengths, torch.device("cpu")))
    (out * w).sum().backward()
    got = (out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    q.grad = k.grad = v.grad = None
    parts, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1).view(1, 1, n, n)
        parts.append(plain(q[sl].unsqueeze(1), k[sl].unsqueeze(1), v[sl].unsqueeze(1), causal).view(n, 32))
        start += n
    ref = torch.cat(parts)
    (ref * w).sum().backward()
    want = (ref.detach(), q.grad, k.grad, v.grad)
    # The whole row under one causal mask: what a layout that ignored the segments would give.
    whole = plain(
        q.unsqueeze(1),
        k.unsqueeze(1),
        v.unsqueeze(1),
        torch.triu(torch.ones(t, t, dtype=torch.bool), 1).view(1, 1, t, t),
    )
    return {
        "diff": [float((a - b).abs().max()) for a, b in zip(got, want, strict=True)],
        "scale": [float(b.abs().max()) for b in want],
        "whole_diff": float((whole.view(t, 32) - ref).abs().max()),
        "unpacked_same": bool(
            torch.equal(
                packed(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None),
                plain(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None),
            )
        ),
    }


@pytest.mark.distributed
def test_local_attention_on_a_packed_row_equals_each_segment_alone():
    from megatron_sdpo.backends.megatron.launch import spawn

    (r,) = spawn(_attention_worker, 1, timeout_s=120)
    # fp32 softmax attention over <= 7 keys of head_dim 8: the two paths differ by rounding only
    # (a few ulps of values of order 1), far below 1e-5 of each tensor's scale.
    for d, s in zip(r["diff"], r["scale"], strict=True):
        assert d <= 1e-5 * max(s, 1.0), r
    assert r["whole_diff"] > 1e-2, r  # the segments matter on this data
    assert r["unpacked_same"], r


def _olmo_packing_worker(olmo_dir: str) -> str:
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.errors import ConfigError

    try:
        MegatronBackend(olmo_dir, lr=1e-4, micro_batch_size=2, packing=True)
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_olmo_refuses_packing(tmp_path):
    from test_megatron_olmo import tiny_olmo

    from megatron_sdpo.backends.megatron.launch import spawn

    tiny_olmo("olmo3").save_pretrained(str(tmp_path))
    (msg,) = spawn(_olmo_packing_worker, 1, str(tmp_path), timeout_s=120)
    assert "backend.packing=true" in msg and "padded layout only" in msg and "\n" not in msg
