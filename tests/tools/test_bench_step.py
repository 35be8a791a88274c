"""tools/bench_step.py: the bench_harness CSV it writes on a tiny workload, and TRL arms reported,
not dropped."""

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from bench_harness import FIELDS, parse_params, summary_path

from bench_cli import run

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_step.py"
TINY = [
    "--steps",
    "2",
    "--warmup",
    "1",
    "--prompts",
    "4",
    "--samples",
    "2",
    "--micro-batch",
    "8",
    "--dataset",
    "8",
    "--new-tokens",
    "8",
    "--threads",
    "1",
]


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_step", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hf_arm_writes_round_rows_and_a_summary(tmp_path):
    out = tmp_path / "bench.csv"
    proc = run(tmp_path, "bench_step.py", "--arms", "ours_grpo_hf", "--rounds", "1", "--out", str(out), *TINY)
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == FIELDS
    assert {(r["bench"], r["arm"], r["round"]) for r in rows} == {("step", "ours_grpo_hf", "1")}
    assert parse_params(rows[0]["params"])["prompts"] == "4"
    r = {row["metric"]: row["value"] for row in rows}
    assert r["steps_timed"] == "1"  # 2 steps, the first untimed
    assert float(r["s_per_step"]) > 0 and float(r["wall_s"]) >= float(r["s_per_step"])
    # A process holding torch and a model is far above 50 MB; a unit slip (bytes vs KiB) is not.
    assert 50 < float(r["peak_rss_mb"]) < 64 * 1024
    assert float(r["peak_tree_rss_mb"]) > 50
    # The trainer's own phase timers made it into the rows (whatever their names), in seconds.
    phases = [row for row in rows if row["metric"].endswith("_time") or row["metric"].startswith("time/")]
    assert phases and all(float(p["value"]) >= 0 and p["unit"] == "s" for p in phases), rows
    # One timed step: the rollout phase's mean is that step's rollout time.
    assert float(r["time/rollout_mean"]) == pytest.approx(float(r["time/rollout"]), rel=1e-6)
    summary = {s["metric"]: s for s in csv.DictReader(summary_path(out).open())}
    assert summary["s_per_step"]["median"] == r["s_per_step"] and summary["s_per_step"]["rounds"] == "1"
    assert summary["s_per_step"]["ratio"] == ""  # no TRL arm ran beside it
    assert "ours_grpo_hf" in proc.stdout and "s_per_step" in proc.stdout


def test_trl_arms_without_trl_are_reported_skipped(monkeypatch, tmp_path):
    tool = load_tool()
    monkeypatch.setattr(tool, "trl_missing", lambda: "TRL is not installed (pip install trl)")
    args = tool.parse_args(["--arms", "trl_grpo,trl_sdpo", "--rounds", "2", "--out", str(tmp_path / "x.csv"), *TINY])
    bench = tool.measure(args)
    assert [(r["arm"], r["round"], r["metric"]) for r in bench.rows] == [
        ("trl_grpo", 1, "skipped"),
        ("trl_sdpo", 1, "skipped"),
        ("trl_sdpo", 2, "skipped"),
        ("trl_grpo", 2, "skipped"),
    ]
    assert all("pip install trl" in r["note"] for r in bench.rows)
    summary = list(csv.DictReader(summary_path(tmp_path / "x.csv").open()))
    assert [(s["arm"], s["metric"], s["rounds"]) for s in summary] == [
        ("trl_grpo", "skipped", "0"),
        ("trl_sdpo", "skipped", "0"),
    ]


def test_our_arms_are_compared_with_the_trl_arm_of_their_algorithm():
    tool = load_tool()
    assert [tool.trl_peer(a) for a in ("ours_grpo_vllm", "ours_sdpo_hf", "trl_sdpo")] == [
        "trl_grpo",
        "trl_sdpo",
        "trl_sdpo",
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--arms", "ours_grpo_hf,nope"],
        ["--steps", "2", "--warmup", "2"],
        ["--samples", "1"],
        ["--prompts", "4", "--samples", "2", "--micro-batch", "3"],
    ],
)
def test_bad_options_are_one_line_errors(argv, tmp_path):
    proc = subprocess.run([sys.executable, str(TOOL), *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error:" in proc.stderr.strip().splitlines()[-1]


def test_vllm_arms_run_the_compiled_decoder_and_the_eager_arms_do_not(tmp_path):
    """The vLLM arms measure the default (rollout.enforce_eager=false); the `vllmeager` arms,
    requested by name only, the same engine eager."""
    tool = load_tool()
    args = tool.parse_args(["--out", str(tmp_path / "x.csv"), *TINY])
    assert not set(tool.EAGER) & set(args.arm_list)
    for arm, eager in (("ours_grpo_vllm", False), ("ours_sdpo_vllmeager", True)):
        _, algorithm, engine = tool.arm_parts(arm)
        cfg = tool.ours_config(args, algorithm, engine)
        assert (cfg.algorithm.name, cfg.rollout.engine, cfg.rollout.enforce_eager) == (algorithm, "vllm", eager)
