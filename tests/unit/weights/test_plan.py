"""The HF <-> megatron weight plan, checked against real HF models and hand-written layouts."""

import pytest
import torch
import transformers

from megatron_sdpo.errors import CheckpointError, ConfigError
from megatron_sdpo.models.random_qwen3 import hf_shape
from megatron_sdpo.weights import (
    Layout,
    Mapping,
    ModelSpec,
    hf_names,
    hf_to_megatron,
    megatron_to_hf,
    owner_stage,
    plan,
)
from megatron_sdpo.weights.plan import HEADS, REPLICATED


def _config(arch: str, tied: bool = False, vocab: int = 131):
    shape = hf_shape(vocab=vocab, hidden=48, ffn=40, layers=4, heads=6, kv=2, head_dim=8)
    common = dict(shape, tie_word_embeddings=tied, max_position_embeddings=64, rms_norm_eps=1e-6)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common)
    return transformers.LlamaConfig(**common)


def _hf_state(arch: str, tied: bool = False, vocab: int = 131) -> dict:
    torch.manual_seed(0)
    cls = transformers.Qwen3ForCausalLM if arch == "qwen3" else transformers.LlamaForCausalLM
    model = cls(_config(arch, tied, vocab))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # Random norms so that a swapped norm would show up.
    for k in sd:
        if k.endswith("norm.weight"):
            sd[k] = torch.randn_like(sd[k])
    if tied:
        sd.pop("lm_head.weight", None)
    return sd


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("tied", [False, True])
def test_plan_covers_every_hf_tensor_exactly_once(arch, tied):
    spec = ModelSpec.from_hf_config(_config(arch, tied))
    sd = _hf_state(arch, tied)
    assert sorted(hf_names(spec)) == sorted(sd)
    for layout in (Layout(pp=2), Layout(tp=2, pp=4)):
        owned = [n for p in range(layout.pp) for mp in plan(spec, layout, p) for n in mp.hf]
        # Under PP with tied embeddings the last stage reads the embedding a second time.
        extra = 1 if tied and layout.pp > 1 else 0
        assert len(owned) == len(sd) + extra and set(owned) == set(sd)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)])
