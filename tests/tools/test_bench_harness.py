"""tools/bench_harness.py: interleaved rounds, summaries, ratios, the CSV schema, peak memory; and
every tools/bench_*.py script measuring through it."""

import ast
import csv
import subprocess
import sys
import time
from pathlib import Path

import bench_harness as bh
import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SCRIPTS = sorted(p for p in TOOLS.glob("bench_*.py") if p.name != "bench_harness.py")


def counting_arms(names, calls):
    return {n: (lambda n=n: calls.append(n) or {"t_s": float(len(calls))}) for n in names}


def test_every_round_runs_every_arm_once_in_an_order_that_changes():
    calls: list[str] = []
    bench = bh.Bench("t", verbose=False)
    bench.run(counting_arms("abc", calls), rounds=4, warmup=1)
    rounds = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    assert len(rounds) == 5 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert len({tuple(r) for r in rounds[1:]}) == 3  # rotated: 3 arms, 3 distinct orders in 4 rounds
    assert [r[0] for r in rounds[1:]] == ["a", "b", "c", "a"]  # every arm leads a round in turn
    # The warm-up round is run but not recorded; the recorded rounds are numbered from 1.
    assert sorted({r["round"] for r in bench.rows}) == [1, 2, 3, 4]
    assert len(bench.rows) == 4 * 3


def rows_of(values: dict[str, list[float]], metric="t_s", params=None):
    bench = bh.Bench("t", units={metric: "s"}, verbose=False, baseline="base")
    for rnd in range(len(next(iter(values.values())))):
        for arm, vs in values.items():
            bench.record(arm, rnd + 1, {metric: vs[rnd]}, params or {"N": 4})
    return bench


def test_summary_median_min_max_and_paired_ratio():
    bench = rows_of({"base": [2.0, 4.0, 10.0], "fast": [1.0, 3.0, 2.0]})
    by = {s["arm"]: s for s in bench.summary()}
    assert (by["fast"]["median"], by["fast"]["min"], by["fast"]["max"], by["fast"]["rounds"]) == (2.0, 1.0, 3.0, 3)
    assert (by["base"]["median"], by["base"]["min"], by["base"]["max"]) == (4.0, 2.0, 10.0)
    # Paired by round: 1/2, 3/4, 2/10 -> median 0.5 (the ratio of the medians would be 2/4 = 0.5 too,
    # but a round-3 outlier in the baseline must not move it: median of pairs, not of arms).
    assert by["fast"]["ratio"] == pytest.approx(0.5) and by["fast"]["baseline"] == "base"
    assert by["base"]["ratio"] == 1.0
    assert by["fast"]["unit"] == "s" and bh.parse_params(by["fast"]["params"]) == {"N": "4"}


def test_ratio_is_taken_within_a_case_and_against_the_arms_own_baseline():
    bench = bh.Bench("t", verbose=False, baseline=lambda arm: {"x": "ref_x", "y": "ref_y"}.get(arm))
    for n, scale in ((1, 1.0), (2, 10.0)):
        bench.record("ref_x", 1, {"m": 2.0 * scale}, {"N": n})
        bench.record("ref_y", 1, {"m": 8.0 * scale}, {"N": n})
        bench.record("x", 1, {"m": 1.0 * scale}, {"N": n})
        bench.record("y", 1, {"m": 2.0 * scale}, {"N": n})
    ratios = {(s["arm"], s["params"]): s["ratio"] for s in bench.summary() if s["arm"] in "xy"}
    assert ratios == {("x", "N=1"): 0.5, ("y", "N=1"): 0.25, ("x", "N=2"): 0.5, ("y", "N=2"): 0.25}


def test_an_arm_without_a_result_is_recorded_with_its_reason():
    def skipped():
        raise bh.NoResult("skipped", "not installed here")

    bench = bh.Bench("t", verbose=False, baseline="ok")
    bench.run({"ok": lambda: {"m": 1.0}, "gone": skipped}, rounds=2)
    gone = [r for r in bench.rows if r["arm"] == "gone"]
    assert [(r["metric"], r["value"], r["note"]) for r in gone] == [("skipped", "", "not installed here")] * 2
    (s,) = [s for s in bench.summary() if s["arm"] == "gone"]
    assert (s["metric"], s["rounds"], s["median"], s["ratio"], s["note"]) == (
        "skipped",
        0,
        "",
        "",
        "not installed here",
    )


def test_csv_schema_one_row_per_arm_round_metric(tmp_path):
    out = tmp_path / "b.csv"
    bench = bh.Bench("t", units={"a_s": "s"}, out=out, verbose=False, baseline="p")
    arms = {"p": lambda: {"a_s": 1.0, "tokens": 7}, "q": lambda: {"a_s": (2.5, "an upper bound"), "tokens": 5}}
    bench.run(arms, rounds=3, params={"N": 8, "dtype": "float32"})
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == bh.FIELDS == ["bench", "arm", "round", "metric", "value", "unit", "params", "note"]
    keys = [(r["arm"], r["round"], r["metric"]) for r in rows]
    assert sorted(keys) == sorted((a, str(k), m) for a in "pq" for k in (1, 2, 3) for m in ("a_s", "tokens"))
    q = next(r for r in rows if r["arm"] == "q" and r["metric"] == "a_s")
    assert (q["bench"], q["value"], q["unit"], q["note"]) == ("t", "2.5", "s", "an upper bound")
    assert bh.parse_params(q["params"]) == {"N": "8", "dtype": "float32"}
    summary = list(csv.DictReader(bh.summary_path(out).open()))
    assert bh.summary_path(out).name == "b.summary.csv" and list(summary[0]) == bh.SUMMARY_FIELDS
    assert {(s["arm"], s["metric"], s["rounds"], s["ratio"]) for s in summary} == {
        ("p", "a_s", "3", "1"),
        ("p", "tokens", "3", "1"),
        ("q", "a_s", "3", "2.5"),
        ("q", "tokens", "3", "0.714286"),
    }


