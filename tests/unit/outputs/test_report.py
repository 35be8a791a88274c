"""report.md from a hand-made run directory: the OOD-by-distance section and the principal-weight
column come from the files the stage diagnostics write."""

import json

from megatron_sdpo.config import load_config
from megatron_sdpo.outputs import report
from megatron_sdpo.outputs.run_dir import RunDir


def _run(tmp_path, *, table: bool):
    rd = RunDir(tmp_path / "run")
    rd.prepare(resume=False)
    rd.write_eval_matrix(
        [
            ("base", {"math/id": 0.2, "math/ood_near": 0.5, "code/ood_far": 0.4}),
            ("math", {"math/id": 0.6, "math/ood_near": 0.6, "code/ood_far": 0.3}),
        ]
    )
    rd.drift.mkdir(parents=True, exist_ok=True)
    report.write_stage_drift(
        rd, {"stage": 1, "domain": "math", "principal_overlap": {"summary": {"share_over_chance": 0.25}}}
    )
    if table:
        (rd.root / "ood_distance.json").write_text(
            json.dumps({"bandwidth": 1.0, "distances": {"math": {"math/ood_near": 0.1, "code/ood_far": 0.8}}})
        )
    return rd


def test_report_has_ood_by_measured_distance_and_principal_overlap(tmp_path):
    cfg = load_config("tiny")
    cfg.logging.plots = False
    rd = _run(tmp_path, table=True)
    s = report.summary(rd)
    groups = s["ood_by_distance"]["groups"]
    assert groups["near"]["pairs"] == ["1:math/ood_near"] and groups["mid"]["pairs"] == ["1:code/ood_far"]
    text = report.write_report(rd, cfg).read_text()
    assert "OOD change by measured distance" in text and "update on principal weights" in text
    assert "0.25" in text


def test_report_without_a_distance_table(tmp_path):
    cfg = load_config("tiny")
    cfg.logging.plots = False
    rd = _run(tmp_path, table=False)
    assert report.summary(rd)["ood_by_distance"] is None
    assert "OOD change by measured distance" not in report.write_report(rd, cfg).read_text()


def test_step_drift_lines_replace_redone_steps(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.prepare(resume=False)
    for stage, step in ((1, 2), (1, 4), (2, 2)):
        report.write_step_drift(rd, {"stage": stage, "step": step, "vs_base": {"rel_frob_pooled": step}})
    # a resumed run redoes stage 1 from step 4: later lines go, the new one replaces step 4
    report.write_step_drift(rd, {"stage": 1, "step": 4, "vs_base": {"rel_frob_pooled": 9}})
    got = report.read_step_drift(rd)
    assert [(r["stage"], r["step"], r["vs_base"]["rel_frob_pooled"]) for r in got] == [(1, 2, 2), (1, 4, 9)]
    with (rd.drift / "steps.jsonl").open("a") as f:
        f.write('{"stage": 1, "st')  # cut by a kill mid-write
    assert len(report.read_step_drift(rd)) == 2
