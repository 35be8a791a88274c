"""The artifact-injection assay end to end: a base built with duplicate boxes, the assay preset
run from it, and the study's amplification endpoint read from the run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHRINK = [
    "stages=[{domain: math, steps: 3}]",
    "algorithm.prompts_per_step=4",
    "algorithm.group_size=4",
    "rollout.engine=hf",
    "rollout.max_new_tokens=16",
    "eval.max_new_tokens=16",
    "diagnostics.probe_n=1",
    "diagnostics.response_drift=false",
    "checkpoint.save_every=0",
    *(f"domains.{d}.eval.{s}.n=2" for d in ("math", "tooluse") for s in ("id", "ood_near", "ood_mid", "ood_far")),
]


def _call(args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_artifact_assay_runs(tmp_path):
    from megatron_sdpo.study.metrics import RunView, run_metrics

    base = tmp_path / "base"
    # A short build (the shipped recipe's shape, fewer steps and records): every math answer of
    # its warm-up carries the duplicate, so the rollouts show it from the first step.
    _call(
        [
            str(REPO / "tools" / "make_tiny_base.py"),
            "--out",
            str(base),
            "--boxed-duplicate-rate",
            "1.0",
            "--steps",
            "120",
            "--n-train",
            "200",
        ],
        tmp_path,
    )
    assert json.loads((base / "tiny_build.json").read_text())["config"]["boxed_duplicate_rate"] == 1.0
    _call(
        [
            "-m",
            "megatron_sdpo",
            "run",
            "tiny_artifact",
            f"model.path={base}",
            "algorithm.name=sdpo",
            *SHRINK,
            "--quiet",
            "--out",
            "run",
        ],
        tmp_path,
    )
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["artifacts/fmt_boxed_repeat_rate"] for r in rows if "artifacts/fmt_boxed_repeat_rate" in r]
    assert len(rates) == 3 and all(0.0 <= x <= 1.0 for x in rates)
    assert max(rates) > 0, "a base warmed up on duplicated boxes never repeated one"
    got = run_metrics(RunView(tmp_path / "run"))
    assert got["boxed_repeat_max"] == max(rates) and got["boxed_repeat_gain"] is not None
    # The teacher's endorsement of the repeated box: logged on a step whose distilled answers
    # repeat it (most do when most answers carry the duplicate).
    distilled = [r for r in rows if r.get("teacher_context_frac", 0) > 0]
    if distilled and min(rates) > 0.5:
        assert any("teacher/artifact_endorsement" in r for r in distilled)
        assert got["teacher_artifact_endorsement"] is not None