def test_params_that_would_not_parse_back_are_refused():
    with pytest.raises(ValueError):
        bh.format_params({"model": "a;b"})


PEAK_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import bench_harness as bh
size = int(sys.argv[2])
with bh.PeakMemory("cpu") as peak:
    block = bytearray(size)  # zero-filled by memset: every page written, so resident
del block
print(peak.bytes, peak.exact)
"""


def fresh_python(code: str, *argv: str) -> subprocess.CompletedProcess:
    """`code` run by a Python started from a small one: a process's RSS high-water mark starts at
    its parent's RSS (Linux carries it across fork and exec), and pytest's may exceed a test's block."""
    relay = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, *sys.argv[1:]]).returncode)"
    return subprocess.run([sys.executable, "-c", relay, "-c", code, *argv], capture_output=True, text=True, timeout=60)


def test_peak_rss_grows_by_an_allocation_touched_in_the_block():
    # In a fresh interpreter: this process's high-water mark may stand far above its RSS after
    # earlier tests, and a block below that mark only gets an upper bound (exact False).
    size = 64 * 2**20
    proc = fresh_python(PEAK_CHILD, str(TOOLS), str(size))
    assert proc.returncode == 0, proc.stderr
    grown, exact = proc.stdout.split()
    # The block's pages, plus the interpreter's own churn (well under the block's size); a unit
    # slip (KiB read as bytes) would miss by 1024x either way.
    assert exact == "True"
    assert 0.9 * size <= int(grown) <= 1.5 * size


def test_tree_rss_sees_this_process():
    tree = bh.TreeRSS(every=0.01)
    block = bytearray(32 * 2**20)
    time.sleep(0.1)
    peak = tree.stop()
    assert peak >= bh.rss_bytes() - 16 * 2**20 and peak >= len(block)


def test_run_child_returns_the_childs_result_and_peak_rss(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(
        "import sys\nsys.path.insert(0, sys.argv[1])\nimport bench_harness as bh\n"
        "block = bytearray(96 * 2**20)\nbh.write_result(sys.argv[-1], {'n': len(block)})\n"
    )
    result, peak = bh.run_child([sys.executable, str(child), str(TOOLS)])
    assert result == {"n": 96 * 2**20} and peak >= 96 * 2**20
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit('boom')\n")
    with pytest.raises(bh.NoResult, match="boom") as e:
        bh.run_child([sys.executable, str(bad)])
    assert e.value.status == "failed"
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(bh.NoResult, match="timed out"):
        bh.run_child([sys.executable, str(slow)], timeout=1)


def names_used(tree: ast.AST) -> set[str]:
    """Modules imported, attributes and names referenced, strings written: code, not prose."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            used |= {node.module or ""} | {a.name for a in node.names}
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "/proc/" in node.value:
            used.add(node.value)
    return used


OWN = {
    "csv",
    "statistics",
    "resource",
    "DictWriter",
    "getrusage",
    "ru_maxrss",
    "wait4",
    "memory_info",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "/proc/self/statm",
}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_bench_script_measures_through_the_harness(script):
    """The 'one harness' claim, kept from regressing: no script writes its own CSV, reads memory
    itself or aggregates rounds itself."""
    tree = ast.parse(script.read_text())
    imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "bench_harness" in imports, f"{script.name} does not import bench_harness"
    used = names_used(tree)
    assert "Bench" in used, f"{script.name} does not measure through bench_harness.Bench"
    assert not used & OWN, f"{script.name} uses {sorted(used & OWN)} itself: use bench_harness"
    own_defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not own_defs & {"TreeRSS", "summarize", "write_csv", "_rss_bytes", "_peak_rss_bytes"}, own_defs


def test_the_scan_sees_what_it_forbids():
    bad = "import csv\nimport resource\nw = csv.DictWriter(f, [])\nresource.getrusage(0).ru_maxrss\n"
    assert names_used(ast.parse(bad)) >= {"csv", "DictWriter", "getrusage", "ru_maxrss"}
    assert not names_used(ast.parse('"""Peak RSS is getrusage ru_maxrss, written by csv.DictWriter."""'))


def test_the_scripts_are_the_eight_benchmarks():
    assert [p.name for p in SCRIPTS] == [
        "bench_kl.py",
        "bench_limit.py",
        "bench_pack.py",
        "bench_refit.py",
        "bench_rollout.py",
        "bench_run.py",
        "bench_sandbox.py",
        "bench_step.py",
    ]
