"""tools/bench_rollout.py runs both workloads and writes the documented CSV (HF engine only, tiny
sizes: the vLLM numbers are measured by hand, see the README)."""
import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bench_rollout_writes_loop_and_fixed_rows(tmp_path):
    out = tmp_path / "rollout.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_rollout.py"), "--engines", "hf", "--prompts", "2", "--n", "2",
         "--new-tokens", "4", "--repeats", "1", "--loop-repeats", "1", "--loop-new-tokens", "6", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["workload"], r["engine"], r["max_new_tokens"]) for r in rows] == [("loop", "hf", "6"), ("fixed", "hf", "4")]
    loop, fixed = rows
    # The loop's samples stop at EOS (at most 6 tokens each); the fixed workload's never do.
    assert 0 < float(loop["generated_tokens"]) <= 2 * 2 * 6 and float(loop["refit_s"]) >= 0
    assert int(fixed["generated_tokens"]) == 2 * 2 * 4
    assert all(float(r["seconds"]) > 0 for r in rows)
    assert (tmp_path / "rollout.startup.csv").is_file()


def test_bench_rollout_preset_is_for_the_loop_workload_only(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_rollout.py"), "--preset", "smollm2_135m", "--out", str(tmp_path / "x.csv")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2 and "--preset applies to the loop workload only" in proc.stderr
