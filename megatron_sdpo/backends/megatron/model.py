"""Model provider: a megatron-core GPTModel (this rank's pipeline stage) from an HF config.

The layer spec is chosen once per process: Transformer Engine modules when TE is importable
(required for FP8), megatron-core's local modules otherwise (CPU, tests). The weight plan
(`megatron_sdpo.weights`) knows both naming schemes. Olmo-2/3 (post-norms, full-width QK-norm,
a rope per layer type, sliding windows) use the layers of `megatron_sdpo.backends.megatron.olmo`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_sdpo.backends.megatron.norm import RMSNorm
from megatron_sdpo.backends.megatron.precision import (
    PrecisionConfig,
    have_transformer_engine,
    transformer_config_fields,
)
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.weights.plan import Layout, ModelSpec


@dataclass(frozen=True)
class ModelOptions:
    """Knobs of the megatron model that are not architecture facts."""

    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    sequence_parallel: bool = False
    recompute: str | None = None  # None | "full" (every layer) | "selective" (core attention)
    vocab_divisor: int = 128  # padded vocab = multiple of this, whatever tp (see weights.plan)
    use_te: bool | None = None  # None: TE when importable
    perform_initialization: bool = True  # False when weights are loaded right after building


def resolve_use_te(options: ModelOptions) -> bool:
    """Whether this process builds Transformer Engine layers."""
    have = have_transformer_engine()
    if options.use_te and not have:
        raise ConfigError("model.use_te=True but Transformer Engine is not installed")
    if options.use_te is None:
        return have and torch.cuda.is_available()
    return bool(options.use_te)


def weight_layout(tp: int, pp: int, options: ModelOptions) -> Layout:
    """The weight plan's view of this model's layout (names depend on the layer spec)."""
    return Layout(tp=tp, pp=pp, vocab_divisor=options.vocab_divisor, te_names=resolve_use_te(options))


def transformer_config(
    spec: ModelSpec,
    tp: int,
    pp: int,
    options: ModelOptions = ModelOptions(),
    *,
    gpu: bool | None = None,
    have_te: bool | None = None,
    capability: tuple[int, int] | None = None,
):
    """The megatron `TransformerConfig` for `spec` at TP=tp, PP=pp (validated).

    gpu / have_te / capability describe the target machine (default: this one), so that a CPU
    test can check the config a GPU machine would build."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    Layout(tp=tp, pp=pp, vocab_divisor=options.vocab_divisor).validate(spec)
    if options.sequence_parallel and tp == 1:
        raise ConfigError("model.sequence_parallel=True needs tp > 1")
    recompute: dict = {}
    if options.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif options.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif options.recompute is not None:
        raise ConfigError(f"model.recompute={options.recompute!r}; expected null, 'full' or 'selective'")
    gpu = torch.cuda.is_available() if gpu is None else gpu
    have_te = have_transformer_engine() if have_te is None else have_te
    fused = gpu and have_te
    fields = transformer_config_fields(
        options.precision, have_te=have_te, capability=capability, detect_capability=capability is None and gpu
    )
    fields.setdefault("pipeline_dtype", torch.float32 if pp > 1 else None)
    if spec.norm_placement == "post":
        from megatron_sdpo.backends.megatron.olmo import window_fields

        fields.update(window_fields(spec))
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=options.sequence_parallel,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        # Only megatron's per-head QK-norm: finalize_model_grads sums q/k_layernorm grads over TP
        # when this is set, which would be wrong for Olmo's TP-sharded full-width norms.
        qk_layernorm=spec.qk_norm == "head",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # On CPU every fused kernel is absent; on GPU the TE/apex paths supply them.
        bias_activation_fusion=False,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=fused,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=not gpu,
        perform_initialization=options.perform_initialization,
        # gloo has no stream to sync on; the sync is a CUDA workaround.
        batch_p2p_sync=gpu,
        **recompute,
        **fields,
    )


def layer_spec(spec: ModelSpec, use_te: bool):
    """The GPT layer spec of pre-norm models: TE modules (fused norms, FP8-capable linears,
    varlen attention) or local modules with this project's RMSNorm (megatron's torch-norm
    fallback refuses sequence parallelism) and core attention that takes packed rows.
    (Olmo: `olmo.block_spec`, one spec per layer.)"""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if spec.norm_placement != "pre":
        raise ConfigError(f"{spec.arch}: post-norm layers are built by olmo.block_spec, not layer_spec")
    qk = spec.qk_norm == "head"
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk)
    from megatron_sdpo.backends.megatron.packed import VarlenDotProductAttention

    layer = specs.get_gpt_layer_local_spec(qk_layernorm=qk, normalization="RMSNorm")
    sub = layer.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = RMSNorm
    # megatron's local attention plus packed (THD) rows (packed.py).
    sub.self_attention.submodules.core_attention = VarlenDotProductAttention
    if qk:
        sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = RMSNorm
    return layer


def supports_packing(spec: ModelSpec) -> bool:
    """Whether this model's layers take packed (THD) rows: the pre-norm spec's do; Olmo's
    attention applies its per-layer ropes itself, over the padded layout only."""
    return spec.norm_placement == "pre" and not spec.ropes


def block_spec(spec: ModelSpec, config, use_te: bool, pp_rank: int):
    """This stage's layer specs and final norm (TE's under TE, else this project's RMSNorm)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if spec.norm_placement == "post":
        from megatron_sdpo.backends.megatron.olmo import block_spec as olmo_block_spec

        return olmo_block_spec(spec, config, use_te, pp_rank)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = RMSNorm
    n = get_num_layers_to_build(config, None, pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec(spec, use_te)] * n, layer_norm=final_norm)


def build_model(spec: ModelSpec, options: ModelOptions = ModelOptions()):
    """This rank's GPTModel stage, on the current megatron parallel state.

    The vocabulary is padded per the weight plan; callers mask logits of padded ids."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    config = transformer_config(spec, tp, pp, options)
    use_te = resolve_use_te(options)
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(spec, config, use_te, ps.get_pipeline_model_parallel_rank()),
        vocab_size=weight_layout(tp, pp, options).padded_vocab(spec),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        # Per-layer ropes are applied inside the Olmo attention (megatron has one rope per model).
        position_embedding_type="none" if spec.ropes else "rope",
        rotary_percent=1.0,
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
    )
