"""A request from the scheduler to stop: SIGTERM (preemption, scancel, torchrun's shutdown) or
SIGUSR1 (the time limit is near), honoured at the next step boundary or between two sets of an
evaluation row.

The handler only records the signal; the loop asks `StopRequest.agreed()` once per step, which
all-reduces the flag so that every rank stops after the same step (one rank seeing the signal
first must not leave the others in a collective). The run then saves a checkpoint at that step
and exits; `--resume` continues from it. A second signal while the first is pending stops the
process at once with the signal's default action (an operator who insists), unless it is the same
signal within DUPLICATE_S of the first: one request delivered twice, by the scheduler to every
process and again by a parent that passes it on (torchrun, `study`).
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DUPLICATE_S = 2.0


class StopRequested(Exception):
    """Raised by the loop after the checkpoint of the step a stop was agreed on is written."""

    def __init__(self, signum: int, checkpoint: str | None):
        self.signum, self.checkpoint = signum, checkpoint
        done = f"checkpoint {checkpoint} written" if checkpoint else "nothing to save yet (stopped in the base evaluation)"
        super().__init__(f"stopped by {signal.Signals(signum).name}; {done}, --resume continues")


class StopRequest:
    """Installs handlers for `SIGNALS` (main thread only) and answers whether to stop now."""

    def __init__(self) -> None:
        self.received = 0  # signal number, 0: none
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}  # what signal.signal returned: a handler, SIG_DFL, None

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received:
            if signum == self.received and time.monotonic() - self._received_at < DUPLICATE_S:
                return
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.received, self._received_at = signum, time.monotonic()

    def agreed(self) -> int:
        """The signal any rank received (0: none); a collective over the world when launched."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.received
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([self.received], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
