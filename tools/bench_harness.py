"""The benchmark harness of tools/bench_*.py: interleaved rounds, medians, peak memory, one CSV schema.

A bench script compares named arms (implementations, layouts, engines) on a case (sizes, dtype,
device, ...). Bench.run runs them in rounds: round r runs every arm once, in an order rotated by
r, so a machine that slows down mid-run (another job, clock throttling) slows every arm alike
instead of whichever arm ran last. An arm that needs a fresh interpreter (its own allocator
high-water mark, its own global state) runs itself through run_child.

Rounds CSV (`--out PATH`; `-` is stdout), every script:

    bench,arm,round,metric,value,unit,params,note

  one row per (arm, round, metric). bench: the script's name without `bench_`; round: 1, 2, ...;
  params: the case as `k=v;k=v` (parse_params reads it), the same for every arm compared on it;
  note: why a value is only a bound, or, in a row with metric `skipped` or `failed` and no value,
  why the arm has no measurement that round.

Summary CSV (PATH with `.summary.csv` for `.csv`; none for `-`):

    bench,arm,metric,median,min,max,rounds,unit,baseline,ratio,params,note

  one row per (params, arm, metric). ratio: the median over rounds of the arm's value divided by
  the baseline arm's value of the same round: paired, since the two ran back to back, so drift
  between rounds cancels. Empty where the arm has no baseline measured.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

FIELDS = ["bench", "arm", "round", "metric", "value", "unit", "params", "note"]
SUMMARY_FIELDS = [
    "bench",
    "arm",
    "metric",
    "median",
    "min",
    "max",
    "rounds",
    "unit",
    "baseline",
    "ratio",
    "params",
    "note",
]
median = statistics.median


def rss_bytes() -> int:
    """Resident set of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident set since it started."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class PeakMemory:
    """Context manager: `bytes`, the extra memory the block peaked at over what was held at entry.

    CUDA: the caching allocator's max_memory_allocated. CPU: the RSS high-water mark (tracemalloc
    cannot see torch's allocations); that mark spans the process's life, and starts at its
    parent's RSS (Linux keeps it across fork and exec: start measuring processes from a small
    driver), so a block that stays below an earlier peak gets an upper bound only: `exact` False.
    """

    def __init__(self, device="cpu"):
        self.cuda, self.bytes, self.exact = None, 0, True
        if str(device).startswith("cuda"):
            import torch

            self.cuda = torch.cuda

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            self.cuda.synchronize()
            self.cuda.reset_peak_memory_stats()
            self._base = self.cuda.memory_allocated()
        else:
            self._base, self._mark = rss_bytes(), peak_rss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.cuda.synchronize()
            self.bytes = self.cuda.max_memory_allocated() - self._base
        else:
            peak = peak_rss_bytes()
            self.bytes, self.exact = max(0, peak - self._base), peak > self._mark


