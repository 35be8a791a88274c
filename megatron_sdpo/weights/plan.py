"""The HF <-> megatron-core GPTModel weight plan: names, shapes and tensor-parallel shard axes.

Pure: no process groups, no model. `ModelSpec` holds the architecture facts read from an HF
config, `Layout` the parallel layout, and `plan()` lists, for one pipeline stage, every
megatron parameter with the HF tensors it is built from and how it is split over TP ranks.

Megatron layouts that differ from HF:
* ``linear_qkv`` stacks, per query group g, the group's query heads, then its key head, then its
  value head: rows ``[q_g0 .. q_g(r-1), k_g, v_g]`` with r = heads / groups. A column-parallel
  split along dim 0 then hands each TP rank whole query groups.
* ``linear_fc1`` is ``[gate; up]`` *per TP shard*: rank t holds ``[gate_t; up_t]``, so the full
  tensor at TP=1 is ``[gate; up]`` and sharding splits gate and up separately.
* The vocabulary is padded to a multiple of ``vocab_divisor`` (default 128), which must be a
  multiple of tp. Unlike megatron's ``make_vocab_size_divisible_by * tp`` the padded size does
  not depend on tp, so a checkpoint resumes under another TP size. Padded rows are zero on
  import and dropped on export (the backend cuts their logits off before any softmax).
* Layer norms are separate modules in the local spec (``input_layernorm``,
  ``pre_mlp_layernorm``) and fused into the next linear in the Transformer Engine spec
  (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).
* Pipeline stage p holds layers ``[p * L/pp, (p+1) * L/pp)`` under local indices 0..L/pp-1.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sdpo.errors import ConfigError

SUPPORTED = ("qwen3", "llama")

# Shard kinds: how a full megatron tensor splits over TP ranks.
REPLICATED = "replicated"  # every rank holds the whole tensor (norms)
COLUMN = "column"  # split along dim 0 (output features): linear_qkv
ROW = "row"  # split along dim 1 (input features): linear_proj, linear_fc2
FC1 = "fc1"  # gate and up each split along dim 0, then concatenated per rank
VOCAB = "vocab"  # split along dim 0 after padding the vocabulary: embedding, output layer


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts shared by HF and megatron (dense decoder, SwiGLU, RMSNorm, RoPE)."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        """Read an HF `PretrainedConfig` (Qwen3, Llama); raise ConfigError for what has no
        megatron GPT equivalent (Olmo-3's post-norms, biases, sliding windows...)."""
        arch = getattr(config, "model_type", None)
        if arch == "olmo3" or arch == "olmo2":
            raise ConfigError(
                f"model_type={arch!r}: Olmo-2/3 put RMSNorm after each sublayer and normalize q/k over "
                "all heads at once; megatron-core's GPT layer has pre-norms and per-head QK-norm, so "
                "there is no weight mapping (use the HF backend for Olmo)"
            )
        if arch not in SUPPORTED:
            raise ConfigError(f"model_type={arch!r} is not supported by the megatron backend; expected one of {SUPPORTED}")
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ConfigError(f"{arch}: attention_bias/mlp_bias=True is not supported by the weight plan")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{arch}: hidden_act={act!r}; only SwiGLU (silu) is mapped")
        if getattr(config, "layer_types", None) and any(t != "full_attention" for t in config.layer_types):
            raise ConfigError(f"{arch}: sliding-window layers are not supported by the megatron backend")
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{arch}: rope_type={rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise ConfigError(f"{arch}: the HF config has no rope_theta")
        if heads % kv:
            raise ConfigError(f"{arch}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        return cls(
            arch=arch,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=arch == "qwen3",
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 4096)),
        )


