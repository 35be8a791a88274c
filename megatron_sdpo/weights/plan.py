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

Olmo-2/3 (``norm_placement="post"``, ``qk_norm="full"``; modules in
`megatron_sdpo.backends.megatron.olmo`):
* There is no pre-norm. ``post_attention_layernorm`` / ``post_feedforward_layernorm`` normalize
  the sublayer output and live inside the row-parallel output linears, as
  ``linear_proj.post_layernorm`` and ``linear_fc2.post_layernorm`` (same names in both specs).
* ``q_norm`` / ``k_norm`` span all heads ([heads * D]). TP rank t holds the heads of its query
  groups, which are contiguous in HF order, so they split along dim 0 in tp equal blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sdpo.errors import ConfigError

SUPPORTED = ("qwen3", "llama", "olmo2", "olmo3")
OLMO = ("olmo2", "olmo3")
# RoPE types whose frequencies HF computes once at init (no sequence-length-dependent update,
# unlike "dynamic" and "longrope"); Olmo takes any of them through transformers' own functions.
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")

# Shard kinds: how a full megatron tensor splits over TP ranks.
REPLICATED = "replicated"  # every rank holds the whole tensor (norms)
COLUMN = "column"  # split along dim 0 (output features): linear_qkv
ROW = "row"  # split along dim 1 (input features): linear_proj, linear_fc2
FC1 = "fc1"  # gate and up each split along dim 0, then concatenated per rank
VOCAB = "vocab"  # split along dim 0 after padding the vocabulary: embedding, output layer
HEADS = "heads"  # one HF tensor split along dim 0 in whole heads: Olmo's full-width q/k norms