class TreeRSS:
    """Peak summed RSS of this process and its descendants (vLLM workers, compilers), sampled in
    a daemon thread: no kernel counter covers a process tree."""

    def __init__(self, every: float = 0.2):
        self.peak, self._every, self._stop = 0, every, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):  # exited between listing and reading
                    total += p.memory_info().rss
            self.peak = max(self.peak, total)
            self._stop.wait(self._every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def timed(fn: Callable[[], object], *, cuda: bool = False) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all threads) of one fn() call. The CPU
    seconds measure the work done on a machine shared with other jobs, which wall time blurs
    with waiting. cuda: wall time between CUDA events, so the queued kernels are counted."""
    c0 = time.process_time()
    if cuda:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, time.process_time() - c0
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


class NoResult(Exception):
    """An arm's round without a measurement; status `skipped` (cannot run here) or `failed`."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def run_child(cmd: list[str], *, timeout: float | None = None, env: dict | None = None) -> tuple[dict, int]:
    """Run `cmd --result FILE` in a fresh process: (the dict it passed to write_result, its peak
    RSS in bytes, which counts this process's RSS at the spawn, see PeakMemory). Raises
    NoResult("failed", last line of its output) when it exits non-zero,
    writes no result or outlives `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        result, log = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        with log.open("w") as fh:
            proc = subprocess.Popen([*cmd, "--result", str(result)], stdout=fh, stderr=subprocess.STDOUT, env=env)
            killed = threading.Event()
            timer = threading.Timer(timeout or 0, lambda: (killed.set(), proc.kill()))
            if timeout:
                timer.start()
            # wait4 rather than Popen.wait: its rusage is this child's own high-water mark, where
            # RUSAGE_CHILDREN would be the largest of every child reaped so far.
            _, status, usage = os.wait4(proc.pid, 0)
            timer.cancel()
            proc.returncode = os.waitstatus_to_exitcode(status)
        lines = log.read_text(errors="replace").strip().splitlines()
        if killed.is_set():
            raise NoResult("failed", f"timed out after {timeout:.0f} s")
        if proc.returncode != 0 or not result.is_file():
            print(
                f"child {' '.join(cmd[:3])} ... exited {proc.returncode}; log tail:",
                *lines[-20:],
                sep="\n",
                file=sys.stderr,
            )
            raise NoResult("failed", f"exit {proc.returncode}: " + (lines[-1:] or ["no output"])[0][:200])
        return json.loads(result.read_text()), usage.ru_maxrss * 1024


def write_result(path: str, result: dict) -> None:  # the child's side of run_child
    Path(path).write_text(json.dumps(result))


def format_params(params: dict) -> str:
    if any(";" in f"{k}{v}" or "=" in str(k) for k, v in params.items()):
        raise ValueError(f"params {params}: ';', or '=' in a key, would not parse back")
    return ";".join(f"{k}={v}" for k, v in params.items())


def parse_params(text: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in text.split(";")) if text else {}


def rotated(arms: list[str], rnd: int) -> list[str]:
    """Round `rnd`'s order: every arm once, each in every position once per len(arms) rounds."""
    k = (rnd - 1) % len(arms) if arms else 0
    return arms[k:] + arms[:k]


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) and not v.is_integer() else str(int(v)) if _num(v) else str(v)


def summarize(rows: list[dict], baseline: str | Callable[[str], str | None] | None = None) -> list[dict]:
    """One row per (bench, params, arm, metric) of `rows` (SUMMARY_FIELDS), in first-seen order.
    baseline: the arm every arm's ratio is taken against, or a function of the arm naming it."""
    base_of = baseline if callable(baseline) else (lambda arm: baseline)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["bench"], r["params"], r["arm"], r["metric"]), []).append(r)
    value = {(key, r["round"]): r["value"] for key, rs in groups.items() for r in rs}
    out = []
    for (bench, params, arm, metric), rs in groups.items():
        vals = [r["value"] for r in rs if _num(r["value"])]
        ref = base_of(arm)
        ratios = [
            r["value"] / b
            for r in rs
            if ref and _num(r["value"]) and _num(b := value.get(((bench, params, ref, metric), r["round"]))) and b != 0
        ]
        notes = dict.fromkeys(r["note"] for r in rs if r["note"])
        out.append(
            {
                "bench": bench,
                "arm": arm,
                "metric": metric,
                "median": median(vals) if vals else "",
                "min": min(vals, default=""),
                "max": max(vals, default=""),
                "rounds": len(vals),
                "unit": rs[0]["unit"],
                "baseline": ref if ratios else "",
                "ratio": median(ratios) if ratios else "",
                "params": params,
                "note": "; ".join(notes),
            }
        )
    return out


def write_csv(path: str | Path, rows: list[dict], fields: list[str]) -> None:
    f = sys.stdout if str(path) == "-" else open(path, "w", newline="")
    try:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({k: _fmt(r[k]) for k in fields} for r in rows)
    finally:
        if f is not sys.stdout:
            f.close()


