"""Wall-clock phase timing: the RL step's phases (the `time/*` metrics) and a whole run's
(`RunClock`, the run's timings.json).

On a GPU, kernels run asynchronously: a host timer around a launch measures the launch, not the
work. A stopwatch on a CUDA device therefore synchronizes that device when it starts and stops
(a handful of syncs per step, never inside a hot loop); on the CPU it only reads the clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch

# The disjoint phases of one RL step, in order; `time/step` is the whole step and
# `time/other` what none of them covers (batch assembly, the refit guard, bookkeeping).
PHASES = ("rollout", "reward", "teacher", "train", "sync")


def synchronize(device: torch.device | str | None) -> None:
    """Waits for queued work on `device` when it is a CUDA device; nothing otherwise."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Accumulates seconds over `measure()` blocks; `take()` returns and resets the total."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.seconds = 0.0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.seconds += time.perf_counter() - start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class PhaseTimes:
    """One step's phase clocks: `with times.phase("rollout"): ...`, then `metrics()`."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.clocks = {name: Stopwatch(device) for name in PHASES}
        synchronize(device)
        self._start = time.perf_counter()

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return self.clocks[name].measure()

    def move(self, seconds: float, *, source: str, target: str) -> None:
        """Reassigns `seconds` measured inside `source` to `target` (a backend reports the time
        its train step spent in the teacher's forward)."""
        self.clocks[source].seconds -= seconds
        self.clocks[target].seconds += seconds

    def metrics(self) -> dict[str, float]:
        """{"time/<phase>": seconds, "time/other", "time/step"}: the phases are disjoint parts
        of the step, so each is >= 0 and together they add up to `time/step`."""
        synchronize(self.device)
        total = time.perf_counter() - self._start
        out = {f"time/{name}": clock.seconds for name, clock in self.clocks.items()}
        out["time/other"] = max(0.0, total - sum(out.values()))
        out["time/step"] = total
        return out


@dataclasses.dataclass
class _Open:
    start: float  # when the phase began
    inner: float = 0.0  # seconds of the phases inside it


class RunClock:
    """A run's wall time by phase, outside the steps and the steps themselves (`timings.json`):
    `with clock.phase("save/stage"): ...`. A phase inside another counts once, in the inner one
    (the outer keeps only what the inner did not cover); `breakdown()` adds `other`, what no phase
    covered, so the phases add up to the run's wall time."""

    def __init__(self, device: torch.device | str | None = None, *, started: float | None = None) -> None:
        self.device = device
        self.started = time.perf_counter() if started is None else started
        self.seconds: dict[str, float] = {}
        self._open: list[_Open] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        synchronize(self.device)
        frame = _Open(time.perf_counter())
        self._open.append(frame)
        try:
            yield
        finally:
            synchronize(self.device)
            self._open.pop()
            elapsed = time.perf_counter() - frame.start
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - frame.inner
            if self._open:
                self._open[-1].inner += elapsed

    def add(self, name: str, seconds: float) -> None:
        """Time measured elsewhere (the imports before the run started)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def breakdown(self) -> dict:
        """{"wall_s", "phases": {name: s} largest first, "other_s"}: the phases and `other_s` add
        up to `wall_s` (from the clock's start, which `started` may set before the run began)."""
        wall = time.perf_counter() - self.started
        phases = dict(sorted(self.seconds.items(), key=lambda kv: -kv[1]))
        return {"wall_s": wall, "phases": phases, "other_s": max(0.0, wall - sum(phases.values()))}