@dataclass(frozen=True)
class Rope:
    """One rotary embedding exactly as HF builds it: inverse frequencies [head_dim / 2] (fp32
    values) and the factor HF multiplies cos and sin by (YaRN's attention scaling, else 1.0)."""

    rope_type: str
    inv_freq: tuple[float, ...] = field(repr=False)
    attention_scaling: float = 1.0


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts shared by HF and megatron (dense decoder, SwiGLU, RMSNorm, RoPE).

    qk_norm: None, "head" (Qwen3: one RMSNorm over head_dim, shared by all heads) or "full"
    (Olmo: RMSNorm over all heads at once). norm_placement: "pre" (norm before each sublayer) or
    "post" (Olmo: norm of each sublayer's output). layer_types: per layer "full_attention" or
    "sliding_attention" (empty: all full); sliding layers attend to the last `sliding_window`
    tokens including their own. ropes: (layer type, Rope) pairs when each layer type has its own
    rotary embedding applied by the Olmo attention (empty: megatron's RotaryEmbedding with
    rope_theta for every layer)."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: str | None
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    norm_placement: str = "pre"
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    ropes: tuple[tuple[str, Rope], ...] = ()

    @classmethod
    def from_hf_config(cls, config) -> ModelSpec:
        """Read an HF `PretrainedConfig` (Qwen3, Llama, Olmo-2, Olmo-3); raise ConfigError for
        what has no mapping (biases, other activations, rope types, sliding windows outside Olmo)."""
        arch = getattr(config, "model_type", None)
        if arch not in SUPPORTED:
            raise ConfigError(
                f"model_type={arch!r} is not supported by the megatron backend; expected one of {SUPPORTED}"
            )
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ConfigError(f"{arch}: attention_bias/mlp_bias=True is not supported by the weight plan")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{arch}: hidden_act={act!r}; only SwiGLU (silu) is mapped")
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if heads % kv:
            raise ConfigError(f"{arch}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        common = dict(
            arch=arch,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 4096)),
        )
        if arch in OLMO:
            return cls(**common, **_olmo_fields(config, arch, head_dim))
        if getattr(config, "layer_types", None) and any(t != "full_attention" for t in config.layer_types):
            raise ConfigError(f"{arch}: sliding-window layers are not supported by the megatron backend")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{arch}: rope_type={rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise ConfigError(f"{arch}: the HF config has no rope_theta")
        return cls(**common, qk_norm="head" if arch == "qwen3" else None, rope_theta=float(theta))

    def layer_type(self, layer: int) -> str:
        """Attention type of global layer `layer` (0-based)."""
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def rope(self, layer: int) -> Rope | None:
        """The rotary embedding of global layer `layer` when layers carry their own (Olmo)."""
        return dict(self.ropes).get(self.layer_type(layer)) if self.ropes else None


def _olmo_fields(config, arch: str, head_dim: int) -> dict:
    """ModelSpec fields particular to Olmo-2/3: post-norms, full-width QK-norm, layer types,
    sliding window and one rotary embedding per layer type, computed by transformers itself."""
    n = config.num_hidden_layers
    types = tuple(getattr(config, "layer_types", None) or ("full_attention",) * n)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if len(types) != n or unknown:
        raise ConfigError(f"{arch}: layer_types must list one of {LAYER_TYPES} per layer (got {unknown or len(types)})")
    window = None
    if "sliding_attention" in types:
        window = getattr(config, "sliding_window", None)
        if not isinstance(window, int) or window < 1:
            raise ConfigError(f"{arch}: sliding_attention layers need an integer sliding_window >= 1, got {window!r}")
    ropes = tuple((t, _hf_rope(config, arch, t if arch == "olmo3" else None, head_dim)) for t in sorted(set(types)))
    # rope_theta is informational here (the ropes carry the frequencies): the full-attention one.
    ref = "full_attention" if "full_attention" in types else types[0]
    params = config.rope_parameters[ref] if arch == "olmo3" else config.rope_parameters
    return dict(
        qk_norm="full",
        norm_placement="post",
        layer_types=types,
        sliding_window=window,
        ropes=ropes,
        rope_theta=float(params["rope_theta"]),
    )


def _hf_rope(config, arch: str, layer_type: str | None, head_dim: int) -> Rope:
    """The rotary embedding HF's `<Arch>RotaryEmbedding` builds for `layer_type` (None: the one
    rope of Olmo-2), by calling the same transformers functions with the same config."""
    import importlib

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ConfigError(
            f"{arch}: rope_type={rope_type!r} for {layer_type or 'all layers'} is not supported "
            f"(supported: {STATIC_ROPE_TYPES}; dynamic/longrope change with the sequence length)"
        )
    if rope_type == "default":
        modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        init = getattr(modeling, f"{arch.capitalize()}RotaryEmbedding").compute_default_rope_parameters
    else:
        init = ROPE_INIT_FUNCTIONS[rope_type]
    kwargs = {"layer_type": layer_type} if layer_type else {}
    inv_freq, scaling = init(config, **kwargs)
    if tuple(inv_freq.shape) != (head_dim // 2,):
        raise ConfigError(f"{arch}: partial rotary embeddings are not supported (inv_freq {tuple(inv_freq.shape)})")
    return Rope(rope_type, tuple(float(x) for x in inv_freq.float()), float(scaling))


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
            raise ConfigError(
                f"tp={self.tp} must divide backend.megatron.vocab_divisor={self.vocab_divisor} (vocabulary padding)"
            )
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
        post = spec.norm_placement == "post"
        if not post:
            attn_norm = (
                f"{m}.self_attention.linear_qkv.layer_norm_weight" if layout.te_names else f"{m}.input_layernorm.weight"
            )
            out.append(Mapping(attn_norm, (f"{h}.input_layernorm.weight",), REPLICATED, (H,)))
        qkv = tuple(f"{h}.self_attn.{p}_proj.weight" for p in "qkv")
        out.append(Mapping(f"{m}.self_attention.linear_qkv.weight", qkv, COLUMN, (qkv_rows, H)))
        if spec.qk_norm is not None:
            # "head": one [D] weight shared by all heads; "full": [heads * D], split by head over TP.
            full = spec.qk_norm == "full"
            kind = HEADS if full else REPLICATED
            for p, n in (("q", spec.num_heads), ("k", spec.num_kv_heads)):
                name = f"{m}.self_attention.{p}_layernorm.weight"
                out.append(Mapping(name, (f"{h}.self_attn.{p}_norm.weight",), kind, (n * D,) if full else (D,)))
        proj = f"{m}.self_attention.linear_proj"
        out.append(Mapping(f"{proj}.weight", (f"{h}.self_attn.o_proj.weight",), ROW, (H, spec.num_heads * D)))
        if post:
            out.append(
                Mapping(f"{proj}.post_layernorm.weight", (f"{h}.post_attention_layernorm.weight",), REPLICATED, (H,))
            )
        else:
            mlp_norm = f"{m}.mlp.linear_fc1.layer_norm_weight" if layout.te_names else f"{m}.pre_mlp_layernorm.weight"
            out.append(Mapping(mlp_norm, (f"{h}.post_attention_layernorm.weight",), REPLICATED, (H,)))
        fc1 = (f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight")
        out.append(Mapping(f"{m}.mlp.linear_fc1.weight", fc1, FC1, (2 * spec.ffn_hidden_size, H)))
        fc2 = f"{m}.mlp.linear_fc2"
        out.append(Mapping(f"{fc2}.weight", (f"{h}.mlp.down_proj.weight",), ROW, (H, spec.ffn_hidden_size)))
        if post:
            out.append(
                Mapping(f"{fc2}.post_layernorm.weight", (f"{h}.post_feedforward_layernorm.weight",), REPLICATED, (H,))
            )
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
