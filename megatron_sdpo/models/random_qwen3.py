"""A tiny random Qwen3 causal LM for tests and benchmarks (no download, no tokenizer).

The shape is the smallest one every engine accepts: vLLM's CPU attention needs head_dim >= 32,
so 4 heads x 32 = hidden 128. Weights are random but seeded, so two calls give the same model.
"""

from __future__ import annotations

from pathlib import Path

import torch


def hf_shape(*, vocab: int, hidden: int, ffn: int, layers: int, heads: int, kv: int = 0, head_dim: int = 0) -> dict:
    """The size fields of an HF config (their names are the same in every supported model type),
    for a small model of a chosen shape. `kv` and `head_dim` are left out where 0: the
    config's own defaults apply (Olmo derives head_dim; a missing KV head count is the heads')."""
    shape = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
    )
    return {k: v for k, v in shape.items() if v}


TINY_QWEN3 = dict(
    hf_shape(vocab=304, hidden=128, ffn=256, layers=2, heads=4, kv=2, head_dim=32),
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    attention_dropout=0.0,
)

# Widths that differ from the hidden size as Qwen3-4B's do (q = 8 x 16 = 2h, kv = h / 2, a gated
# MLP of 3.75h, not 4h), and every layer narrower than the vocabulary (718, padded 768), so a
# census by width tells the logits from the activations (planning/memory_ledger.py's tests).
QWEN3_SHAPED = dict(
    hf_shape(vocab=718, hidden=64, ffn=240, layers=2, heads=8, kv=2, head_dim=16), max_position_embeddings=128
)


def save_random(model_cls, cfg, path: str | Path, *, seed: int, norms: bool = False) -> str:
    """Build `model_cls(cfg)` in fp32 from `seed` (the global RNG left as it was) and save it
    (safetensors) to `path`; returns the directory as a string. The default init (std 0.02)
    gives near-uniform next-token distributions: a wider output layer makes sampled tokens and
    log-probs informative in tests. `norms`: norm gains drawn around 1 (a misplaced norm then
    changes the outputs)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_cls(cfg).float()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if norms and n.endswith("norm.weight"):
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
            model.lm_head.weight.normal_(0.0, 0.5)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return str(out)


def save_tiny_qwen3(path: str | Path, *, seed: int = 0, **overrides) -> str:
    """Build a random `Qwen3ForCausalLM` with `TINY_QWEN3` (plus `overrides`) and save it
    (safetensors, fp32) to `path`; returns the directory as a string."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return save_random(Qwen3ForCausalLM, Qwen3Config(**{**TINY_QWEN3, **overrides}), path, seed=seed)
