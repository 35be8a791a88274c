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
def test_stage_diagnostics_score_probes_on_every_rank_and_measure_drift_on_the_main_one(monkeypatch, main):
    """The probe scoring is a collective forward: every rank runs it. Parameter and response
    drift load two HF checkpoints and the sentence embedder: the main rank alone, which writes
    the record."""
    batch = SequenceBatch([[5, 6]], [[7, 8, 9]])
    scored, drifted, written = [], [], []
    monkeypatch.setattr(report, "read_eval_samples", lambda run_dir, label: {"math/id": []})
    monkeypatch.setattr(report, "write_stage_drift", lambda run_dir, record: written.append(record))
    monkeypatch.setattr(stage, "probe_batches", lambda tok, cur, sets, n: {"math/id": batch})
    monkeypatch.setattr(stage, "stage_diagnostics", lambda *a, **k: drifted.append(a[0]) or {"stage": a[0] + 1})

    def logprobs(b, model):
        scored.append(model)
        return torch.zeros(1, 3)

    run = SimpleNamespace(
        cfg=load_config("tiny"), main=main, run_dir=None, tokenizer=None, eval_sets={},
        backend=SimpleNamespace(logprobs=logprobs), base_dir="base",
        _stage_label=lambda k: f"stage_{k + 1}_math",
        _stage_policies=lambda k: None,
        _embedder=lambda: "embedder" if main else pytest.fail("the sentence embedder loads on the main rank only"),
    )
    assert run.cfg.diagnostics.enabled and run.cfg.diagnostics.response_drift
    ContinualRun._stage_diagnostics(run, 0)
    assert scored == ["policy", "reference"]
    assert drifted == ([0] if main else []) and written == ([{"stage": 1}] if main else [])
