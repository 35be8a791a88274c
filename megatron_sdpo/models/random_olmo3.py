"""A tiny random Olmo-3 causal LM for tests (no download): Olmo-3-7B's architecture at toy size.

What makes Olmo-3 differ from the Qwen3 the other tests use is all kept: norms after attention
and MLP instead of before, a full-width QK-norm, three sliding-window layers to one
full-attention layer, YaRN (factor 8, as the 7B) on the full-attention layers only, and as
many key-value heads as query heads. The window and YaRN's original length are small, so both
change the outputs of sequences of a few dozen tokens. vLLM's CPU attention needs head_dim >= 32.
"""

from __future__ import annotations

from pathlib import Path

from megatron_sdpo.models.random_qwen3 import hf_shape, save_random

TINY_OLMO3 = dict(
    hf_shape(vocab=304, hidden=128, ffn=256, layers=4, heads=4, kv=4),
    max_position_embeddings=512,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    sliding_window=16,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
)


def save_tiny_olmo3(path: str | Path, *, seed: int = 0, **overrides) -> str:
    """Build a random `Olmo3ForCausalLM` with `TINY_OLMO3` (plus `overrides`), its norm gains
    away from 1, and save it (safetensors, fp32) to `path`; returns the directory as a string."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    return save_random(Olmo3ForCausalLM, Olmo3Config(**{**TINY_OLMO3, **overrides}), path, seed=seed, norms=True)
