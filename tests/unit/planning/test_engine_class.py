"""The vLLM class the plan names for each paper model, its TP collectives and their place in the
planned step: by hand from the architectures' numbers."""

import pytest

from megatron_sdpo.planning import engine_class as ec


def _spec(name: str):
    from transformers import AutoConfig

    from megatron_sdpo.planning.launch_plan import BUILTIN_ARCHS
    from megatron_sdpo.weights.plan import ModelSpec

    fields = dict(BUILTIN_ARCHS[name])
    return ModelSpec.from_hf_config(AutoConfig.for_model(fields.pop("model_type"), **fields))


def test_olmo3_runs_on_the_transformers_backend_with_the_qk_norm_gathers():
    e = ec.engine_class(_spec("allenai/olmo-3-7b-instruct"))
    assert e.vllm_class.startswith("TransformersForCausalLM")
    assert e.collectives_per_layer == 4  # 2 all-reduces + the q and k all-gathers
    assert e.gather_bytes_per_layer == (32 + 32) * 128 * ec.MAX_BATCHED_TOKENS * 2  # 128 MiB in bf16
    assert e.decode_seconds(layers=32, decode_steps=1000, rollout_tp=4) == pytest.approx(
        1000 * 32 * 4 * ec.TP_COLLECTIVE_S
    )
    assert e.decode_seconds(layers=32, decode_steps=1000, rollout_tp=1) == 0.0
    assert "128 MiB at 8192 batched tokens" in e.line(32, 1000, 4)


def test_qwen3_has_its_own_class_and_a_per_head_norm():
    e = ec.engine_class(_spec("qwen/qwen3-4b"))
    assert e.vllm_class == "vLLM's own qwen3 class" and e.collectives_per_layer == 2
    assert e.gather_bytes_per_layer == 0 and "all-gathers" not in e.line(36, 10, 2)


def test_the_7b_dry_run_names_the_class_and_counts_it_in_the_grace(capsys, monkeypatch):
    from megatron_sdpo.cli import main

    monkeypatch.setenv("GPUS_PER_NODE", "8")
    assert main(["run", "olmo3_7b", "--dry-run", "--world-size", "16"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("vLLM class: "))
    assert "TransformersForCausalLM" in line and "TP 4: 4 collectives a layer" in line
    steps = int(line.split(" decode steps")[0].rsplit("; ", 1)[1].replace(",", ""))
    seconds = float(line.split(" = ")[1].split(" s a step")[0])
    assert seconds == pytest.approx(steps * 32 * 4 * ec.TP_COLLECTIVE_S, abs=0.5)
