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
