"""ContinualRun's stage end under several ranks: what every rank must do, and what only the main one."""
from types import SimpleNamespace

import pytest
import torch

from megatron_sdpo import report
from megatron_sdpo.backends.base import SequenceBatch
from megatron_sdpo.config import load_config
from megatron_sdpo.continual import ContinualRun
from megatron_sdpo.diagnostics import stage


@pytest.mark.parametrize("main", [True, False])
def test_stage_diagnostics_score_probes_on_every_rank_and_hand_the_rest_to_a_job_on_the_main_one(monkeypatch, main):
    """The probe scoring is a collective forward: every rank runs it. Parameter and response
    drift (two HF checkpoints, the sentence embedder) go to a detached job the main rank starts
    (drift_jobs.py); the ranks go on at once."""
    batch = SequenceBatch([[5, 6]], [[7, 8, 9]])
    scored, submitted = [], []
    monkeypatch.setattr(report, "read_eval_samples", lambda run_dir, label: {"math/id": []})
    monkeypatch.setattr(stage, "probe_batches", lambda tok, cur, sets, n: {"math/id": batch})

    def logprobs(b, model):
        scored.append(model)
        return torch.zeros(1, 3)

    run = SimpleNamespace(
        cfg=load_config("tiny"), main=main, run_dir=None, tokenizer=None, eval_sets={},
        backend=SimpleNamespace(logprobs=logprobs), base_dir="base",
        _stage_label=lambda k: f"stage_{k + 1}_math",
        _stage_policies=lambda k: "policies",
        drift_jobs=SimpleNamespace(submit=lambda k, inputs: submitted.append((k, inputs))),
    )
    assert run.cfg.diagnostics.enabled and run.cfg.diagnostics.response_drift
    ContinualRun._stage_diagnostics(run, 0)
    assert scored == ["policy", "reference"]
    if not main:
        assert submitted == []
        return
    ((k, inputs),) = submitted
    assert k == 1 and inputs["stage"] == 0 and inputs["cur_label"] == "stage_1_math" and inputs["policies"] == "policies"
    assert inputs["response_drift"] is True and set(inputs["probes"]) == {"math/id"}
    assert torch.equal(inputs["probes"]["math/id"].mask, batch.response_mask())
