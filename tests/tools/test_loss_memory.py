"""tools/loss_memory.py: the vocabulary-wide tensors of a megatron train step at their peak
against the memory ledger's count of them (memory_ledger.logit_counts)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.megatron
@pytest.mark.distributed
def test_the_ledger_bounds_the_measured_peak_whole_and_chunked(tmp_path):
    out = tmp_path / "m.json"
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "loss_memory.py"), "--losses", "sdpo_topk_clip,sdpo_full_clip", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["loss"]: r for r in json.loads(out.read_text())["losses"]}
    for r in rows.values():
        # An upper bound, at most 60% above what the step held (memory_ledger.logit_counts).
        assert all(1.0 <= x <= 1.6 for x in r["ledger_over_peak"].values()), r
    # Chunking: the full-vocabulary JSD's fp32 tensors span 16 response tokens instead of 96.
    full = rows["sdpo_full_clip"]["peaks"]
    assert full["16,16"] < 0.7 * full["16,0"]


def test_an_unknown_loss_is_one_error_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "loss_memory.py"), "--losses", "dpo"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: unknown loss 'dpo'") and proc.stderr.count("\n") == 1
