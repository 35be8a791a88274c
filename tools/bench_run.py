"""A whole run's wall time and where it goes: this checkout against another commit, side by side.

    python tools/bench_run.py --against HEAD~3 [--preset tiny] [--rounds 2] [--out bench_run.csv] \
        [--threads 1] [--set KEY=VALUE ...]

Each round runs `python -m megatron_sdpo run PRESET` once in this working tree (`this`) and
once in a git worktree of `--against` (`against`): the same interpreter and environment, each
arm's own package first on sys.path, `--threads` torch threads (OMP_NUM_THREADS, as a study runs
its runs), arms in an order rotated every round (bench_harness.Bench). Per arm and round: the
process's wall time (`wall_s`), the run's own wall time and its phases where the run writes
`timings.json` (`phase/<name>`, `other_s`), and `matrix_equal`: 1 when the two arms' eval
matrices of the round are byte-identical. The summary has each metric's median over rounds and
`this`'s ratio to `against`, paired by round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_harness import Bench, NoResult, print_summary

REPO = Path(__file__).resolve().parents[1]


def _worktree(commit: str, where: Path) -> Path:
    path = where / "against"
    proc = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], capture_output=True, text=True
    )
    if proc.returncode:
        sys.exit(f"error: git worktree add {commit}: {proc.stderr.strip().splitlines()[-1]}")
    return path


def _arm(checkout: Path, preset: str, sets: list[str], threads: int, runs: Path, name: str):
    def run() -> dict:
        out = runs / f"{name}_{time.monotonic_ns()}"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join([str(checkout), str(checkout / "kernels"), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [sys.executable, "-m", "megatron_sdpo", "run", preset, *sets, "--out", str(out), "--quiet"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode:
            run.matrices.append(None)  # type: ignore[attr-defined]
            raise NoResult("failed", (proc.stderr.strip().splitlines() or ["no output"])[-1])
        metrics: dict = {"wall_s": wall}
        timings = out / "timings.json"
        if timings.is_file():
            t = json.loads(timings.read_text())
            metrics["run_wall_s"] = t["wall_s"]
            metrics["other_s"] = t["other_s"]
            metrics.update({f"phase/{k}": v for k, v in t["phases"].items()})
        run.matrices.append((out / "eval_matrix.csv").read_bytes())  # type: ignore[attr-defined]
        shutil.rmtree(out / "checkpoints", ignore_errors=True)  # keep the disk; the matrix is read
        return metrics

    run.matrices = []  # type: ignore[attr-defined]
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="the commit to compare with (e.g. HEAD~3, a hash)")
    ap.add_argument("--preset", default="tiny", help="a preset name or a YAML file (absolute path)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a config override KEY=VALUE")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each run (OMP_NUM_THREADS)")
    ap.add_argument("--out", default="bench_run.csv")
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1:
        sys.exit("error: --rounds and --threads must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench_run_") as tmp:
        where = Path(tmp)
        against = _worktree(args.against, where)
        try:
            arms = {
                "this": _arm(REPO, args.preset, args.sets, args.threads, where, "this"),
                "against": _arm(against, args.preset, args.sets, args.threads, where, "against"),
            }
            bench = Bench(
                "run",
                units={"wall_s": "s", "run_wall_s": "s", "other_s": "s"},
                out=args.out,
                baseline=lambda arm: "against" if arm == "this" else None,
            )
            params = {
                "preset": args.preset,
                "against": args.against,
                "threads": args.threads,
                "sets": " ".join(args.sets),
            }
            bench.run(arms, args.rounds, params)
            a, b = arms["this"].matrices, arms["against"].matrices  # type: ignore[attr-defined]
            for rnd, (x, y) in enumerate(zip(a, b, strict=True), start=1):
                if x is not None and y is not None:
                    bench.record("this", rnd, {"matrix_equal": float(x == y)}, params)
            print_summary(bench.write())
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(against)], capture_output=True)


if __name__ == "__main__":
    main()
