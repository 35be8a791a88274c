"""Stage-end drift diagnostics off the critical path: one detached process per stage.

The SVDs over two HF checkpoints and the sentence embedder take minutes at 7B on CPU. Run in
the loop on the main rank, they kept every other rank waiting in the next collective until the
process group's timeout failed the job. Here the collective part (probe log-probs, scored by
every rank) stays in the loop; the main rank writes it with the stage's inputs to
drift/pending/stage_<k>.pt and starts `python -m megatron_sdpo.outputs.drift_jobs FILE`, which writes
drift/stage_<k>.json (atomically) and its log drift/stage_<k>.log, then removes its input. The
run waits for its jobs only when it ends, before report.md is written.

A stop request ends the running jobs; `--resume` starts again those whose input is still
pending, without training or evaluating again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_sdpo.outputs.run_dir import RunDir

# A test's stand-in for a slow diagnostics job (seconds of sleep before the work): the job runs
# while the ranks go on with the next stage.
DELAY_ENV = "MEGATRON_SDPO_DRIFT_JOB_DELAY_S"


def default_threads() -> int:
    """The CPU threads of one job: this node's CPUs shared by its trainer processes, and no more
    than the trainer's own OMP_NUM_THREADS where one is set (a study running several runs side by
    side gives each run its share: a job taking the whole node beside them oversubscribes it,
    and OpenMP threads that spin for a busy core make the job several times slower)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    budget = os.environ.get("OMP_NUM_THREADS", "").strip()
    if budget.isdigit() and int(budget) > 0:
        share = min(share, int(budget))
    if not torch.cuda.is_available():
        # A CPU trainer keeps its own threads busy beside the job: the job takes what is left.
        share = max(1, share - torch.get_num_threads())
    return share


class DriftJobs:
    """The main rank's stage-end diagnostics processes of one run directory."""

    def __init__(self, run_dir: RunDir, *, threads: int | None = None, log=print):
        self.run_dir = run_dir
        self.threads = threads or default_threads()
        self.log = log
        self.running: dict[int, subprocess.Popen] = {}

    @property
    def pending_dir(self) -> Path:
        return self.run_dir.drift / "pending"

    def input_path(self, stage: int) -> Path:
        return self.pending_dir / f"stage_{stage}.pt"

    def submit(self, stage: int, inputs: dict) -> None:
        """Start the job of stage `stage` (1-based) on `inputs` (the keyword arguments of
        diagnostics.stage.stage_diagnostics, eval samples as run-directory labels)."""
        self.pending_dir.mkdir(parents=True, exist_ok=True)
        self._end(stage)  # a resumed run submits again a stage whose job resume_pending started
        path = self.input_path(stage)
        tmp = path.with_suffix(".tmp")
        torch.save(inputs, tmp)
        os.replace(tmp, path)  # a job never reads a half-written input
        self._start(stage)

    def resume_pending(self) -> None:
        """Start again the jobs a stopped run left with their input but without their record."""
        if not self.pending_dir.exists():
            return
        for path in sorted(self.pending_dir.glob("stage_*.pt")):
            stage = int(path.stem.split("_")[1])
            if stage not in self.running:
                self.log(f"drift diagnostics of stage {stage} were not finished; starting them again")
                self._start(stage)

    def _start(self, stage: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        # torchrun's rendezvous variables would make the job look like a rank of the launch.
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        log = open(self.run_dir.drift / f"stage_{stage}.log", "w")
        with log:
            self.running[stage] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "megatron_sdpo.outputs.drift_jobs",
                    str(self.input_path(stage)),
                    str(os.getpid()),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                # Its own session: a signal to the launch's process group reaches the ranks,
                # which end their jobs themselves (stop()), not the job half-way through a write.
                start_new_session=True,
            )

    def wait(self, interrupt: Callable[[], bool] = lambda: False, poll_s: float = 0.5) -> list[int]:
        """Wait for every job; the stages whose job failed (their log says why). `interrupt` is
        asked every `poll_s` seconds: when it says yes the running jobs are ended as by stop()
        (their inputs stay for --resume), so a stop request is not held up by minutes of
        drift work, nor leaves a job behind to race the resumed run."""
        while any(proc.poll() is None for proc in self.running.values()):
            if interrupt():
                self.stop()
                return []
            time.sleep(poll_s)
        failed = []
        for stage, proc in sorted(self.running.items()):
            if proc.wait() != 0:
                failed.append(stage)
                self.log(
                    f"drift diagnostics of stage {stage} failed (exit {proc.returncode}): "
                    f"{self.run_dir.drift / f'stage_{stage}.log'}; report.md has no drift row for it"
                )
        self.running.clear()
        try:
            self.pending_dir.rmdir()  # only when empty: a failed job's input stays beside its log
        except OSError:
            pass
        return failed

    def stop(self) -> None:
        """End the running jobs (a stopped run); their inputs stay for --resume."""
        for stage in list(self.running):
            self._end(stage)

    def _end(self, stage: int, grace_s: float = 5.0) -> None:
        proc = self.running.pop(stage, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_job(path: Path) -> Path:
    """Compute one stage's drift record from its input file; returns the record's path."""
    from megatron_sdpo.diagnostics.stage import stage_diagnostics
    from megatron_sdpo.outputs import report

    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    inputs = torch.load(path, weights_only=False)
    rd = RunDir(path.parents[2])
    embedder = None
    if inputs.pop("response_drift"):
        from megatron_sdpo.diagnostics.response_drift import MiniLMEmbedder

        embedder = MiniLMEmbedder()
    ood = inputs.pop("ood_prompts", None)
    if ood is not None and embedder is not None:
        from megatron_sdpo.diagnostics.ood_distance import write_distance_table

        write_distance_table(rd.root, ood["train"], ood["eval"], embedder, n=ood["n"], seed=inputs["seed"])
    base_samples = report.read_eval_samples(rd, inputs.pop("base_label"))
    cur_samples = report.read_eval_samples(rd, inputs.pop("cur_label"))
    record = stage_diagnostics(
        inputs.pop("stage"),
        inputs.pop("domain"),
        inputs.pop("algorithm"),
        inputs.pop("policies"),
        base_samples,
        cur_samples,
        inputs.pop("probes"),
        embedder=embedder,
        **inputs,
    )
    out = report.write_stage_drift(rd, record)
    path.unlink(missing_ok=True)
    return out


def end_with_parent(parent: int) -> None:
    """Linux: SIGTERM this job when the run that started it dies, however it dies (a SIGKILL
    leaves no time for stop()); a job outliving its run would race the resumed run's own job
    for the same stage. Exits at once if the run is already gone. (Linux ties the signal to the
    thread that started the job: the run's main thread drives DriftJobs.)"""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(f"the run that started this job (pid {parent}) has ended; --resume starts the job again")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m megatron_sdpo.outputs.drift_jobs RUN_DIR/drift/pending/stage_<k>.pt [PARENT_PID]")
    if len(sys.argv) == 3:
        end_with_parent(int(sys.argv[2]))
    print(f"wrote {run_job(Path(sys.argv[1]))}", flush=True)
