import time

import pytest

from megatron_sdpo.stopwatch import PHASES, PhaseTimes, Stopwatch


def test_stopwatch_accumulates_and_take_resets():
    clock = Stopwatch("cpu")
    for _ in range(2):
        with clock.measure():
            time.sleep(0.01)
    first = clock.take()
    assert first >= 0.02  # sleep never returns early
    assert clock.take() == 0.0


def test_phase_times_are_disjoint_parts_of_the_step():
    times = PhaseTimes()
    with times.phase("rollout"):
        time.sleep(0.01)
    with times.phase("train"):
        time.sleep(0.02)
    times.move(0.005, source="train", target="teacher")
    m = times.metrics()
    assert set(m) == {f"time/{p}" for p in PHASES} | {"time/other", "time/step"}
    assert all(v >= 0.0 for v in m.values())
    assert m["time/teacher"] == pytest.approx(0.005)
    assert m["time/train"] >= 0.015 and m["time/rollout"] >= 0.01
    parts = sum(m[f"time/{p}"] for p in PHASES) + m["time/other"]
    assert parts == pytest.approx(m["time/step"], rel=1e-9)


class FakeClock:
    """time.perf_counter under the test's control."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_run_clock_counts_an_inner_phase_once_and_adds_up(monkeypatch):
    from megatron_sdpo import stopwatch

    t = FakeClock()
    monkeypatch.setattr(stopwatch.time, "perf_counter", t)
    clock = stopwatch.RunClock(started=90.0)
    clock.add("start/imports", 10.0)
    with clock.phase("eval/row"):
        t.now += 1.0
        with clock.phase("eval/math/id"):
            t.now += 3.0
        with clock.phase("eval/code/id"):
            t.now += 2.0
        t.now += 0.5
    with clock.phase("eval/math/id"):  # a later row: the split accumulates
        t.now += 4.0
    t.now += 0.25  # covered by no phase
    b = clock.breakdown()
    assert b["phases"] == {"eval/math/id": 7.0, "start/imports": 10.0, "eval/code/id": 2.0, "eval/row": 1.5}
    assert b["phases"]["eval/row"] == 1.5 and b["phases"]["eval/math/id"] == 7.0
    assert list(b["phases"]) == ["start/imports", "eval/math/id", "eval/code/id", "eval/row"]  # largest first
    assert b["other_s"] == 0.25 and b["wall_s"] == 20.75
    assert sum(b["phases"].values()) + b["other_s"] == b["wall_s"]


def test_run_clock_keeps_a_phase_that_raised(monkeypatch):
    from megatron_sdpo import stopwatch

    t = FakeClock()
    monkeypatch.setattr(stopwatch.time, "perf_counter", t)
    clock = stopwatch.RunClock()
    with pytest.raises(RuntimeError), clock.phase("save/stage"):
        t.now += 2.0
        raise RuntimeError
    assert clock.breakdown()["phases"] == {"save/stage": 2.0}
