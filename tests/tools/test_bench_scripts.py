"""tools/bench_kl.py, bench_rollout.py, bench_sandbox.py write the bench_harness CSV (tiny sizes; the
real numbers are in dev/LOG.md), and every bench script's --help runs (bench_refit's measurement
needs vLLM and minutes: it is run by hand)."""

import csv
import subprocess
import sys

import pytest
from bench_harness import parse_params

from bench_cli import TOOLS, read, run

# The KL workload of both bench_kl tests: a vocabulary of 4099 is not a multiple of any chunk.
KL_SHAPE = ["--tokens", "64", "--hidden", "16", "--vocab", "4099"]


@pytest.mark.parametrize("impls", ["reference,chunked", "megatron_logits,megatron_fused"])
def test_bench_kl_rows_per_impl_and_round(tmp_path, impls):
    out = tmp_path / "kl.csv"
    proc = run(
        tmp_path,
        "bench_kl.py",
        *KL_SHAPE,
        "--impls",
        impls,
        "--rounds",
        "2",
        "--out",
        str(out),
        "--timeout",
        "120",
        "--threads",
        "1",
    )
    rows, summary = read(out)
    full, fused = impls.split(",")
    # Each (impl, round) ran in its own process, the two impls interleaved: round 2 starts with the second.
    assert [r["arm"] for r in rows if r["metric"] == "time_s"] == [full, fused, fused, full]
    for r in rows:
        assert parse_params(r["params"]) == {"N": "64", "H": "16", "V": "4099", "dtype": "float32", "device": "cpu"}
        assert r["note"] == "" or "high-water" in r["note"], r
        if r["metric"] == "peak_mem_bytes":
            assert int(r["value"]) >= 0 and r["unit"] == "B"
        else:
            assert r["metric"] in ("time_s", "cpu_time_s") and float(r["value"]) > 0 and r["unit"] == "s"
    peak = {s["arm"]: s for s in summary if s["metric"] == "peak_mem_bytes"}
    assert peak[fused]["baseline"] == full and peak[fused]["rounds"] == "2" and peak[full]["unit"] == "B"
    assert f"{fused} / {full} peak memory" in proc.stdout


def test_bench_kl_skips_the_reference_over_the_memory_limit(tmp_path):
    out = tmp_path / "kl.csv"
    run(
        tmp_path,
        "bench_kl.py",
        *KL_SHAPE,
        "--impls",
        "reference",
        "--max-ref-bytes",
        "1000",
        "--out",
        str(out),
    )
    rows, summary = read(out)
    assert [(r["arm"], r["metric"], r["value"]) for r in rows] == [("reference", "skipped", "")]
    assert "exceeds" in rows[0]["note"] and summary[0]["rounds"] == "0"


def test_bench_rollout_writes_loop_and_fixed_rows(tmp_path):
    out = tmp_path / "rollout.csv"
    run(
        tmp_path,
        "bench_rollout.py",
        "--engines",
        "hf",
        "--prompts",
        "2",
        "--n",
        "2",
        "--new-tokens",
        "4",
        "--repeats",
        "1",
        "--loop-repeats",
        "1",
        "--loop-new-tokens",
        "6",
        "--out",
        str(out),
    )
    rows, _ = read(out)
    got = {
        (
            parse_params(r["params"])["workload"],
            r["arm"],
            parse_params(r["params"]).get("max_new_tokens"),
            r["metric"],
        ): float(r["value"])
        for r in rows
    }
    # The loop's samples stop at EOS (at most 6 tokens each); the fixed workload's never do.
    assert 0 < got["loop", "hf", "6", "generated_tokens"] <= 2 * 2 * 6 and got["loop", "hf", "6", "refit_s"] >= 0
    assert got["fixed", "hf", "4", "generated_tokens"] == 2 * 2 * 4
    assert got["loop", "hf", "6", "generate_s"] > 0 and got["fixed", "hf", "4", "generate_s"] > 0
    assert got["loop", "hf", None, "startup_s"] > 0 and got["fixed", "hf", None, "first_generate_s"] > 0


def test_bench_rollout_preset_is_for_the_loop_workload_only(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "bench_rollout.py"), "--preset", "smollm2_135m", "--out", str(tmp_path / "x.csv")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "--preset applies to the loop workload only" in proc.stderr


def test_bench_sandbox_csv_on_stdout(tmp_path):
    proc = run(tmp_path, "bench_sandbox.py", "--programs", "2", "--cases", "1", "--repeats", "2")
    rows = list(csv.DictReader(proc.stdout.splitlines()))
    assert sorted((r["arm"], r["round"], r["metric"]) for r in rows) == sorted(
        (a, k, m) for a in ("per_program", "batched") for k in "12" for m in ("seconds", "programs_per_s")
    )
    assert all(float(r["value"]) > 0 for r in rows)
    assert "per_program" in proc.stderr  # progress and the summary table stay off the CSV


@pytest.mark.parametrize(
    "script",
    [
        "bench_kl.py",
        "bench_limit.py",
        "bench_pack.py",
        "bench_refit.py",
        "bench_rollout.py",
        "bench_sandbox.py",
        "bench_step.py",
    ],
)
def test_help(tmp_path, script):
    proc = run(tmp_path, script, "--help", timeout=120)
    assert "usage:" in proc.stdout
