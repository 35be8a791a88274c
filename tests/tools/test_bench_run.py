"""tools/bench_run.py: a whole run here and in a worktree of another commit, side by side (one
round of a one-step run; the real numbers are in dev/LOG.md)."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from bench_harness import summary_path

from megatron_sdpo.interfaces.domains import DOMAINS

ROOT = Path(__file__).resolve().parents[2]
SPLITS = ", ".join(f"{s}: {{n: 2}}" for s in ("id", "ood_near", "ood_mid", "ood_far"))
ONE_STEP = """
defaults: tiny
name: bench_run
stages:
  - {domain: math, steps: 1}
domains: {TWO_ITEMS}
algorithm: {prompts_per_step: 2, group_size: 2}
rollout: {engine: hf, max_new_tokens: 8}
eval: {max_new_tokens: 8}
diagnostics: {enabled: false}
""".replace("{TWO_ITEMS}", "{" + ", ".join(f"{d}: {{eval: {{{SPLITS}}}}}" for d in DOMAINS) + "}")


@pytest.mark.slow
def test_one_round_against_head(tmp_path):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    cfg = tmp_path / "one_step.yaml"
    cfg.write_text(ONE_STEP)
    out = tmp_path / "run.csv"
    argv = ["--against", "HEAD", "--preset", str(cfg), "--rounds", "1", "--out", str(out)]
    script = [sys.executable, str(ROOT / "tools" / "bench_run.py")]
    proc = subprocess.run(script + argv, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    got = {(r["arm"], r["metric"]): float(r["value"]) for r in rows}
    for arm in ("this", "against"):
        assert got[(arm, "wall_s")] > 0
    assert got[("this", "phase/steps")] > 0 and got[("this", "run_wall_s")] <= got[("this", "wall_s")]
    assert got[("this", "matrix_equal")] == 1.0  # HEAD is this code: the same matrix
    summary = list(csv.DictReader(summary_path(out).open()))
    assert any(r["arm"] == "this" and r["metric"] == "wall_s" for r in summary)
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert "bench_run_" not in listed  # the worktree is gone
