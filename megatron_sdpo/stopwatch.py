"""Wall-clock phase timing for the RL step (the `time/*` metrics).

On a GPU, kernels run asynchronously: a host timer around a launch measures the launch, not the
work. A stopwatch on a CUDA device therefore synchronizes that device when it starts and stops
(a handful of syncs per step, never inside a hot loop); on the CPU it only reads the clock.
"""

from __future__ import annotations

import contextlib
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