def test_round_trip_is_bit_exact(arch, tied, tp, pp):
    spec = ModelSpec.from_hf_config(_config(arch, tied))
    sd = _hf_state(arch, tied)
    layout = Layout(tp=tp, pp=pp, vocab_divisor=4)
    shards = {(t, p): hf_to_megatron(sd, spec, layout, t, p) for t in range(tp) for p in range(pp)}
    for (_t, p), msd in shards.items():
        for mp in plan(spec, layout, p):
            assert msd[mp.megatron].is_contiguous()
    back = megatron_to_hf(lambda t, p: shards[(t, p)], spec, layout)
    assert list(back) == hf_names(spec)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_qkv_is_grouped_per_query_group_and_sharded_by_group():
    spec = ModelSpec.from_hf_config(_config("qwen3"))
    sd = _hf_state("qwen3")
    D, r = spec.head_dim, spec.num_heads // spec.num_kv_heads
    q = sd["model.layers.1.self_attn.q_proj.weight"]
    k = sd["model.layers.1.self_attn.k_proj.weight"]
    v = sd["model.layers.1.self_attn.v_proj.weight"]
    for tp in (1, 2):
        layout = Layout(tp=tp)
        for t in range(tp):
            got = hf_to_megatron(sd, spec, layout, t, 0)["decoder.layers.1.self_attention.linear_qkv.weight"]
            rows = []
            for g in range(t * spec.num_kv_heads // tp, (t + 1) * spec.num_kv_heads // tp):
                rows += [q[g * r * D : (g + 1) * r * D], k[g * D : (g + 1) * D], v[g * D : (g + 1) * D]]
            assert torch.equal(got, torch.cat(rows))


def test_fc1_holds_gate_then_up_per_tp_shard_and_row_parallel_splits_columns():
    spec = ModelSpec.from_hf_config(_config("llama"))
    sd = _hf_state("llama")
    gate, up = sd["model.layers.2.mlp.gate_proj.weight"], sd["model.layers.2.mlp.up_proj.weight"]
    down = sd["model.layers.2.mlp.down_proj.weight"]
    F = spec.ffn_hidden_size
    layout = Layout(tp=2, pp=2)
    for t in range(2):
        msd = hf_to_megatron(sd, spec, layout, t, 1)  # layer 2 is stage 1's local layer 0
        half = slice(t * F // 2, (t + 1) * F // 2)
        assert torch.equal(msd["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[half], up[half]]))
        assert torch.equal(msd["decoder.layers.0.mlp.linear_fc2.weight"], down[:, half])
        assert torch.equal(
            msd["decoder.layers.0.pre_mlp_layernorm.weight"], sd["model.layers.2.post_attention_layernorm.weight"]
        )


def test_vocab_is_padded_with_zero_rows_and_split_by_rank():
    spec = ModelSpec.from_hf_config(_config("qwen3", vocab=131))
    sd = _hf_state("qwen3", vocab=131)
    layout = Layout(tp=2, vocab_divisor=8)
    assert layout.padded_vocab(spec) == 136 == Layout(tp=1, vocab_divisor=8).padded_vocab(spec)
    emb = [hf_to_megatron(sd, spec, layout, t, 0)["embedding.word_embeddings.weight"] for t in range(2)]
    assert emb[0].shape == (68, spec.hidden_size) and emb[1].shape == (68, spec.hidden_size)
    full = torch.cat(emb)
    assert torch.equal(full[:131], sd["model.embed_tokens.weight"])
    assert not full[131:].any()


def test_tied_embedding_under_pp_puts_a_copy_on_the_last_stage():
    spec = ModelSpec.from_hf_config(_config("qwen3", tied=True))
    sd = _hf_state("qwen3", tied=True)
    layout = Layout(pp=2)
    first, last = hf_to_megatron(sd, spec, layout, 0, 0), hf_to_megatron(sd, spec, layout, 0, 1)
    assert "output_layer.weight" not in first
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    assert "output_layer.weight" not in hf_to_megatron(sd, spec, Layout(), 0, 0)
    assert owner_stage(spec, layout, "model.embed_tokens.weight") == 0
    assert owner_stage(spec, layout, "model.layers.3.mlp.up_proj.weight") == 1


def test_te_spec_names_fuse_the_norms_into_the_next_linear():
    spec = ModelSpec.from_hf_config(_config("qwen3"))
    names = {mp.megatron for mp in plan(spec, Layout(te_names=True), 0)}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names


def test_invalid_layouts_and_architectures_are_config_errors():
    spec = ModelSpec.from_hf_config(_config("qwen3"))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        plan(spec, Layout(tp=4), 0)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        plan(spec, Layout(pp=3), 0)
    with pytest.raises(ConfigError, match="vocab_divisor"):
        plan(spec, Layout(tp=2, vocab_divisor=3), 0)
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelSpec.from_hf_config(transformers.LlamaConfig(attention_bias=True, hidden_size=32, num_attention_heads=4))
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelSpec.from_hf_config(_olmo_config(attention_bias=True))
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelSpec.from_hf_config(_olmo_config(hidden_act="gelu"))
    with pytest.raises(ConfigError, match="rope_type='dynamic'"):
        ModelSpec.from_hf_config(_olmo_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelSpec.from_hf_config(_olmo_config(sliding_window=None))
    with pytest.raises(ConfigError, match="not supported"):
        ModelSpec.from_hf_config(transformers.GemmaConfig(hidden_size=32, num_attention_heads=4))


def test_missing_or_misshapen_hf_tensor_is_a_checkpoint_error():
    spec = ModelSpec.from_hf_config(_config("llama"))
    sd = _hf_state("llama")
    broken = dict(sd)
    del broken["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match="up_proj"):
        hf_to_megatron(broken, spec, Layout(), 0, 0)
    broken = dict(sd)
    broken["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match="linear_proj"):
        hf_to_megatron(broken, spec, Layout(), 0, 0)


# ---------------------------------------------------------------- Olmo-2 / Olmo-3

OLMO_TYPES = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]


def _olmo_config(arch: str = "olmo3", **kw):
    shape = hf_shape(vocab=131, hidden=48, ffn=40, layers=4, heads=6, kv=2)
    common = dict(shape, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000.0, eos_token_id=2)
    if arch == "olmo2":
        return transformers.Olmo2Config(**common, **kw)
    return transformers.Olmo3Config(**{**common, "layer_types": OLMO_TYPES, "sliding_window": 5, **kw})


def _olmo_model(arch: str = "olmo3", **kw):
    torch.manual_seed(0)
    cls = transformers.Olmo3ForCausalLM if arch == "olmo3" else transformers.Olmo2ForCausalLM
    return cls(_olmo_config(arch, **kw))


def _olmo_state(arch: str = "olmo3") -> dict:
    sd = {k: v.detach().clone() for k, v in _olmo_model(arch).state_dict().items()}
    for k in sd:
        if k.endswith("norm.weight"):
            sd[k] = torch.randn_like(sd[k])
    return sd


@pytest.mark.parametrize("arch", ["olmo3", "olmo2"])
def test_olmo_plan_names_shapes_and_kinds(arch):
    spec = ModelSpec.from_hf_config(_olmo_config(arch))
    sd = _olmo_state(arch)
    assert spec.norm_placement == "post" and spec.qk_norm == "full"
    assert sorted(hf_names(spec)) == sorted(sd)  # exactly HF's names, each once
    D, H = spec.head_dim, spec.hidden_size
    for te in (False, True):  # no pre-norm to fuse: both specs use the same names
        mps = {mp.megatron: mp for mp in plan(spec, Layout(te_names=te), 0)}
        m = "decoder.layers.1"
        assert mps[f"{m}.self_attention.q_layernorm.weight"] == Mapping(
            f"{m}.self_attention.q_layernorm.weight", ("model.layers.1.self_attn.q_norm.weight",), HEADS, (6 * D,)
        )
        assert mps[f"{m}.self_attention.k_layernorm.weight"].shape == (2 * D,)
        assert mps[f"{m}.self_attention.k_layernorm.weight"].kind == HEADS
        assert mps[f"{m}.self_attention.linear_proj.post_layernorm.weight"] == Mapping(
            f"{m}.self_attention.linear_proj.post_layernorm.weight",
            ("model.layers.1.post_attention_layernorm.weight",),
            REPLICATED,
            (H,),
        )
        assert mps[f"{m}.mlp.linear_fc2.post_layernorm.weight"].hf == (
            "model.layers.1.post_feedforward_layernorm.weight",
        )
        assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n or "layer_norm_weight" in n for n in mps)
        for n in sd:  # every HF layer tensor sits in exactly one megatron tensor of its stage
            assert sum(n in mp.hf for mp in mps.values()) == 1, n


@pytest.mark.parametrize("arch", ["olmo3", "olmo2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)])
def test_olmo_round_trip_is_bit_exact(arch, tp, pp):
    spec = ModelSpec.from_hf_config(_olmo_config(arch))
    sd = _olmo_state(arch)
    layout = Layout(tp=tp, pp=pp, vocab_divisor=4)
    shards = {(t, p): hf_to_megatron(sd, spec, layout, t, p) for t in range(tp) for p in range(pp)}
    back = megatron_to_hf(lambda t, p: shards[(t, p)], spec, layout)
    assert list(back) == hf_names(spec) and set(back) == set(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_olmo_qk_norm_shards_hold_the_heads_of_the_ranks_query_groups():
    """Rank t's q_norm / k_norm slice covers exactly the q / k heads its linear_qkv shard computes."""
    spec = ModelSpec.from_hf_config(_olmo_config())
    sd = _olmo_state()
    D, G, r = spec.head_dim, spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    q, k = sd["model.layers.2.self_attn.q_proj.weight"], sd["model.layers.2.self_attn.k_proj.weight"]
    qn, kn = sd["model.layers.2.self_attn.q_norm.weight"], sd["model.layers.2.self_attn.k_norm.weight"]
    tp = 2
    for t in range(tp):
        msd = hf_to_megatron(sd, spec, Layout(tp=tp), t, 0)
        groups = msd["decoder.layers.2.self_attention.linear_qkv.weight"].reshape(G // tp, (r + 2) * D, -1)
        q_rows, k_rows = (
            groups[:, : r * D].reshape(-1, q.shape[1]),
            groups[:, r * D : (r + 1) * D].reshape(-1, k.shape[1]),
        )
        qs, ks = slice(t * len(qn) // tp, (t + 1) * len(qn) // tp), slice(t * len(kn) // tp, (t + 1) * len(kn) // tp)
        assert torch.equal(q_rows, q[qs]) and torch.equal(k_rows, k[ks])
        assert torch.equal(msd["decoder.layers.2.self_attention.q_layernorm.weight"], qn[qs])
        assert torch.equal(msd["decoder.layers.2.self_attention.k_layernorm.weight"], kn[ks])


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ],
)
def test_olmo3_ropes_per_layer_type_are_hfs(scaling):
    """The spec's per-layer-type frequencies and cos/sin scaling are the ones HF's rotary module
    holds (scaling applies to full-attention layers; sliding ones keep the default rope)."""
    model = _olmo_model(**({"rope_scaling": scaling} if scaling else {}))
    spec = ModelSpec.from_hf_config(model.config)
    rot = model.model.rotary_emb
    assert spec.layer_types == tuple(OLMO_TYPES) and spec.sliding_window == 5
    for t in ("full_attention", "sliding_attention"):
        rope = dict(spec.ropes)[t]
        assert torch.equal(torch.tensor(rope.inv_freq, dtype=torch.float32), getattr(rot, f"{t}_inv_freq"))
        assert rope.attention_scaling == getattr(rot, f"{t}_attention_scaling")
        assert rope.rope_type == (scaling["rope_type"] if scaling and t == "full_attention" else "default")
    assert spec.rope(3) == dict(spec.ropes)["full_attention"] and spec.rope(0) == dict(spec.ropes)["sliding_attention"]
    if scaling and scaling["rope_type"] == "yarn":
        assert spec.rope(3).attention_scaling > 1.1  # YaRN's cos/sin factor, 0.1 ln 8 + 1


def test_olmo2_has_one_default_rope_and_no_windows():
    model = _olmo_model("olmo2")
    spec = ModelSpec.from_hf_config(model.config)
    assert spec.layer_types == ("full_attention",) * 4 and spec.sliding_window is None
    ((name, rope),) = spec.ropes
    assert name == "full_attention" and rope.attention_scaling == 1.0
    assert torch.equal(torch.tensor(rope.inv_freq, dtype=torch.float32), model.model.rotary_emb.inv_freq)


def test_qwen3_and_llama_specs_keep_pre_norms_and_megatron_rope():
    q, ll = ModelSpec.from_hf_config(_config("qwen3")), ModelSpec.from_hf_config(_config("llama"))
    assert (q.qk_norm, ll.qk_norm) == ("head", None)
    for s in (q, ll):
        assert s.norm_placement == "pre" and s.ropes == () and s.layer_types == () and s.rope(0) is None
    assert hash(q) != hash(ll)  # still a hashable frozen dataclass
