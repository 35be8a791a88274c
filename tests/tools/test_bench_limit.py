"""tools/bench_limit.py: its CSV, and its model FLOP count against the profiler's count of the
step's matrix multiplies."""

import csv
import sys

import pytest
from bench_harness import summary_path

from bench_cli import TOOLS, run


def test_rows_per_arm_and_utilization_below_one(tmp_path):
    out = tmp_path / "limit.csv"
    tiny = ["--models", "tiny", "--prompts", "2", "--samples", "2", "--new-tokens", "8", "--rounds", "1"]
    proc = run(tmp_path, "bench_limit.py", *tiny, "--threads", "1", "--out", str(out), timeout=600)
    rows = list(csv.DictReader(out.open()))
    got = {(r["arm"], r["metric"]): float(r["value"]) for r in rows}
    for arm in ("tiny_grpo", "tiny_sdpo"):
        assert 0 < got[arm, "mfu"] < 1 and got[arm, "peak_gflops"] > 0
        assert got[arm, "mfu"] == pytest.approx(
            got[arm, "achieved_gflops"] / got[arm, "peak_gflops"], rel=1e-5
        )  # 6 digits in the CSV
        assert 0 < got[arm, "matmul_time_share"] < 1
    # The teacher's forward adds a third of the policy's forward and backward at least.
    assert got["tiny_sdpo", "model_gflop"] > 1.3 * got["tiny_grpo", "model_gflop"]
    assert summary_path(out).is_file() and "matmul" in proc.stdout


def test_model_flops_match_the_profiled_matrix_multiplies():
    """The step's counted FLOPs against torch.profiler's FLOP count of its matrix multiplies:
    equal up to what the profiler does not count (the attention inside SDPA, a few percent on
    these short rows) and the lm head's share it attributes the same way."""
    sys.path.insert(0, str(TOOLS))
    from bench_limit import MATMUL_OPS, make_case, model_flops
    from torch.profiler import ProfilerActivity, profile

    backend, loss, batch, _ = make_case("tiny", "grpo", 2, 4, 16)
    counted = model_flops(backend, batch, teacher=False)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        backend.train_step(batch, loss)
    profiled = sum(e.flops or 0 for e in prof.key_averages() if e.key in MATMUL_OPS)
    assert counted == pytest.approx(profiled, rel=0.1), (counted, profiled)
