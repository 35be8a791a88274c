"""The dry run's KV-cache lines (planning/kv_capacity.py): hand-computed sizes and waves."""

import pytest

from megatron_sdpo.config import load_config
from megatron_sdpo.planning.kv_capacity import KVCapacity, kv_bytes_per_token
from megatron_sdpo.planning.launch_plan import plan, resolve_arch

GIB = 1024**3


def test_olmo3_7b_holds_128_kib_per_token_per_rank_at_rollout_tp4():
    spec = resolve_arch(load_config("olmo3_7b"))[1]
    # K and V x 32 layers x (32 KV heads / TP 4) x head_dim 128 x 2 bytes (MHA: no KV sharing).
    assert kv_bytes_per_token(spec, 4) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    qwen = resolve_arch(load_config("qwen3_4b"))[1]
    assert kv_bytes_per_token(qwen, 2) == 2 * 36 * 4 * 128 * 2  # GQA: 8 KV heads over TP 2
    assert kv_bytes_per_token(qwen, 16) == 2 * 36 * 1 * 128 * 2  # TP beyond the KV heads replicates them


@pytest.mark.parametrize("preset, world, rollout, evals", [("olmo3_7b", 16, 64, 256), ("qwen3_4b", 8, 64, 256)])
def test_the_paper_presets_preempt_and_the_plan_says_which_setting_fits(preset, world, rollout, evals):
    p = plan(load_config(preset), world)
    kv = p.kv
    # 32 prompts x 8 samples over the replicas; eval: 256 records x avg@4 over the replicas.
    assert (kv.rollout_seqs, kv.eval_seqs) == (rollout, evals)
    assert kv.cache_bytes == p.ledger.categories["kv_cache"] and kv.max_len == 12288
    assert kv.sequences == kv.cache_bytes // kv.per_token // 12288 < rollout
    text = p.render()
    assert f"{kv.sequences} sequences of 12,288 tokens per replica" in text
    assert f"rollout {rollout} sequences per step ({-(-rollout // kv.sequences)} waves)" in text
    lines = [w for w in p.warnings if w.startswith("KV cache:")]
    assert len(lines) == 2 and all("preempts and recomputes" in w for w in lines)
    assert f"rollout.max_model_len={kv.tokens // evals}" in lines[1] and "eval.batch_size=" in lines[1]


def test_a_batch_that_fits_warns_nothing_and_the_utilization_is_named_where_it_fits():
    assert plan(load_config("tiny", ["rollout.engine=vllm"]), 1).kv.warnings(1) == []
    kv = KVCapacity(
        per_token=1024,
        cache_bytes=10 * 1024 * 100,
        engine_weight_bytes=GIB,
        device_bytes=80 * GIB,
        utilization=0.5,
        max_len=100,
        rollout_seqs=20,
        eval_seqs=5,
        samples_per_record=1,
        awake_other_bytes=10 * GIB,
        room_bytes=77 * GIB,
    )
    assert kv.sequences == 10 and kv.waves(20) == 2
    (line,) = kv.warnings(replicas=1)
    # (1 GiB of weights + 20 x 100 tokens x 1 KiB) / 80 GiB, rounded up to the hundredth.
    assert "rollout.gpu_memory_utilization=0.02 or rollout.max_model_len=50" in line  # 1,000 tokens / 20
    crowded = KVCapacity(**{**kv.__dict__, "awake_other_bytes": 77 * GIB})
    assert "gpu_memory_utilization=0.02" not in crowded.warnings(replicas=1)[0]


def test_hf_rollout_has_no_kv_lines():
    assert plan(load_config("tiny", ["rollout.engine=hf"]), 1).kv is None
