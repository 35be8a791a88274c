"""The TransformerConfig the megatron backend would build (FP8 recipes, recompute, CPU flags).

No processes: TransformerConfig is a dataclass; FP8 is checked as wiring for a GPU target
(have_te / capability passed explicitly), not executed.
"""

import pytest
import torch
from test_megatron_convert import SHAPE

from megatron_sdpo.models.random_qwen3 import hf_shape

pytestmark = [pytest.mark.megatron]

transformers = pytest.importorskip("transformers")


def _spec(**kw):
    from megatron_sdpo.weights import ModelSpec

    cfg = {**SHAPE, "rope_theta": 1000.0, "rms_norm_eps": 1e-5, **kw}
    return ModelSpec.from_hf_config(transformers.Qwen3Config(**cfg))


def _cfg(fp8=None, params="bfloat16", capability=(9, 0), have_te=True, **opt):
    from megatron_sdpo.backends.megatron.model import ModelOptions, transformer_config
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig

    options = ModelOptions(precision=PrecisionConfig(params=params, fp8=fp8, **opt.pop("prec", {})), **opt)
    return transformer_config(_spec(), 2, 2, options, gpu=True, have_te=have_te, capability=capability)


@pytest.mark.parametrize(
    "recipe,cap,fmt",
    [
        ("delayed", (9, 0), "hybrid"),
        ("tensorwise", (8, 9), "hybrid"),
        ("blockwise", (9, 0), "e4m3"),
        ("mxfp8", (10, 0), "e4m3"),
    ],
)
def test_fp8_recipes_map_to_transformer_config_fields(recipe, cap, fmt):
    c = _cfg(recipe, capability=cap)
    assert c.fp8 == fmt and c.fp8_recipe == recipe
    assert c.bf16 and c.params_dtype == torch.bfloat16 and c.pipeline_dtype == torch.bfloat16
    assert c.fp8_amax_history_len == (1024 if recipe == "delayed" else 1)
    assert c.bias_dropout_fusion and not c.use_cpu_initialization  # GPU target


def test_bf16_edge_layers_and_fp8_param_gather():
    c = _cfg("tensorwise", prec={"bf16_edge_layers": 1, "fp8_param_gather": True})
    assert c.first_last_layers_bf16 and c.num_layers_at_start_in_bf16 == 1 and c.fp8_param


def test_fp8_validation_errors():
    from megatron_sdpo.errors import ConfigError, MissingDependencyError

    with pytest.raises(ConfigError, match="Hopper"):
        _cfg("blockwise", capability=(8, 9))
    with pytest.raises(ConfigError, match="Hopper"):
        _cfg("blockwise", capability=(10, 0))
    with pytest.raises(ConfigError, match="Blackwell"):
        _cfg("mxfp8", capability=(9, 0))
    with pytest.raises(MissingDependencyError, match="Transformer Engine"):
        _cfg("delayed", have_te=False)
    with pytest.raises(ConfigError, match="bfloat16"):
        _cfg("delayed", params="float32")
    with pytest.raises(ConfigError, match="fp8"):
        _cfg("fp4")
    with pytest.raises(ConfigError, match="current-scaling"):
        _cfg("delayed", prec={"bf16_edge_layers": 1})


def test_cpu_config_is_fp32_unfused_with_recompute_option():
    from megatron_sdpo.backends.megatron.model import ModelOptions, transformer_config
    from megatron_sdpo.errors import ConfigError

    c = transformer_config(_spec(), 1, 1, ModelOptions(recompute="full"), gpu=False, have_te=False)
    assert c.params_dtype == torch.float32 and not c.bf16 and c.fp8 is None
    assert c.use_cpu_initialization and not c.batch_p2p_sync
    assert not (
        c.bias_dropout_fusion or c.masked_softmax_fusion or c.apply_rope_fusion or c.gradient_accumulation_fusion
    )
    assert c.hidden_dropout == 0.0 and c.attention_dropout == 0.0
    assert c.recompute_granularity == "full" and c.recompute_num_layers == 1
    assert c.qk_layernorm and c.num_query_groups == 2 and c.kv_channels == 16 and c.layernorm_epsilon == 1e-5
    with pytest.raises(ConfigError, match="recompute"):
        transformer_config(_spec(), 1, 1, ModelOptions(recompute="all"), gpu=False, have_te=False)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        transformer_config(_spec(), 1, 1, ModelOptions(sequence_parallel=True), gpu=False, have_te=False)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        transformer_config(_spec(), 4, 1, ModelOptions(), gpu=False, have_te=False)


def test_parallel_layout_is_validated_against_world_size():
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig
    from megatron_sdpo.errors import ConfigError

    assert ParallelConfig(tp=2, pp=2).resolve(8).dp == 2
    with pytest.raises(ConfigError, match="not divisible"):
        ParallelConfig(tp=2, pp=2).resolve(6)
    with pytest.raises(ConfigError, match="parallel.tp"):
        ParallelConfig(tp=0).resolve(2)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        ParallelConfig(tp=1, sequence_parallel=True).resolve(2)


def test_olmo3_config_carries_sliding_windows_and_no_megatron_qk_layernorm():
    from megatron_sdpo.backends.megatron.model import ModelOptions, layer_spec, transformer_config
    from megatron_sdpo.errors import ConfigError
    from megatron_sdpo.weights import ModelSpec

    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    olmo = hf_shape(vocab=131, hidden=64, ffn=96, layers=4, heads=4, kv=2)
    hf = transformers.Olmo3Config(**olmo, layer_types=types, sliding_window=7, eos_token_id=2)
    spec = ModelSpec.from_hf_config(hf)
    c = transformer_config(spec, 2, 2, ModelOptions(), gpu=False, have_te=False)
    # HF's window of 7 keys (the query's own among them) is megatron's 6 to the left, 0 to the right.
    assert c.window_size == (6, 0) and c.window_attn_skip_freq == [1, 0, 1, 1]
    # Olmo's q/k norms are TP shards: megatron must not sum their grads over TP as qk_layernorm would.
    assert not c.qk_layernorm
    with pytest.raises(ConfigError, match="block_spec"):
        layer_spec(spec, use_te=False)
    olmo = hf_shape(vocab=131, hidden=64, ffn=96, layers=2, heads=4)
    hf = transformers.Olmo3Config(**olmo, layer_types=["full_attention"] * 2, eos_token_id=2)
    full = ModelSpec.from_hf_config(hf)
    c = transformer_config(full, 1, 1, ModelOptions(), gpu=False, have_te=False)
    assert c.window_size is None and c.window_attn_skip_freq is None