def summary_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_suffix(".summary.csv") if out.suffix == ".csv" else Path(f"{out}.summary.csv")


def print_summary(summary: list[dict], metrics=None, file=None) -> None:
    """A table of `summary` (the metrics named, or all), one block per case."""
    file, params = file or sys.stdout, None
    for s in summary:
        if metrics is not None and s["metric"] not in metrics and s["rounds"]:
            continue  # an arm without a measurement is shown with its reason
        if s["params"] != params:
            params = s["params"]
            print(f"[{s['bench']}] {params}", file=file)
        if not s["rounds"]:
            print(f"  {s['arm']:20s} {s['metric']}: {s['note']}", file=file)
            continue
        ratio = f"  x{s['ratio']:.3f} vs {s['baseline']}" if s["baseline"] else ""
        print(
            f"  {s['arm']:20s} {s['metric']:18s} median {_fmt(s['median']):>10s} {s['unit']:6s} "
            f"[{_fmt(s['min'])}, {_fmt(s['max'])}] of {s['rounds']}{ratio}",
            file=file,
        )


class Bench:
    """The rows one script measures. With `out`, both CSVs are rewritten after every arm's
    round, so an interrupted run keeps the rounds it finished."""

    def __init__(
        self,
        name: str,
        *,
        units: dict[str, str] | None = None,
        out: str | Path | None = None,
        baseline: str | Callable[[str], str | None] | None = None,
        verbose: bool = True,
    ):
        self.name, self.units, self.out, self.baseline, self.verbose = name, dict(units or {}), out, baseline, verbose
        self.rows: list[dict] = []

    def record(self, arm: str, rnd: int, metrics: dict, params: dict | None = None, note: str = "") -> None:
        """metrics: name -> value, or -> (value, note) for a value that needs one."""
        p = format_params(params or {})
        for metric, v in metrics.items():
            v, why = v if isinstance(v, (tuple, list)) else (v, note)
            if not (_num(v) or v == ""):
                raise TypeError(f"{self.name} {arm} {metric}: {v!r} is not a number")
            self.rows.append(
                {
                    "bench": self.name,
                    "arm": arm,
                    "round": rnd,
                    "metric": metric,
                    "value": v,
                    "unit": self.units.get(metric, ""),
                    "params": p,
                    "note": why,
                }
            )

    def run(
        self, arms: dict[str, Callable[[], dict]], rounds: int, params: dict | None = None, warmup: int = 0
    ) -> None:
        """Every arm once per round in rotated order, after `warmup` unrecorded rounds (lazy
        initialisation, caches, compilation). An arm returns its metrics (see record) or raises
        NoResult."""
        names = list(arms)
        for rnd in range(1 - warmup, rounds + 1):
            for arm in rotated(names, rnd):
                try:
                    metrics, note = arms[arm](), ""
                except NoResult as e:
                    metrics, note = {e.status: ""}, e.reason
                if rnd < 1:
                    continue
                self.record(arm, rnd, metrics, params, note)
                if self.verbose:
                    shown = ", ".join(
                        f"{r['metric']} {_fmt(r['value'])} {r['unit']}".rstrip()
                        for r in self.rows[len(self.rows) - len(metrics) :]
                    )
                    print(
                        f"{self.name} round {rnd}/{rounds} {arm}: {shown} {note}".rstrip(),
                        flush=True,
                        file=sys.stderr if str(self.out) == "-" else sys.stdout,
                    )  # stdout may be the CSV
                if self.out is not None and str(self.out) != "-":
                    self.write()

    def summary(self) -> list[dict]:
        return summarize(self.rows, self.baseline)

    def write(self, out: str | Path | None = None) -> list[dict]:
        """Both CSVs (the summary only where `out` is a file); returns the summary."""
        out = out if out is not None else self.out
        summary = self.summary()
        write_csv(out, self.rows, FIELDS)
        if str(out) != "-":
            write_csv(summary_path(out), summary, SUMMARY_FIELDS)
        return summary
