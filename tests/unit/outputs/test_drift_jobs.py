"""The detached stage-end drift jobs: started with their input, ended on a stop with the input
kept, started again on resume, a failure named with its log."""

import time

import pytest
import torch

from megatron_sdpo.outputs.drift_jobs import DELAY_ENV, DriftJobs, default_threads
from megatron_sdpo.outputs.run_dir import RunDir


@pytest.fixture
def run_dir(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.prepare(resume=False)
    return rd


def test_stop_ends_a_running_job_and_keeps_its_input_for_resume(run_dir, monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "600")  # the job would sleep far past this test
    jobs = DriftJobs(run_dir, threads=1, log=lambda msg: None)
    jobs.submit(1, {"stage": 0})
    proc = jobs.running[1]
    assert proc.poll() is None
    started = time.monotonic()
    jobs.stop()
    assert proc.poll() is not None and time.monotonic() - started < 30
    assert jobs.input_path(1).is_file() and not jobs.running

    logged = []
    resumed = DriftJobs(run_dir, threads=1, log=logged.append)
    resumed.resume_pending()
    assert list(resumed.running) == [1] and "stage 1" in logged[0]
    resumed.submit(1, {"stage": 0})  # the loop submits the same stage again: one job, not two
    assert list(resumed.running) == [1] and resumed.running[1] is not proc
    resumed.stop()


def test_a_failed_job_is_named_with_its_log(run_dir, monkeypatch):
    monkeypatch.delenv(DELAY_ENV, raising=False)
    logged = []
    jobs = DriftJobs(run_dir, threads=1, log=logged.append)
    jobs.submit(2, {"stage": 1})  # no policies, no probes: the job fails
    assert jobs.wait() == [2]
    assert len(logged) == 1 and "stage 2 failed" in logged[0] and "stage_2.log" in logged[0]
    assert (run_dir.drift / "stage_2.log").read_text().strip()
    assert jobs.input_path(2).is_file()  # kept beside the log
    assert not (run_dir.drift / "stage_2.json").exists()


def test_default_threads_share_the_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = default_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(alone * 4))
    assert alone >= 1 and default_threads() == 1


def test_default_threads_stay_within_the_trainers_thread_budget(monkeypatch):
    # A study gives each of its runs OMP_NUM_THREADS = its share; the run's drift job keeps to it.
    import megatron_sdpo.outputs.drift_jobs as dj

    monkeypatch.setattr(dj.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the trainer's threads idle
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "16")  # more than the share: the share
    assert default_threads() == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "auto")  # not a count: ignored
    assert default_threads() == 4
    # A CPU trainer computes beside the job with its own threads: the job takes what is left.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert default_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads() == 5


def test_first_job_writes_the_run_ood_distance_table(run_dir, monkeypatch):
    import importlib
    import json

    import torch

    from megatron_sdpo.diagnostics import stage
    from megatron_sdpo.outputs import report
    from megatron_sdpo.outputs.drift_jobs import run_job

    # the module, not the function of the same name the package exports
    response_drift = importlib.import_module("megatron_sdpo.diagnostics.response_drift")

    class LengthEmbedder:
        def encode(self, texts):
            return torch.tensor([[float(len(t))] for t in texts])

    got = {}
    monkeypatch.setattr(response_drift, "MiniLMEmbedder", LengthEmbedder)
    monkeypatch.setattr(report, "read_eval_samples", lambda rd, label: {})
    monkeypatch.setattr(stage, "stage_diagnostics", lambda *a, **kw: got.update(kw) or {"stage": 1, "domain": "math"})
    jobs = DriftJobs(run_dir, threads=1, log=lambda msg: None)
    jobs.pending_dir.mkdir(parents=True)
    torch.save(
        {
            "stage": 0,
            "domain": "math",
            "algorithm": "sdpo",
            "policies": None,
            "base_label": "base",
            "cur_label": "stage_1_math",
            "probes": {},
            "svd_rank": 2,
            "seed": 0,
            "probe_n": 1,
            "response_drift": True,
            "principal_overlap": False,
            "ood_prompts": {"train": {"math": ["a", "bb"]}, "eval": {"code/ood_far": ["ccc"]}, "n": 8},
        },
        jobs.input_path(1),
    )
    run_job(jobs.input_path(1))
    table = json.loads((run_dir.root / "ood_distance.json").read_text())
    assert table["distances"]["math"]["code/ood_far"] > 0 and table["n"] == 8
    assert got["principal_overlap"] is False and "ood_prompts" not in got
    assert (run_dir.drift / "stage_1.json").is_file() and not jobs.input_path(1).exists()


def test_a_stop_while_the_run_waits_for_its_jobs_ends_them_and_stops_the_run(run_dir, monkeypatch):
    # The last stage's job can take minutes; a SIGTERM then must stop the run within a poll, end
    # the job and keep its input for --resume (not leave it running past the run's exit).
    import signal
    import threading

    from megatron_sdpo.config import load_config
    from megatron_sdpo.continual import ContinualRun
    from megatron_sdpo.stop_request import StopRequest, StopRequested
    from megatron_sdpo.stopwatch import RunClock

    monkeypatch.setenv(DELAY_ENV, "600")
    jobs = DriftJobs(run_dir, threads=1, log=lambda msg: None)
    jobs.submit(2, {"stage": 1})
    proc = jobs.running[2]
    run = ContinualRun.__new__(ContinualRun)
    run.clock = RunClock()
    run.main, run.drift_jobs, run.cfg, run.stop = True, jobs, load_config("tiny"), StopRequest()
    logged = []
    run.monitor = type("Monitor", (), {"log": lambda self, m: logged.append(m), "close": lambda self: None})()
    threading.Timer(1.0, lambda: setattr(run.stop, "received", signal.SIGTERM)).start()
    started = time.monotonic()
    with pytest.raises(StopRequested, match="checkpoint stage_4_code written"):
        run._finish(1.0)
    assert time.monotonic() - started < 30 and proc.poll() is not None
    assert jobs.input_path(2).is_file() and not jobs.running
    assert logged == ["stop requested (SIGTERM): checkpoint stage_4_code; resume with --resume"]


def test_a_job_ends_when_the_run_that_started_it_is_killed(run_dir, tmp_path):
    # SIGKILL leaves the run no time for stop(): the job must not outlive it.
    import os
    import signal
    import subprocess
    import sys

    path = run_dir.drift / "pending" / "stage_1.pt"
    path.parent.mkdir(parents=True)
    torch.save({"stage": 0}, path)
    starter = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'megatron_sdpo.outputs.drift_jobs', {str(path)!r}, "
        "str(os.getpid())],"
        f" env=dict(os.environ, {DELAY_ENV}='600'))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    job = int(parent.stdout.readline())
    time.sleep(2.0)  # past the job's start-up check
    os.kill(job, 0)  # still running, sleeping in its delay
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(job, 0)
        except ProcessLookupError:
            break
        # Reaped by init once it exits; a zombie still answers kill(0): read its state.
        try:
            with open(f"/proc/{job}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.2)
    else:
        os.kill(job, signal.SIGKILL)
        pytest.fail("the drift job outlived the run that started it")
    assert path.is_file()  # its input stays for --resume


def test_a_job_whose_run_is_already_gone_exits_at_once(run_dir):
    import subprocess
    import sys

    path = run_dir.drift / "pending" / "stage_1.pt"
    path.parent.mkdir(parents=True)
    torch.save({"stage": 0}, path)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_sdpo.outputs.drift_jobs", str(path), "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "has ended" in proc.stderr and path.is_file()
