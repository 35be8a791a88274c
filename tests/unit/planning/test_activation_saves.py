"""What one megatron layer of each paper model's family keeps for backward, against the memory
ledger's per-token activation count (memory_ledger.activation_units and activation_token_bytes).

The layer is the code's own (model.layer_spec for Qwen3, olmo.layer_spec for Olmo-3), built from
the preset's architecture with every width divided by one factor, so the head, KV-head and FFN
ratios to the hidden size are the preset's (Qwen3-4B: q 1.6h, kv 0.4h, f 3.8h; Olmo-3-7B: MHA,
f 2.6875h), in bf16 with the core attention recomputed (selective: Olmo-3's preset; Qwen3-4B's
recomputes whole layers, and in backward each layer's forward runs again and keeps this count
until its backward). One forward runs under
`torch.autograd.graph.saved_tensors_hooks` (memory_census.SavedTensors), which records every saved
tensor by storage: a view keeps its whole buffer, so a buffer counts once and whole.

The CPU build runs megatron's local spec, not Transformer Engine's. Two of its pieces differ on
the GPU and are replaced by what the GPU's keep:
- the core attention: its saves are not counted (checkpointed, it runs without autograd; the
  checkpoint keeps q, k and v, and that is recorded as the GPU's);
- Qwen3's RMSNorms (this project's norm.RMSNorm, torch's rms_norm, which keeps fp32 copies on
  CPU): Transformer Engine's norms keep their bf16 input and an fp32 scale per row, so the test
  runs them as a function that saves exactly that. Olmo's norms are olmo.py's own modules on
  the GPU too, and run as they are.

Per-token terms that do not scale with h (the norms' scales, Olmo's rope tables per position)
are compared apart, in bytes; a few bytes per step (scalars) are neither. The ledger counts whole
tensors from the shapes, so the recorded units equal its units at any width with these ratios;
the bound is the issue's 10%, far tighter than the gap it had (42.8 against 61.2 recorded for
Qwen3, 36.1 against 74.9 for Olmo-3).
"""

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

SEQ, ROWS = 64, 2  # two rows: a tensor shared by the rows (a rope table) shows as [s, 1, ...]
# Every width divided by this (head_dim too, so the head counts stay the preset's).
SHRINK = {"qwen3_4b": 16, "olmo3_7b": 32}


