"""`megatron-sdpo run PRESET --dry-run`: layout, rollout plan, data checks and the memory
estimate, without weights (the paper models' directories are not on a test machine)."""

from __future__ import annotations

import pytest

from megatron_sdpo.cli import main
from megatron_sdpo.config import load_config
from megatron_sdpo.errors import ConfigError, DataError
from megatron_sdpo.planning.launch_plan import BUILTIN_ARCHS, plan

FIXTURES = "tests/fixtures/data"


@pytest.mark.parametrize(
    "preset, world, tp, dp",
    [("olmo3_7b", 16, 4, 4), ("olmo3_7b", 8, 4, 2), ("qwen3_4b", 16, 2, 8), ("qwen3_4b", 8, 2, 4)],
)
def test_paper_presets_plan_at_16_and_8_ranks(preset, world, tp, dp, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert main(["run", preset, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"ranks: {world} (WORLD_SIZE)" in out
    assert f"trainer layout: TP={tp} PP=1 DP={dp} (sequence parallel)" in out
    # The presets give vLLM the trainer's TP: one replica per trainer TP group.
    assert (
        f"vLLM TP={tp} (rollout.tensor_parallel_size), vLLM replicas={world // tp}, {32 // (world // tp)} prompts"
        in out
    )
    assert f"256 samples per step, {256 // dp} per DP rank, {256 // dp} micro-batches" in out
    assert "not on this machine: architecture numbers from the built-in table" in out
    assert "memory per rank by phase, GiB" in out and "peak: " in out
    for phase in ("rollout", "train", "teacher_update", "refit", "checkpoint", "eval"):
        assert sum(line.startswith(phase + " ") for line in out.splitlines()) == 1, phase
    # The data files are not here (20 sources and AIME 2025, math's extra ID file): warnings, not errors.
    assert out.count("warning: domains.") == 21


def test_world_size_flag_wins_and_bad_layouts_are_one_line_errors(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["run", "qwen3_4b", "--dry-run", "--world-size", "4"]) == 0
    assert "ranks: 4 (--world-size)" in capsys.readouterr().out
    assert main(["run", "qwen3_4b", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: world size 3 (WORLD_SIZE) is not divisible"), err
    # TP divides the world but not the model: Olmo-3-7B's 32 KV heads cannot split over 64 ranks.
    assert main(["run", "olmo3_7b", "backend.megatron.tensor_parallel=64", "--dry-run", "--world-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tp=64 must divide num_key_value_heads=32" in err, err
    assert main(["run", "tiny", "--world-size", "2"]) == 2
    assert "--world-size is for --dry-run" in capsys.readouterr().err


def test_smollm2_splits_over_three_tensor_parallel_ranks_with_a_vocab_divisor_of_three(capsys):
    """SmolLM2-135M has 9 query and 3 KV heads: TP 2 cannot split it, TP 3 can once the padded
    vocabulary is a multiple of 3 ranks' shards; the error names the key that fixes it."""
    args = ["run", "smollm2_135m", "backend=megatron", "--dry-run", "--world-size"]
    assert main(args + ["2", "backend.megatron.tensor_parallel=2"]) == 2
    assert "tp=2 must divide num_key_value_heads=3" in capsys.readouterr().err
    assert main(args + ["3", "backend.megatron.tensor_parallel=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tp=3 must divide backend.megatron.vocab_divisor=128" in err, err
    assert main(args + ["3", "backend.megatron.tensor_parallel=3", "backend.megatron.vocab_divisor=384"]) == 0
    assert "trainer layout: TP=3 PP=1 DP=1" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="vocab_divisor must be >= 1"):
        load_config("smollm2_135m", ["backend.megatron.vocab_divisor=0"])


def test_rollout_tensor_parallel_size_sets_the_replicas():
    cfg = load_config("qwen3_4b")
    cfg.rollout.tensor_parallel_size = 1  # the key the multi-rank rollout adds
    p = plan(cfg, 8)
    assert (p.rollout_tp, p.replicas, p.prompts_per_replica) == (1, 8, 4)
    assert p.rollout_tp_source == "rollout.tensor_parallel_size"
    cfg.rollout.tensor_parallel_size = 3
    with pytest.raises(ConfigError, match="rollout tensor parallel size 3"):
        plan(cfg, 8)


def test_builtin_architectures_match_the_public_sizes():
    cfg = load_config("qwen3_4b")
    p = plan(cfg, 8)
    # Qwen3-4B: 4.0B parameters (tied embeddings), 36 layers.
    assert abs(p.arch.params / 4.02e9 - 1) < 0.01 and p.arch.spec.tie_word_embeddings and p.arch.spec.num_layers == 36
    p7 = plan(load_config("olmo3_7b"), 8)
    assert abs(p7.arch.params / 7.3e9 - 1) < 0.01 and not p7.arch.spec.tie_word_embeddings
    assert set(BUILTIN_ARCHS) == {"qwen/qwen3-4b", "allenai/olmo-3-7b-instruct", "smollm2-135m-instruct"}
    # Sharding is visible in the ledger: twice the TP halves the weights per rank (norms replicated).
    tp4 = plan(load_config("qwen3_4b", ["backend.megatron.tensor_parallel=4"]), 8)
    assert tp4.ledger.categories["params"] * 2 == pytest.approx(p.ledger.categories["params"], rel=1e-3)
    assert p.ledger.categories["logits"] > 0  # the paper's top-100 + tail: vocab-sharded logits of a micro-batch
    fused = ["algorithm.sdpo.topk=null", "stages.3.algorithm.sdpo.topk=null", "kernel.fused_kl=true"]
    assert plan(load_config("qwen3_4b", fused), 8).ledger.categories["logits"] == 0
    assert not p.memory_errors(), "the paper preset must fit an H100-80GB in every phase"


def test_packaged_model_plans_without_converting(tmp_path, monkeypatch):
    """Before its first run the packaged SmolLM2 is not in the cache: the plan uses the built-in
    table (134.5M parameters, tied) and converts nothing."""
    monkeypatch.setenv("MEGATRON_SDPO_CACHE", str(tmp_path))
    p = plan(load_config("smollm2_135m"), 1)
    assert (
        abs(p.arch.params / 134_515_008 - 1) < 1e-3 and p.arch.spec.tie_word_embeddings and p.arch.spec.num_layers == 30
    )
    assert "built-in table" in p.arch.source and not any(tmp_path.iterdir())


def test_config_json_of_a_local_model_and_unknown_models(tmp_path):
    p = plan(load_config("tiny"), 1)
    assert p.arch.source.endswith("tiny_base/config.json") and p.arch.spec.vocab_size == 718 and not p.notes
    # Not here and not built in (e.g. a launch from a login node): a warning, no estimate.
    p = plan(load_config("tiny", [f"model.path={tmp_path}"]), 1)
    assert p.arch is None and p.ledger is None and "no built-in architecture" in p.warnings[0]
    assert "architecture unknown on this machine" in p.render()


def test_existing_data_files_are_parsed_with_their_schema():
    ok = load_config(
        "tiny", [f"domains.math.train.source={FIXTURES}/dapo_math.jsonl", "domains.math.train.schema=dapo_math"]
    )
    checks = {d.where: d.status for d in plan(ok, 1).data}
    assert checks["domains.math.train.source"].startswith("ok (") and checks["domains.code.train"] == "synthetic"
    wrong = load_config(
        "tiny", [f"domains.math.train.source={FIXTURES}/dapo_math.jsonl", "domains.math.train.schema=aime"]
    )
    with pytest.raises(DataError):
        plan(wrong, 1)
    other = load_config("tiny", [f"domains.math.train.source={FIXTURES}/gpqa.json", "domains.math.train.schema=gpqa"])
    with pytest.raises(DataError, match="yields 'science' records, not 'math'"):
        plan(other, 1)


@pytest.mark.parametrize("preset, world", [("qwen3_4b", 8), ("olmo3_7b", 16)])
def test_paper_presets_fit_68_gib_per_rank_with_the_context(preset, world):
    """Every phase of a full-length row with the context (CUDA, fragmentation, NCCL, vLLM's
    graphs) within 68 GiB of the H100's 79.2: room for what the ledger cannot see."""
    from megatron_sdpo.planning.launch_plan import teacher_seq
    from megatron_sdpo.planning.memory_ledger import GIB, PHASES

    cfg = load_config(preset)
    p = plan(cfg, world)
    # The teacher's re-prompt is cut to 10,240 tokens, then the 8,192-token response follows.
    assert teacher_seq(cfg) == p.ledger.inputs.teacher_seq == 10240 + 8192
    assert p.ledger.inputs.rollout_replicas == p.replicas > 1 and p.ledger.inputs.engine_graphs
    worst = max(PHASES, key=p.ledger.phase_total)
    assert (p.ledger.phase_total(worst) + p.ledger.context_bytes) / GIB <= 68.0, worst
