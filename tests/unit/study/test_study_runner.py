"""The study's scheduler with a stand-in for `megatron-sdpo run`: concurrency, skip, resume, failure."""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_sdpo.errors import Stopped, UserError
from megatron_sdpo.study.runner import RunSpec, StudyRunner, parse_seeds, read_timings, threads_per_job

FAKE_RUN = r"""
import json, os, sys, time
out, resume = sys.argv[1], sys.argv[2] == "1"
os.makedirs(out, exist_ok=True)
start = time.time()
time.sleep(0.4)
with open(os.path.join(os.path.dirname(out), "events.jsonl"), "a") as f:
    f.write(json.dumps({"out": out, "start": start, "end": time.time(), "resume": resume,
                        "threads": os.environ["OMP_NUM_THREADS"]}) + "\n")
open(os.path.join(out, "resolved_config.yaml"), "w").write("seed: 0\n")
if "fail" in out:
    sys.exit(3)
open(os.path.join(out, "report.md"), "w").write("done\n")
"""


@pytest.fixture
def fake_run(monkeypatch):
    def command(self, *, quiet, verbose):
        return [sys.executable, "-c", FAKE_RUN, str(self.out), "1" if self.started else "0"]

    monkeypatch.setattr(RunSpec, "command", command)


def _spec(root: Path, name: str, seed: int = 0) -> RunSpec:
    return RunSpec(name, seed, "tiny", (), root / name)


def test_runs_at_most_jobs_at_a_time_and_skips_finished_ones(tmp_path, fake_run):
    done = _spec(tmp_path, "done")
    done.out.mkdir()
    (done.out / "report.md").write_text("x")
    specs = [done, *(_spec(tmp_path, f"r{i}") for i in range(5))]
    said = []
    failed = StudyRunner(
        specs, jobs=2, threads=4, log_dir=tmp_path / "logs", timings=tmp_path / "t.jsonl", say=said.append
    ).run()
    assert failed == []
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert sorted(Path(e["out"]).name for e in events) == [f"r{i}" for i in range(5)]  # not "done"
    assert {e["threads"] for e in events} == {"2"}  # --threads 4 split between 2 jobs, as its help says
    # At no moment more than two runs: every start falls inside at most one other run's span.
    for e in events:
        assert sum(1 for o in events if o is not e and o["start"] <= e["start"] < o["end"]) <= 1
    assert any("done/seed0: already finished" in s for s in said)
    assert set(read_timings(tmp_path / "t.jsonl")) == {f"r{i}/seed0" for i in range(5)}
    assert (tmp_path / "logs" / "r0-seed0.log").exists()


def test_a_started_run_is_resumed_and_a_failure_reported_after_the_rest(tmp_path, fake_run):
    started = _spec(tmp_path, "half")
    started.out.mkdir()
    (started.out / "resolved_config.yaml").write_text("seed: 0\n")
    specs = [_spec(tmp_path, "fail"), started, _spec(tmp_path, "fresh")]
    failed = StudyRunner(specs, jobs=1, threads=1, log_dir=tmp_path / "logs", say=lambda s: None).run()
    assert [(s.arm, rc) for s, rc, _ in failed] == [("fail", 3)]
    events = {Path(e["out"]).name: e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())}
    assert (events["half"]["resume"], events["fresh"]["resume"]) == (True, False)
    assert (tmp_path / "half" / "report.md").exists() and (tmp_path / "fresh" / "report.md").exists()


def test_run_command_resumes_a_started_run(tmp_path):
    spec = RunSpec("grpo", 2, "tiny", ("algorithm.name=grpo", "seed=2"), tmp_path / "r")
    cmd = spec.command(quiet=True, verbose=False)
    assert cmd[1:] == [
        "-m",
        "megatron_sdpo",
        "run",
        "tiny",
        "algorithm.name=grpo",
        "seed=2",
        "--out",
        str(spec.out),
        "--quiet",
    ]
    spec.out.mkdir()
    (spec.out / "resolved_config.yaml").write_text("")
    assert "--resume" in spec.command(quiet=False, verbose=False)
    assert spec.label == "grpo/seed2"


def test_parse_seeds():
    assert parse_seeds("0-5") == [0, 1, 2, 3, 4, 5]
    assert parse_seeds("4,0-2, 2") == [0, 1, 2, 4]
    for bad in ("a", "3-1", "", "-1", "1-"):
        with pytest.raises(UserError, match="--seeds"):
            parse_seeds(bad)


def test_threads_are_split_between_jobs():
    assert threads_per_job(2, total=16) == 8
    assert threads_per_job(3, total=16) == 5
    assert threads_per_job(4, total=2) == 1


STOPPABLE_RUN = r"""
import os, signal, sys, time
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
def stop(signum, frame):
    open(os.path.join(out, "stopped"), "w").write(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(out, "started"), "w").write(str(os.getpid()))
time.sleep(60)
"""


def test_sigterm_to_the_study_alone_stops_its_runs_and_raises_stopped(tmp_path, monkeypatch):
    """`kill STUDY_PID` (not the process group): the runs are asked to stop, not left orphaned."""
    monkeypatch.setattr(
        RunSpec, "command", lambda self, *, quiet, verbose: [sys.executable, "-c", STOPPABLE_RUN, str(self.out)]
    )
    specs = [_spec(tmp_path, f"r{i}") for i in range(3)]
    before = signal.getsignal(signal.SIGTERM)

    def signal_once_both_run():
        deadline = time.time() + 60
        while not all((s.out / "started").exists() for s in specs[:2]) and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_once_both_run, daemon=True).start()
    with pytest.raises(Stopped, match="SIGTERM") as info:
        StudyRunner(specs, jobs=2, threads=1, say=lambda s: None).run()
    assert info.value.signum == signal.SIGTERM
    for s in specs[:2]:
        assert (s.out / "stopped").read_text() == str(int(signal.SIGTERM))
        with pytest.raises(ProcessLookupError):  # stopped and reaped
            os.kill(int((s.out / "started").read_text()), 0)
    assert not specs[2].out.exists()  # the third run never started
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_study_schedules_seed_by_seed_and_tabulates_arm_by_arm(tmp_path, monkeypatch):
    # A study stopped early must hold whole seeds (every arm of a seed), so its pairs are usable.
    from megatron_sdpo.study import driver
    from megatron_sdpo.study.arms import BUILTIN_ARMS

    scheduled, tabulated = [], []

    class Recorder:
        def __init__(self, specs, **kwargs):
            scheduled.extend((s.arm, s.seed) for s in specs)

        def run(self):
            return []

    monkeypatch.setattr(driver, "StudyRunner", Recorder)
    monkeypatch.setattr(
        driver.Study,
        "tabulate",
        lambda self, specs, baseline, timings: tabulated.extend((s.arm, s.seed) for s in specs),
    )
    arms = [BUILTIN_ARMS["grpo"], BUILTIN_ARMS["sdpo_frozen"]]
    driver.Study("tiny", arms, [3, 1], tmp_path / "study").run()
    assert scheduled == [("grpo", 3), ("sdpo_frozen", 3), ("grpo", 1), ("sdpo_frozen", 1)]
    assert tabulated == [("grpo", 3), ("grpo", 1), ("sdpo_frozen", 3), ("sdpo_frozen", 1)]
