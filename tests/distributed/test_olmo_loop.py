"""Olmo-3 through the continual loop under torchrun, as the 7B job runs it: colocated vLLM (its
Transformers backend serves Olmo-3) and the megatron trainer, SDPO for two stages with the
bucketed refit and its guard; on 2 ranks (vLLM TP 2, trainer TP 2) and on 4 (two vLLM TP 2
replicas, trainer TP 2 x PP 2). Both must reproduce a single-process run (HF trainer, vLLM TP 1).

The tiny Olmo-3 (models/random_olmo3.py) keeps the architecture that matters here: sliding
layers whose window (16 tokens) is far below the prompts' length, YaRN on the full-attention
layer past 32 positions, post-norms and the full-width QK-norm. The verifier's feedback is
turned on for both domains so the random model, which never answers right, gets a teacher
context and a non-zero SDPO loss on every step: the weights move and each refit matters.

Why equality is expected: as in test_rollout_replicas.py (requests seeded by prompt, fp32 on
both sides); losses agree to the fp32 round-off of two implementations, ~1e-7 absolute on
losses of ~5e-3, checked at 1e-3 relative (a dropped window or a stale refit is O(1e-1)).
"""

import json
import shutil

import pytest

# The same requirements, markers and reference-run helpers as the Qwen3 replica test (importing it
# skips this module where vLLM or megatron-core is missing).
from test_rollout_replicas import _metrics, _run, _single_run, pytestmark  # noqa: F401  (pytestmark: read by pytest)

from cli_process import torchrun_cli

CONFIG = """
defaults: tiny
name: olmo3
model: {{path: {model}}}
stages:
  - {{domain: math, steps: 2}}
  - {{domain: tooluse, steps: 1}}
domains:
  math: {{eval: {{id: {{n: 8}}, ood_near: {{n: 2}}, ood_mid: {{n: 2}}, ood_far: {{n: 2}}}}}}
  science: {{eval: {{id: {{n: 2}}, ood_near: {{n: 2}}, ood_mid: {{n: 2}}, ood_far: {{n: 2}}}}}}
  tooluse: {{eval: {{id: {{n: 6}}, ood_near: {{n: 2}}, ood_mid: {{n: 2}}, ood_far: {{n: 2}}}}}}
  code: {{eval: {{id: {{n: 2}}, ood_near: {{n: 2}}, ood_mid: {{n: 2}}, ood_far: {{n: 2}}}}}}
algorithm:
  name: sdpo
  prompts_per_step: 5
  group_size: 4
  sdpo: {{context: {{feedback_domains: [math, tooluse]}}}}
rollout: {{engine: vllm, max_new_tokens: 16, bucket_bytes: 200000}}
eval: {{max_new_tokens: 16}}
checkpoint: {{save_every: 0}}
diagnostics: {{enabled: false}}
"""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """A tiny random Olmo-3 with the shipped tiny base's tokenizer (its vocabulary), and the
    run's YAML."""
    from megatron_sdpo.models.random_olmo3 import save_tiny_olmo3
    from megatron_sdpo.models.tiny import SHIPPED_DIR

    d = tmp_path_factory.mktemp("olmo3")
    vocab = json.loads((SHIPPED_DIR / "config.json").read_text())["vocab_size"]
    model = save_tiny_olmo3(d / "model", vocab_size=vocab)
    for f in TOKENIZER_FILES:
        shutil.copy(SHIPPED_DIR / f, d / "model" / f)
    return CONFIG.format(model=model)


@pytest.fixture(scope="module")
def single(tmp_path_factory, config):
    return _single_run(tmp_path_factory.mktemp("single"), config)


@pytest.mark.parametrize(
    "ranks, layout",
    [
        (2, ["backend.megatron.tensor_parallel=2"]),
        (4, ["backend.megatron.tensor_parallel=2", "backend.megatron.pipeline_parallel=2"]),
    ],
    ids=["tp2", "tp2_pp2"],
)
def test_olmo3_loop_matches_single_process(tmp_path, config, single, ranks, layout):
    (tmp_path / "cfg.yaml").write_text(config)
    fused_tp2 = ["rollout.tensor_parallel_size=2", "kernel.fused_kl=true"]
    cmd = torchrun_cli(ranks, "run", "cfg.yaml", "backend=megatron", *layout, *fused_tp2, "--out", "run", "--quiet")
    out = _run(cmd, tmp_path)
    assert out.count("run directory: ") == 1  # rank 0 alone
    got, want = _metrics(tmp_path / "run"), _metrics(single)
    assert [(m["stage"], m["step"]) for m in got] == [(0, 1), (0, 2), (1, 1)]
    assert all(m["samples"] == 20 for m in got)
    assert [m["reward_mean"] for m in got] == [m["reward_mean"] for m in want]
    assert [m["response_len"] for m in got] == [m["response_len"] for m in want]
    assert all(m["loss"] > 1e-4 for m in want)  # the teacher sees feedback: the weights move
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-3)
    # The guard compares the trainer's log-probs with those vLLM sampled with after each refit.
    diffs = [m["refit/logprob_diff_max"] for m in (*got, *want)]
    print(f"refit guard, worst |trainer - vLLM| log-prob ({ranks} ranks, then single): {diffs}")
    assert max(diffs) <= 1e-4, diffs
    assert all(m["sync_buckets"] > 1 for m in got)
    assert (tmp_path / "run" / "eval_matrix.csv").read_text() == (single / "eval_matrix.csv").read_text()