@dataclass(frozen=True)
class Layout:
    """Parallel layout as the weight plan sees it (DP does not change any weight)."""

    tp: int = 1
    pp: int = 1
    vocab_divisor: int = 128  # padded vocab = multiple of this (independent of tp; tp must divide it)
    te_names: bool = False  # Transformer Engine spec: layer norms fused into the next linear

    def padded_vocab(self, spec: ModelSpec) -> int:
        """Vocabulary padded to a multiple of vocab_divisor (the same for every tp)."""
        m = self.vocab_divisor
        return -(-spec.vocab_size // m) * m

    def validate(self, spec: ModelSpec) -> None:
        """ConfigError when the layout cannot split this model."""
        if self.tp < 1 or self.pp < 1 or self.vocab_divisor < 1:
            raise ConfigError(f"tp={self.tp}, pp={self.pp}, vocab_divisor={self.vocab_divisor} must all be >= 1")
        if self.vocab_divisor % self.tp:
            raise ConfigError(f"tp={self.tp} must divide model.vocab_divisor={self.vocab_divisor} (vocabulary padding)")
        if spec.num_kv_heads % self.tp:
            raise ConfigError(f"tp={self.tp} must divide num_key_value_heads={spec.num_kv_heads}")
        if spec.ffn_hidden_size % self.tp:
            raise ConfigError(f"tp={self.tp} must divide intermediate_size={spec.ffn_hidden_size}")
        if spec.num_layers % self.pp:
            raise ConfigError(f"pp={self.pp} must divide num_hidden_layers={spec.num_layers}")

    def stage_layers(self, spec: ModelSpec, pp_rank: int) -> range:
        """Global layer indices held by pipeline stage `pp_rank`."""
        n = spec.num_layers // self.pp
        return range(pp_rank * n, (pp_rank + 1) * n)


@dataclass(frozen=True)
class Mapping:
    """One megatron parameter of one stage: its local name, the HF tensors it is made of,
    how it splits over TP, and its full (unsharded, vocab-padded) shape."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    shape: tuple[int, ...]


def _hf_layer(spec: ModelSpec, i: int) -> str:
    return f"model.layers.{i}"


def plan(spec: ModelSpec, layout: Layout, pp_rank: int) -> list[Mapping]:
    """Every megatron parameter of pipeline stage `pp_rank`, in state-dict order."""
    layout.validate(spec)
    if not 0 <= pp_rank < layout.pp:
        raise ConfigError(f"pp_rank={pp_rank} out of range for pp={layout.pp}")
    H, D = spec.hidden_size, spec.head_dim
    qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * D
    V = layout.padded_vocab(spec)
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    out: list[Mapping] = []
    if first:
        out.append(Mapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB, (V, H)))
    for local, i in enumerate(layout.stage_layers(spec, pp_rank)):
        m, h = f"decoder.layers.{local}", _hf_layer(spec, i)
        attn_norm = (
            f"{m}.self_attention.linear_qkv.layer_norm_weight" if layout.te_names else f"{m}.input_layernorm.weight"
        )
        mlp_norm = f"{m}.mlp.linear_fc1.layer_norm_weight" if layout.te_names else f"{m}.pre_mlp_layernorm.weight"
        out.append(Mapping(attn_norm, (f"{h}.input_layernorm.weight",), REPLICATED, (H,)))
        qkv = tuple(f"{h}.self_attn.{p}_proj.weight" for p in "qkv")
        out.append(Mapping(f"{m}.self_attention.linear_qkv.weight", qkv, COLUMN, (qkv_rows, H)))
        if spec.qk_norm:
            out.append(Mapping(f"{m}.self_attention.q_layernorm.weight", (f"{h}.self_attn.q_norm.weight",), REPLICATED, (D,)))
            out.append(Mapping(f"{m}.self_attention.k_layernorm.weight", (f"{h}.self_attn.k_norm.weight",), REPLICATED, (D,)))
        out.append(
            Mapping(f"{m}.self_attention.linear_proj.weight", (f"{h}.self_attn.o_proj.weight",), ROW, (H, spec.num_heads * D))
        )
        out.append(Mapping(mlp_norm, (f"{h}.post_attention_layernorm.weight",), REPLICATED, (H,)))
        fc1 = (f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight")
        out.append(Mapping(f"{m}.mlp.linear_fc1.weight", fc1, FC1, (2 * spec.ffn_hidden_size, H)))
        out.append(Mapping(f"{m}.mlp.linear_fc2.weight", (f"{h}.mlp.down_proj.weight",), ROW, (H, spec.ffn_hidden_size)))
    if last:
        out.append(Mapping("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED, (H,)))
        if not spec.tie_word_embeddings:
            out.append(Mapping("output_layer.weight", ("lm_head.weight",), VOCAB, (V, H)))
        elif not first:
            # Tied weights under PP: the last stage keeps its own copy of the embedding, kept
            # equal to the first stage's by megatron's embedding-group all-reduce.
            out.append(Mapping("output_layer.weight", ("model.embed_tokens.weight",), VOCAB, (V, H)))
    return out


def hf_names(spec: ModelSpec) -> list[str]:
    """HF parameter names of the whole model, in the order export streams them."""
    names: list[str] = []
    full = Layout()
    for mp in plan(spec, full, 0):
        for n in mp.hf:
            if n not in names:
                names.append(n)
    return names


def owner_stage(spec: ModelSpec, layout: Layout, hf_name: str) -> int:
    """The pipeline stage that owns HF tensor `hf_name` for export (the embedding: stage 0)."""
    if hf_name.startswith("model.layers."):
        return int(hf_name.split(".")[2]) // (spec.num_layers // layout.pp)
    if hf_name == "model.embed_tokens.weight":
        return 0
    return layout.pp - 1
