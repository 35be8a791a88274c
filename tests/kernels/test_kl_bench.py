"""tools/bench_kl.py writes the documented CSV (tiny shapes; the real numbers are in the report)."""
import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_writes_csv_rows(tmp_path):
    out = tmp_path / "bench.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_kl.py"), "--tokens", "64", "--hidden", "16", "--vocab", "4099",
         "--impls", "reference,chunked", "--out", str(out), "--timeout", "120", "--threads", "1"],
        capture_output=True, text=True, timeout=200, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["impl"] for r in rows] == ["reference", "chunked"]
    for r in rows:
        assert r.keys() >= {"impl", "N", "H", "V", "dtype", "device", "peak_mem_bytes", "time_s"}
        assert (r["N"], r["H"], r["V"], r["device"]) == ("64", "16", "4099", "cpu")
        assert r["note"] == "" or "high-water" in r["note"], r
        assert float(r["time_s"]) > 0 and int(r["peak_mem_bytes"]) >= 0


def test_bench_compares_the_megatron_paths(tmp_path):
    out = tmp_path / "mcore.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_kl.py"), "--tokens", "64", "--hidden", "16", "--vocab", "4099",
         "--impls", "megatron_logits,megatron_fused", "--out", str(out), "--timeout", "120", "--threads", "1"],
        capture_output=True, text=True, timeout=200, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["impl"] for r in rows] == ["megatron_logits", "megatron_fused"]
    assert all(float(r["time_s"]) > 0 and int(r["peak_mem_bytes"]) >= 0 for r in rows), rows
    assert "megatron_fused / megatron_logits peak memory" in proc.stdout