def _small(preset: str):
    """The preset's architecture, one layer (full attention), every width / SHRINK[preset]."""
    from megatron_sdpo.config import load_config
    from megatron_sdpo.planning.launch_plan import resolve_arch

    cfg = load_config(preset)
    spec, d = resolve_arch(cfg)[1], SHRINK[preset]
    for width in (spec.hidden_size, spec.head_dim // 2, spec.ffn_hidden_size):
        assert width % d == 0, (preset, width, d)
    ropes = tuple((t, dataclasses.replace(r, inv_freq=r.inv_freq[::d])) for t, r in spec.ropes if t == "full_attention")
    small = dataclasses.replace(
        spec,
        num_layers=1,
        hidden_size=spec.hidden_size // d,
        head_dim=spec.head_dim // d,
        ffn_hidden_size=spec.ffn_hidden_size // d,
        layer_types=("full_attention",) if spec.layer_types else (),
        ropes=ropes,
        vocab_size=256,
    )
    return small, cfg.backend.megatron.recompute


class _TENormRule(torch.autograd.Function):
    """RMSNorm as Transformer Engine's kernel keeps it for backward: the bf16 input and the fp32
    inverse RMS per row (and the weight). Forward only: the test never runs backward."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x32 * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("the saved-tensor census runs forward only")


def _worker(preset: str) -> dict:
    from megatron.core.transformer.spec_utils import build_module

    from megatron_sdpo.backends.megatron import model as M
    from megatron_sdpo.backends.megatron import olmo
    from megatron_sdpo.backends.megatron.norm import RMSNorm
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig, initialize
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig
    from megatron_sdpo.planning import memory_census as mc

    initialize(ParallelConfig(tp=1, pp=1))
    spec, recompute = _small(preset)
    options = M.ModelOptions(precision=PrecisionConfig(params="bfloat16"), recompute="selective")
    config = M.transformer_config(spec, 1, 1, options)
    layer_spec = M.layer_spec(spec, False) if spec.norm_placement == "pre" else olmo.layer_spec(spec, 0, False)
    layer = build_module(layer_spec, config=config, layer_number=1)
    te_norms = 0
    for m in layer.modules():
        if isinstance(m, RMSNorm):  # Transformer Engine's norm on the GPU
            m.forward = lambda x, m=m: _TENormRule.apply(x, m.weight, m.eps)
            te_norms += 1
    core = layer.self_attention.core_attention
    plain = core.forward
    grad_in_core: list[bool] = []

    def core_forward(*args, **kwargs):
        # The CPU kernel's own saves are not the fused kernel's: none are counted. Selectively
        # recomputed, it runs inside megatron's checkpoint, without autograd.
        grad_in_core.append(torch.is_grad_enabled())
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return plain(*args, **kwargs)

    core.forward = core_forward
    x = torch.randn(SEQ, ROWS, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    weights = mc.storage_bytes(list(layer.parameters()))[1]
    with mc.SavedTensors(exclude=weights) as saved:
        layer(x)
    tokens = SEQ * ROWS
    scaled = constant = step = 0
    for key, n in saved.by_key.items():
        shape = saved.shapes[key]
        if n < tokens:
            step += n  # scalars: per step, not per token
        elif shape[-1] == 1 or (len(shape) > 1 and shape[1] != ROWS):
            constant += n  # a scale per row or a table per position
        else:
            scaled += n
    return {
        "spec": spec,
        "recompute": recompute,
        "te_norms": te_norms,
        "grad_in_core": grad_in_core,
        "units": scaled / tokens / spec.hidden_size,
        "token_bytes": constant / tokens,
        "step_bytes": step,
        "items": sorted((saved.shapes[k], n // tokens) for k, n in saved.by_key.items()),
    }


@pytest.fixture(scope="module", params=["qwen3_4b", "olmo3_7b"])
def recorded(request):
    from megatron_sdpo.backends.megatron.launch import spawn

    return request.param, spawn(_worker, 1, request.param, timeout_s=240)[0]


def test_the_layer_is_the_presets_family(recorded):
    preset, got = recorded
    spec = got["spec"]
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if preset == "qwen3_4b":
        # GQA, per-head QK-norm: four TE norms (input, pre-MLP, q, k).
        assert (q / spec.hidden_size, kv / spec.hidden_size, spec.ffn_hidden_size / spec.hidden_size) == (1.6, 0.4, 3.8)
        assert spec.norm_placement == "pre" and spec.qk_norm == "head" and got["te_norms"] == 4
    else:
        assert (q, kv, spec.ffn_hidden_size / spec.hidden_size) == (spec.hidden_size, spec.hidden_size, 2.6875)
        assert spec.norm_placement == "post" and spec.qk_norm == "full" and got["te_norms"] == 0
    assert got["recompute"] == ("full" if preset == "qwen3_4b" else "selective")
    assert got["grad_in_core"] == [False]


def test_the_ledger_counts_what_the_layer_saves(recorded):
    from megatron_sdpo.planning.memory_ledger import activation_token_bytes, activation_units

    preset, got = recorded
    spec = got["spec"]
    ledger = activation_units(spec)
    print(
        f"{preset}: recorded {got['units']:.3f} units per token and h, ledger {ledger:.3f}; per-token constants "
        f"recorded {got['token_bytes']:.1f} B, ledger {activation_token_bytes(spec, ROWS)} B; per step "
        f"{got['step_bytes']} B; saved {got['items']}"
    )
    assert abs(ledger - got["units"]) <= 0.10 * got["units"], (ledger, got["units"], got["items"])
    # The norms' scales and the rope tables: whole bytes, counted exactly.
    assert got["token_bytes"] == activation_token_bytes(spec, ROWS), got["items"]
    assert got["step_bytes"] <= 64
