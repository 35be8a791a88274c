"""The HF engine's attention while decoding on CPU: SDPA reading grouped KV heads in place.

transformers' SDPA path repeats a grouped-query model's key and value heads (`repeat_kv`, a copy
of the whole KV cache per layer and decoding step) whenever an attention mask is given, because
CUDA's fused kernels take no mask together with grouped heads. A left-padded rollout batch always
has a mask, so on CPU every decoding step copied the cache twice per layer. torch's CPU kernels
take `enable_gqa` with a mask and give the same numbers (each query head reads its group's KV
head); one query token per row is the case measured faster (tools/bench_rollout.py), so prefill
and every other shape keep transformers' own path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "megatron_sdpo_decode_sdpa"


def decode_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, q, D], key / value [B, KV, k, D] ->
    ([B, q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (
        groups == 1
        or query.shape[2] != 1
        or query.device.type != "cpu"
        or dropout
        or kwargs.get("position_bias") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_decode_sdpa(model) -> bool:
    """Switches a CPU model that runs transformers' SDPA to `decode_sdpa` (its mask builder stays
    SDPA's); True when switched. Other implementations and devices are left as they are.
    `model`: a transformers PreTrainedModel."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or next(model.parameters()).device.type != "cpu":
        return False
    AttentionInterface.register(NAME, decode_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
