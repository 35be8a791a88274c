"""A bench script run as the user runs it (`python tools/bench_x.py ...`), and the CSV it writes,
for the tests of tools/. Importable by name: pytest puts the tests' folder on sys.path."""

import csv
import subprocess
import sys
from pathlib import Path

from bench_harness import FIELDS, SUMMARY_FIELDS, summary_path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def run(tmp_path, script, *argv, timeout=300):
    """The script's completed process; fails with its output's tail unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, str(TOOLS / script), *argv], capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def read(out: Path):
    """The rows and the summary of a bench_harness CSV, each with the harness's columns."""
    rows = list(csv.DictReader(out.open()))
    summary = list(csv.DictReader(summary_path(out).open()))
    assert list(rows[0]) == FIELDS and list(summary[0]) == SUMMARY_FIELDS
    return rows, summary
