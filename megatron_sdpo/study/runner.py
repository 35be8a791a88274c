"""Running a study's runs: one `megatron-sdpo run` subprocess per (arm, seed), up to `jobs` at a
time, torch threads split between them; finished runs are skipped and unfinished ones resumed,
so a killed study continues where it stopped when invoked again.

A run is finished when its report.md exists (written last, after the eval matrix and the
drift of the last stage); a run directory that holds a resolved_config.yaml but no report is
continued with `run --resume` (its last checkpoint: the run-level resume machinery).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from megatron_sdpo.errors import Stopped
from megatron_sdpo.outputs.run_dir import RunDir
from megatron_sdpo.stop_request import StopRequest


@dataclass(frozen=True)
class RunSpec:
    arm: str
    seed: int | None  # None: the config's own seed (compare)
    ref: str  # preset name or YAML path
    overrides: tuple[str, ...]
    out: Path

    @property
    def label(self) -> str:
        return self.arm if self.seed is None else f"{self.arm}/seed{self.seed}"

    @property
    def finished(self) -> bool:
        return RunDir(self.out).report.exists()

    @property
    def started(self) -> bool:
        return RunDir(self.out).config.exists()

    def command(self, *, quiet: bool, verbose: bool) -> list[str]:
        cmd = [sys.executable, "-m", "megatron_sdpo", "run", self.ref, *self.overrides, "--out", str(self.out)]
        cmd += ["--resume"] if self.started else []
        cmd += ["--quiet"] if quiet else []
        cmd += ["--verbose"] if verbose else []
        return cmd


def parse_seeds(text: str) -> list[int]:
    """`0-5`, `0,2,4`, `3` or a mix (`0-2,7`) -> sorted distinct seeds."""
    from megatron_sdpo.errors import UserError

    seeds: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            a, b = (int(lo), int(hi)) if dash else (int(part), int(part))
        except ValueError:
            raise UserError(f"--seeds {text!r}: expected seeds like 0-5 or 0,2,4") from None
        if a < 0 or b < a:
            raise UserError(f"--seeds {text!r}: {part!r} is not a range of non-negative seeds")
        seeds.update(range(a, b + 1))
    if not seeds:
        raise UserError(f"--seeds {text!r}: no seed given")
    return sorted(seeds)


def threads_per_job(jobs: int, total: int | None = None) -> int:
    """CPU threads for each of `jobs` concurrent runs: `total` (default the machine's CPUs) split
    evenly, >= 1."""
    if total is None:
        total = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, int(total) // max(jobs, 1))


@dataclass
class _Running:
    spec: RunSpec
    proc: subprocess.Popen
    log: IO[str] | None
    started: float


class StudyRunner:
    """Runs the specs not yet finished; returns the failed ones as (spec, exit code, log path).

    With jobs == 1 and `log_dir` None the run's output goes to this terminal (as `compare`
    always did); otherwise each run writes `log_dir/<arm>-seed<k>.log` (appended on resume).
    Wall seconds per invocation are appended to `timings` (JSON lines) when given.
    """

    def __init__(
        self,
        specs: list[RunSpec],
        *,
        jobs: int = 1,
        threads: int | None = None,
        log_dir: Path | None = None,
        timings: Path | None = None,
        quiet: bool = False,
        verbose: bool = False,
        say: Callable[[str], None] = lambda s: print(s, flush=True),
    ):
        self.specs, self.jobs, self.log_dir, self.timings = specs, max(1, jobs), log_dir, timings
        self.threads = threads_per_job(self.jobs, threads)  # `threads`: the study's whole budget (--threads)
        self.quiet, self.verbose, self.say = quiet, verbose, say

    def _start(self, spec: RunSpec) -> _Running:
        cmd = spec.command(quiet=self.quiet or self.log_dir is not None, verbose=self.verbose)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        log = None
        where = ""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            path = self.log_dir / f"{spec.label.replace('/', '-')}.log"
            log = path.open("a")
            where = f" (log {path})"
        verb = "resuming" if spec.started else "starting"
        self.say(f"[study] {spec.label}: {verb}, {self.threads} thread(s){where}: {' '.join(cmd[2:])}")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None)
        return _Running(spec, proc, log, time.perf_counter())

    def _finish(self, r: _Running, rc: int, failed: list) -> None:
        seconds = time.perf_counter() - r.started
        if r.log:
            r.log.close()
        if self.timings is not None:
            with self.timings.open("a") as f:
                f.write(json.dumps({"run": r.spec.label, "seconds": round(seconds, 1), "exit": rc}) + "\n")
        if rc == 0:
            self.say(f"[study] {r.spec.label}: finished in {seconds:.0f} s")
        else:
            log = self.log_dir / f"{r.spec.label.replace('/', '-')}.log" if self.log_dir else None
            self.say(f"[study] {r.spec.label}: failed (exit {rc}) after {seconds:.0f} s")
            failed.append((r.spec, rc, log))

    def run(self) -> list[tuple[RunSpec, int, Path | None]]:
        pending = []
        for spec in self.specs:
            if spec.finished:
                self.say(f"[study] {spec.label}: already finished in {spec.out}")
            else:
                pending.append(spec)
        running: list[_Running] = []
        failed: list[tuple[RunSpec, int, Path | None]] = []
        # SIGTERM or SIGUSR1 to the study alone (`kill`, a supervisor) is recorded and acted on
        # in the loop, which passes the stop on to the runs (each saves its step) instead of
        # leaving them running orphaned, to race the next invocation for their directories.
        stop = StopRequest().install()
        try:
            try:
                self._loop(pending, running, failed, stop)
            finally:
                self._stop(running)
        finally:
            stop.uninstall()
        return failed

    def _loop(self, pending: list[RunSpec], running: list[_Running], failed: list, stop: StopRequest) -> None:
        while pending or running:
            if stop.received:
                raise Stopped(
                    stop.received,
                    f"study stopped by {signal.Signals(stop.received).name}: the runs "
                    "still going were asked to save and stop; the same command again resumes them",
                )
            while pending and len(running) < self.jobs:
                running.append(self._start(pending.pop(0)))
            time.sleep(0.2)
            for r in list(running):
                rc = r.proc.poll()
                if rc is not None:
                    running.remove(r)
                    self._finish(r, rc, failed)

    @staticmethod
    def _stop(running: list[_Running]) -> None:
        """On an interrupt: ask every run still going to save and stop (SIGTERM: the run saves
        its last step, stop_request.py), then kill what has not stopped after a minute."""
        for r in running:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 60
        for r in running:
            try:
                r.proc.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
            if r.log:
                r.log.close()


def read_timings(path: Path) -> dict[str, float]:
    """Wall seconds per run label, summed over its invocations (a resumed run has several)."""
    out: dict[str, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[rec["run"]] = out.get(rec["run"], 0.0) + float(rec["seconds"])
    return out
