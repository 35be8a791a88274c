"""tools/bench_pack.py: one CSV row per (loss, arm) with the documented fields, on a tiny model."""
import csv
import subprocess
import sys
from pathlib import Path

from megatron_sdpo.backends.tiny import save_tiny_qwen3

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_pack.py"


def test_writes_one_row_per_loss_and_arm(tmp_path):
    model = save_tiny_qwen3(tmp_path / "m", seed=0)
    out = tmp_path / "bench.csv"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--model", model, "--samples", "6", "--micro-batch-size", "4", "--rounds", "2",
         "--row-tokens", "0,40", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["loss"], r["arm"]) for r in rows] == [
        (loss, arm) for loss in ("grpo", "sdpo") for arm in ("padded", "packed_0", "packed_40")
    ]
    for r in rows:
        real, fed = int(r["real_tokens"]), int(r["model_tokens"])
        assert real > 0 and fed >= real and float(r["median_s"]) > 0 and float(r["median_cpu_s"]) > 0
        if r["arm"] == "padded":
            assert float(r["ratio_vs_padded"]) == 1.0
        if r["arm"] == "packed_0":
            assert fed == real  # one row per micro-batch: not a single pad token
        if r["arm"] == "packed_40":  # rows of at most 40 tokens unless one sample is longer (< 73)
            assert fed <= int(rows[0]["model_tokens"])
