"""ContinualRun's stage end under several ranks: what every rank must do, and what only the main one."""

from types import SimpleNamespace

import pytest
import torch

from megatron_sdpo.config import load_config
from megatron_sdpo.continual import ContinualRun
from megatron_sdpo.diagnostics import stage
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.outputs import report


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
        cfg=load_config("tiny"),
        main=main,
        run_dir=None,
        eval_sets={"math/id": [{"prompt": "2+2?"}]},
        tokenizer=SimpleNamespace(decode=lambda ids: "".join(f"<{i}>" for i in ids)),
        train_sets={"math": [{"prompt": "1+1?"}, {"prompt": "3+4?"}]},
        backend=SimpleNamespace(logprobs=logprobs),
        base_dir="base",
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
    assert (
        k == 1 and inputs["stage"] == 0 and inputs["cur_label"] == "stage_1_math" and inputs["policies"] == "policies"
    )
    assert inputs["response_drift"] is True and set(inputs["probes"]) == {"math/id"}
    assert torch.equal(inputs["probes"]["math/id"].mask, batch.response_mask())
    # token ids and their pieces for the token-level artifact rates
    assert inputs["probes"]["math/id"].response_ids == [[7, 8, 9]]
    assert inputs["probes"]["math/id"].pieces == [["<7>", "<8>", "<9>"]]
    assert inputs["principal_overlap"] is run.cfg.diagnostics.principal_overlap
    # the first stage's job also gets the prompts for the run's OOD distance table, once
    ood = inputs["ood_prompts"]
    assert ood["train"] == {"math": ["1+1?", "3+4?"]} and ood["eval"] == {"math/id": ["2+2?"]}
    assert ood["n"] == run.cfg.diagnostics.ood_distance_n > 0
    submitted.clear()
    ContinualRun._stage_diagnostics(run, 1)
    assert "ood_prompts" not in submitted[0][1]


@pytest.mark.parametrize("main", [True, False])
def test_step_drift_reads_the_whole_export_on_every_rank_and_the_main_one_writes(tmp_path, monkeypatch, main):
    from megatron_sdpo.diagnostics.stage import StagePolicies
    from megatron_sdpo.outputs.run_dir import RunDir

    rd = RunDir(tmp_path / "run")
    rd.prepare(resume=False)
    name = "model.layers.0.mlp.up_proj.weight"
    read = []

    def export_weights(model):
        for t in (torch.full((2, 2), 2.0),):
            read.append(model)
            yield name, t

    logged = []
    ref = {name: torch.ones(2, 2)}  # the first stage: its start is the base
    run = SimpleNamespace(
        cfg=load_config("tiny"),
        main=main,
        run_dir=rd,
        backend=SimpleNamespace(export_weights=export_weights),
        _stage_policies=lambda k: StagePolicies(base=ref, prev=ref, cur=None),
        monitor=SimpleNamespace(log=logged.append),
    )
    ContinualRun._step_drift(run, 0, 3)
    assert read == ["policy"]
    lines = report.read_step_drift(rd)
    if not main:
        assert lines == []
        return
    ((rec,),) = (lines,)
    assert (rec["stage"], rec["step"]) == (1, 3) and rec["vs_base"]["rel_frob_pooled"] == pytest.approx(1.0)
    assert rec["vs_stage_start"] == rec["vs_base"] and not logged
    # a failing measurement is logged and the export still read to its end (the collective)
    run._stage_policies = lambda k: StagePolicies(base={"other.weight": torch.ones(2, 2)}, prev=None, cur=None)
    ContinualRun._step_drift(run, 0, 4)
    assert read == ["policy", "policy"] and "not measured" in logged[0]


def test_offloaded_state_leaves_before_the_engine_starts_and_sleeps_through_a_resume_load(tmp_path, monkeypatch):
    """With backend.offload_training_state the grad buffer and main params go off the device
    before the engine is built (the "start" phase of the memory plan), and a resume loads the
    checkpoint with the engine asleep, then offloads before the refit ("resume", then "refit")."""
    from test_trainer import OffloadingBackend, RecordingEngine

    from megatron_sdpo import builders

    log: list[str] = []
    engine = RecordingEngine(log)

    class Backend(OffloadingBackend):
        def configure_optimizer(self, **kw):
            pass

        def load(self, path, *, weights_only=False):
            self.reload_training_state()
            self.log.append("load")
            return {"stage": 0, "step": 1, "teacher": run.teacher.state_dict(), "name": "step_1"}

    backend = Backend(log, lambda: engine.asleep)

    def make_rollout(*args, **kwargs):
        log.append("engine")
        return engine

    monkeypatch.setattr(builders, "make_backend", lambda *a, **k: backend)
    monkeypatch.setattr(builders, "make_rollout", make_rollout)
    cfg = load_config("tiny", ["backend.offload_training_state=true"])
    run = ContinualRun(cfg, tmp_path / "run", quiet=True)
    run._setup()
    assert log == ["offload", "engine"]
    (run.run_dir.checkpoints / "latest").write_text("step_1")
    del log[:]
    assert run._restore() == (0, 1)
    assert log == ["sleep", "reload", "load", "offload", "wake(weights)", "refit", "export", "tensor", "wake(kv_cache)"]
