"""tools/bench_pack.py: one CSV row per (loss, arm) with the documented fields, on a tiny model."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sdpo.backends.tiny import save_tiny_qwen3

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_pack.py"


def test_writes_one_row_per_loss_and_arm(tmp_path):
    model = save_tiny_qwen3(tmp_path / "m", seed=0)
    out = tmp_path / "bench.csv"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--model", model, "--samples", "6", "--micro-batch-size", "4", "--rounds", "2",
         "--row-tokens", "0,40", "--group-size", "3", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["loss"], r["arm"]) for r in rows] == [
        (loss, arm) for loss in ("grpo", "sdpo") for arm in ("padded", "packed_0", "shared_0", "packed_40", "shared_40")
    ]
    fed = {(r["loss"], r["arm"]): int(r["model_tokens"]) for r in rows}
    for r in rows:
        real, arm = int(r["real_tokens"]), r["arm"]
        assert real > 0 and float(r["median_s"]) > 0 and float(r["median_cpu_s"]) > 0
        if arm == "padded":
            assert float(r["ratio_vs_padded"]) == 1.0 and fed[r["loss"], arm] >= real
        if arm == "packed_0":
            assert fed[r["loss"], arm] == real  # one row per micro-batch: not a single pad token
        if arm == "packed_40":  # rows of at most 40 tokens unless one sample is longer (< 73)
            assert real <= fed[r["loss"], arm] <= fed[r["loss"], "padded"]
        if arm == "shared_0":  # one row per micro-batch, 6 samples of 2 prompts: prompt copies dropped
            assert fed[r["loss"], arm] < fed[r["loss"], "packed_0"]


@pytest.mark.megatron
def test_megatron_arms_feed_the_real_tokens_when_packed(tmp_path):
    model = save_tiny_qwen3(tmp_path / "m", seed=0)
    out = tmp_path / "bench.csv"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--backend", "megatron", "--model", model, "--samples", "6", "--micro-batch-size", "4",
         "--rounds", "2", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["loss"], r["arm"]) for r in rows] == [(loss, arm) for loss in ("grpo", "sdpo") for arm in ("padded", "packed")]
    for r in rows:
        fed, real = int(r["model_tokens"]), int(r["real_tokens"])
        assert float(r["median_s"]) > 0
        # Packed rows (no pipeline parallelism) hold the samples and nothing else; padded rows
        # are the longest sample (teacher prompts included) long.
        assert fed == real if r["arm"] == "packed" else fed > real
