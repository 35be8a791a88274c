"""fp32 rounding bounds for tests that compare two evaluations of the same model function.

Importable from every test folder (pytest puts tests/ on sys.path).

Two ways of computing the same decoder forward (padded vs packed rows, logits path vs fused
kernel) differ only in the order of their sums. A sum of K terms reordered changes by about
sqrt(K) u |terms| (u = 2^-24, random-walk rounding). Along a decoder, each reduction passes its
relative error on to the hidden state, so the relative error of the output is bounded by u times
the sum of sqrt(K) over every reduction on the path:

- per layer: the two RMSNorms and Qwen3's q/k norms (K = hidden, head_dim), the q/k/v
  projections (K = hidden), QK^T (K = head_dim), the attention-weighted sum (K = sequence
  length), the output projection (K = heads * head_dim), gate/up (K = hidden), down (K =
  intermediate);
- then the final norm and the output projection (K = hidden).

A log-softmax passes an absolute error of the logits' size through, so per-token log-probs agree
to `forward_rel * max|logit|`. A gradient runs the chain twice (forward, then backward), so it
gets twice the bound. That bound is norm-wise, per parameter tensor: an element of a weight
gradient is a sum over tokens whose terms can cancel, so its own relative error has no bound
independent of the data, while the tensor's norm is what the next step moves the weights by.
"""

from __future__ import annotations

import math

import torch

U = 2.0**-24


def forward_rel(config: dict, seq_len: int) -> float:
    """Relative fp32 error of a decoder's logits reordered (see the module docstring).
    `config`: HF config fields (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, head_dim)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    attn_width = config["num_attention_heads"] * hd
    per_layer = (
        2 * math.sqrt(h)
        + 2 * math.sqrt(hd)  # input / post-attention norms, q / k norms
        + math.sqrt(h)
        + math.sqrt(hd)
        + math.sqrt(seq_len)
        + math.sqrt(attn_width)  # qkv, QK^T, PV, o
        + math.sqrt(h)
        + math.sqrt(inter)  # gate/up, down
    )
    return U * (layers * per_layer + 2 * math.sqrt(h))


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float) -> None:
    """||got - want|| <= rel * ||want|| for every parameter tensor (norms in float64)."""
    assert got.keys() == want.keys()
    for k in want:
        diff = float((got[k].double() - want[k].double()).norm())
        scale = float(want[k].double().norm())
        assert diff <= rel * scale, f"{k}: |grad diff| {diff:.3e} > {rel:.2e} * |grad| {scale:.3e}"
