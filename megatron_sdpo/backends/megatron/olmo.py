"""Olmo-2 / Olmo-3 decoder layers for megatron-core's GPTModel.

Olmo differs from megatron's pre-norm GPT layer in four ways. Each maps onto a hook that
megatron-core already has, so TransformerBlock, the pipeline schedules, DDP, the optimizer and
dist checkpointing stay megatron's own:

* Post-sublayer norms, ``h = x + norm_a(attn(x))``, ``out = h + norm_f(mlp(h))``:
  ``input_layernorm`` and ``pre_mlp_layernorm`` are IdentityOp, and ``linear_proj`` /
  ``linear_fc2`` are row-parallel linears that normalize their own output (``post_layernorm``)
  before the layer's bias-dropout-add adds the residual.
* QK-norm over all heads at once (``q_norm`` is RMSNorm(heads * head_dim)): `QKNorm` stands in
  for ``q_layernorm`` / ``k_layernorm`` and holds this TP rank's heads' slice of the weight; the
  mean square is summed over the TP group.
* One rotary embedding per layer type (Olmo-3 7B: YaRN on full-attention layers, default RoPE on
  sliding ones). megatron's GPTModel applies one rotary embedding to every layer, so the GPTModel
  is built with ``position_embedding_type="none"`` and each layer's `QKNorm` rotates q / k right
  after normalizing them, which is HF's order (norm, then rope). Frequencies come from
  transformers itself (`ModelSpec.ropes`).
* Sliding windows: TransformerConfig ``window_size`` / ``window_attn_skip_freq``
  (`window_fields`).

Without TE the final norm is this module's `RMSNorm` too (megatron's torch fallback refuses
sequence parallelism). The TE path (TE linears, TEDotProductAttention, TENorm) is assembled the
same way but only the local path runs on CPU.

Positions are 0..S-1 in every row (the backend's batching), so the rope needs no position ids.
This rules out KV-cache inference, packed sequences and context parallelism, which the backend
does not use.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from megatron_sdpo.backends.megatron.norm import param_device
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.weights.plan import ModelSpec, Rope


class RMSNorm(torch.nn.Module):
    """Olmo's RMSNorm over the last dim, as HF computes it: ``weight * x / rms(x)`` in fp32, cast
    back to x's dtype. Weight [hidden_size], replicated over TP."""

    def __init__(self, hidden_size: int, eps: float, config: TransformerConfig):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=param_device(config))
        )
        # Under sequence parallelism each TP rank normalizes its own tokens, so the weight's
        # gradient is partial: finalize_model_grads sums grads of weights marked like this over
        # TP, as it does for megatron's own norms.
        cast(Any, self.weight).sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> same shape and dtype."""
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)


class PostNorm:
    """Mixin for a row-parallel linear: RMSNorm of its TP-reduced output (Olmo's post-sublayer
    norm). Output [s, b, hidden] (s sequence-sharded under sequence parallelism, which a per-token
    norm does not mind)."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, bias: bool, **kwargs):
        if bias:  # the norm would have to follow the bias add (ModelSpec rejects Olmo biases)
            raise ConfigError("Olmo's post-norm linears have no bias")
        # A mixin ahead of megatron's row-parallel linear in the MRO: its __init__ is the one called.
        super().__init__(input_size, output_size, config=config, bias=False, **kwargs)  # type: ignore[call-arg]
        self.post_layernorm = RMSNorm(output_size, config.layernorm_epsilon, config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """x [s, b, in / tp] -> (normalized output [s, b, hidden], no bias)."""
        out, _ = super().forward(x)  # type: ignore[misc]  # the linear's forward (see __init__)
        return self.post_layernorm(out), None


class PostNormRowParallelLinear(PostNorm, RowParallelLinear):
    """megatron's local RowParallelLinear followed by Olmo's post-norm."""


@functools.cache
def te_post_norm_row_parallel_linear() -> type:
    """TERowParallelLinear followed by Olmo's post-norm (made on first use: TE is optional)."""
    from megatron.core.extensions.transformer_engine import TERowParallelLinear

    return type("TEPostNormRowParallelLinear", (PostNorm, TERowParallelLinear), {"__module__": __name__})


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is an all-reduce (sum) as well: every rank's output is the
    total, and each rank's loss reaches the total through its own downstream values only, so the
    gradient w.r.t. each rank's input is the sum of all ranks' output gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class QKNorm(torch.nn.Module):
    """``q_layernorm`` / ``k_layernorm`` of an Olmo attention: RMSNorm over all heads, then the
    layer's rotary embedding.

    SelfAttention calls it on [sq, b, n, D] (n: this TP rank's query heads, or its query groups
    for keys; sq the full sequence, also under sequence parallelism) and gets the same shape back.
    The weight is this rank's [n * D] slice of HF's [heads * D] q_norm / k_norm; rank t's heads are
    contiguous in HF order (see weights.plan). The mean square spans every rank's heads: each rank
    sums its own squares in fp32, then an all-reduce over TP adds them up. That all-reduce must sum
    in backward too (`_SumOverGroup`); megatron's reduce_from_tensor_model_parallel_region has an
    identity backward, right only when everything downstream is replicated over TP.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float,
        *,
        kind: str,
        rope: Rope | None,
    ):
        super().__init__()
        if kind not in ("query", "key"):
            raise ValueError(f"kind={kind!r}; expected 'query' or 'key'")
        heads = config.num_attention_heads if kind == "query" else config.num_query_groups
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.head_dim, self.eps = hidden_size, eps
        self.width = heads * hidden_size  # the full normalized width, over all TP ranks
        local = heads // self.tp * hidden_size
        self.weight = torch.nn.Parameter(torch.ones(local, dtype=config.params_dtype, device=param_device(config)))
        # A TP shard: counted on every rank in the gradient norm, never summed over TP. Not marked
        # sequence_parallel either: q / k cover the whole sequence (linear_qkv gathered it), so
        # each rank's gradient for its heads is already complete.
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
        self.rope_type = rope.rope_type if rope is not None else None
        # A plain attribute, not a buffer: casting the module to bf16 must not round it.
        self.inv_freq = (
            torch.tensor(rope.inv_freq, dtype=torch.float32, device=param_device(config)) if rope is not None else None
        )
        self.attention_scaling = rope.attention_scaling if rope is not None else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [sq, b, n, D] -> normalized (and rotated) [sq, b, n, D], x's dtype."""
        sq, b, n, d = x.shape
        x32 = x.float()
        sumsq = x32.pow(2).sum(dim=(2, 3), keepdim=True)  # [sq, b, 1, 1]
        if self.tp > 1:
            sumsq = _SumOverGroup.apply(sumsq, self.tp_group)
        y = x32 * torch.rsqrt(sumsq / self.width + self.eps)
        y = (self.weight.view(n, d) * y).to(x.dtype)
        return self._rotate(y, self.inv_freq) if self.inv_freq is not None else y

    def _rotate(self, y: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """HF's rotate-half RoPE at positions 0..sq-1, cos/sin in fp32 and scaled by the rope's
        attention scaling, the same elementwise ops as HF so the same values come out."""
        pos = torch.arange(y.shape[0], device=y.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.to(y.device)[None, :]  # [sq, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [sq, 1, 1, D]
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        half = y.shape[-1] // 2
        rotated = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
        return (y * cos + rotated * sin).to(y.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """dist_checkpointing: the weight is a TP shard along dim 0 (the default would save one
        rank's slice as if it were replicated)."""
        sd = self.state_dict(prefix="", keep_vars=True)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            sd, prefix, {"weight": 0}, sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]
        )

    def extra_repr(self) -> str:
        return f"width={self.width}, local={self.weight.numel()}, eps={self.eps}, rope={self.rope_type}"


class OlmoSelfAttention(SelfAttention):
    """megatron's SelfAttention with `QKNorm` as q_layernorm / k_layernorm, set after the parent
    built everything else. Not through SelfAttentionSubmodules: megatron-core 0.19 refuses q/k norm
    specs unless config.qk_layernorm is on, and that flag makes finalize_model_grads sum every
    q/k_layernorm gradient over TP, wrong for these TP-sharded weights."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        *args,
        q_norm: ModuleSpec,
        k_norm: ModuleSpec,
        **kwargs,
    ):
        super().__init__(config, submodules, *args, **kwargs)
        for name, norm in (("q_layernorm", q_norm), ("k_layernorm", k_norm)):
            setattr(
                self,
                name,
                build_module(
                    norm, config=config, hidden_size=self.hidden_size_per_attention_head, eps=config.layernorm_epsilon
                ),
            )


def window_fields(spec: ModelSpec) -> dict:
    """TransformerConfig fields for sliding-window layers ({} when every layer attends fully).

    HF lets query i attend key j iff ``i - W < j <= i`` (masking_utils.sliding_window_overlay:
    ``kv_idx > q_idx - sliding_window``), i.e. W keys counting its own. megatron's
    ``window_size=(left, right)`` allows ``i - left <= j <= i + right``
    (transformer.utils.get_sliding_window_causal_mask; TE reads it the same way), so
    left = W - 1, right = 0. ``window_attn_skip_freq`` lists 1 for each sliding layer, indexed by
    megatron's global 1-based layer number minus one.
    """
    if "sliding_attention" not in spec.layer_types:
        return {}
    if spec.sliding_window is None:
        raise ConfigError("sliding-attention layers need spec.sliding_window")
    return dict(
        window_size=(spec.sliding_window - 1, 0),
        window_attn_skip_freq=[int(t == "sliding_attention") for t in spec.layer_types],
    )


def layer_spec(spec: ModelSpec, layer: int, use_te: bool) -> ModuleSpec:
    """The spec of global layer `layer` (0-based): its rope is the one of its layer type."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TEDotProductAttention

        column, core, row = TEColumnParallelLinear, TEDotProductAttention, te_post_norm_row_parallel_linear()
    else:
        column, core, row = ColumnParallelLinear, DotProductAttention, PostNormRowParallelLinear
    rope = spec.rope(layer)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=ModuleSpec(
                module=OlmoSelfAttention,
                params={
                    "attn_mask_type": AttnMaskType.causal,
                    "q_norm": ModuleSpec(module=QKNorm, params={"kind": "query", "rope": rope}),
                    "k_norm": ModuleSpec(module=QKNorm, params={"kind": "key", "rope": rope}),
                },
                submodules=SelfAttentionSubmodules(linear_qkv=column, core_attention=core, linear_proj=row),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(spec: ModelSpec, config: TransformerConfig, use_te: bool, pp_rank: int) -> TransformerBlockSubmodules:
    """Layer specs of pipeline stage `pp_rank` (one per layer: ropes differ by layer type) and the
    final norm: TE's under TE, else `RMSNorm` (HF's formula, and unlike megatron's torch-norm
    fallback it runs under sequence parallelism)."""
    if spec.norm_placement != "post" or spec.qk_norm != "full":
        raise ConfigError(f"{spec.arch}: the Olmo layer spec needs post-norms and full-width QK-norm")
    first = get_transformer_layer_offset(config, None, pp_rank)
    n = get_num_layers_to_build(config, None, pp_rank)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = RMSNorm
    layers = [layer_spec(spec, first + i, use_te) for i in range(n)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)
