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

Under a job whose time-limit signal comes a known lead before the kill (SDPO_STOP_LEAD_S, set by
the sbatch body from the preflight: planning/stop_grace.py), a stop agreed in the middle of a step
may abandon the step instead (`StopWindow`): before the step's first optimizer step the weights,
the teacher and the data position are still the last completed step's, so that step's checkpoint
is written at once and a resumed run redoes the abandoned step exactly (its prompts and samples
follow from its position).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_sdpo.errors import UserError

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DUPLICATE_S = 2.0
LEAD_ENV = "SDPO_STOP_LEAD_S"  # seconds from the stop signal to the kill (the sbatch --signal lead)
RESERVE_ENV = "SDPO_STOP_RESERVE_S"  # of those, what the save, refit and margin need after the step
MARGIN_MIN_S = 30.0  # the least margin a stop keeps beyond its save
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def serve_parent(parent: int) -> None:
    """Called first in a helper process of a rank (a queue, a verifier): the stop signals are the
    rank's to act on (a scheduler signals every process of a job, and a helper killed by that
    signal fails the save or the step the signal asks to finish), and the helper dies with the
    rank, however the rank dies (a SIGKILLed rank runs no clean-up, and a helper reparented to
    init escapes the scheduler's process tracking). Linux ties the death signal to the thread that
    started the helper: start helpers from a thread that lives as long as the rank (its main one).
    Exits at once when `parent` has already ended."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


class StepAbandoned(Exception):
    """Raised inside a step when the ranks agreed to stop and the step cannot finish in time."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"step abandoned: {signal.Signals(signum).name}")


class StopRequested(Exception):
    """Raised by the loop after the checkpoint of the step a stop was agreed on is written."""

    def __init__(self, signum: int, checkpoint: str | None):
        self.signum, self.checkpoint = signum, checkpoint
        done = (
            f"checkpoint {checkpoint} written" if checkpoint else "nothing to save yet (stopped in the base evaluation)"
        )
        super().__init__(f"stopped by {signal.Signals(signum).name}; {done}, --resume continues")


class StopRequest:
    """Installs handlers for `SIGNALS` (main thread only) and answers whether to stop now."""

    def __init__(self) -> None:
        self.received = 0  # signal number, 0: none
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}  # what signal.signal returned: a handler, SIG_DFL, None

    def install(self) -> StopRequest:
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

    def since_signal_s(self) -> float:
        """Seconds since this rank received the stop signal (0 without one)."""
        return time.monotonic() - self._received_at if self.received else 0.0

    def agreed(self) -> int:
        """The signal any rank received (0: none); a collective over the world when launched."""
        return self.agreed_with(False)[0]

    def agreed_with(self, vote: bool) -> tuple[int, bool]:
        """(the signal any rank received, whether any rank voted yes): one collective over the
        world when launched, so that every rank takes the same decision from its own clock."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.received, vote
        device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
        flag = torch.tensor([self.received, int(vote)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        received, voted = flag.tolist()
        return int(received), bool(voted)


class StopWindow:
    """Whether a step the ranks agreed to stop in can still finish: the time since the signal,
    plus the rest of the step as the last completed step took it, plus the reserve for the save
    (the planned one, or the last measured save with its margin when longer), must stay within
    the lead. Without a lead (no Slurm time limit known) a step always finishes; without a
    measured step yet, a step with a stop pending is abandoned (its checkpoint is the safe one)."""

    def __init__(self, lead_s: float | None, reserve_s: float = 0.0):
        self.lead_s, self.reserve_s = lead_s, reserve_s
        self.last_phases: dict[str, float] | None = None
        self.last_save_s = 0.0
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> StopWindow:
        def number(key: str) -> float | None:
            value = env.get(key)
            if not value:
                return None
            try:
                return float(value)
            except ValueError:
                raise UserError(f"{key}={value!r} is not a number of seconds") from None

        return cls(number(LEAD_ENV), number(RESERVE_ENV) or 0.0)

    @property
    def active(self) -> bool:
        return self.lead_s is not None

    def reserve(self) -> float:
        return max(self.reserve_s, self.last_save_s + MARGIN_MIN_S if self.last_save_s else 0.0)

    def observe_step(self, metrics: Mapping[str, float]) -> str | None:
        """Record a completed step's phase times; a line (once) when the step and the reserve
        no longer fit the lead: a stop will then fall back to the last completed step."""
        self.last_phases = {k[len("time/") :]: float(v) for k, v in metrics.items() if k.startswith("time/")}
        step = self.last_phases.get("step", 0.0)
        if self.lead_s is None or self._warned or step + self.reserve() <= self.lead_s:
            return None
        self._warned = True
        return (
            f"a step took {step:.0f} s; with the {self.reserve():.0f} s a save needs it does not fit the "
            f"{self.lead_s:.0f} s between the stop signal and the kill: a stop will save the last completed "
            f"step instead (raise the sbatch --signal lead)"
        )

    def observe_save(self, seconds: float) -> None:
        self.last_save_s = max(self.last_save_s, seconds)

    def abandon(self, since_signal_s: float, phases_left: Sequence[str]) -> bool:
        if self.lead_s is None:
            return False
        if self.last_phases is None:
            return True
        rest = sum(self.last_phases.get(p, 0.0) for p in phases_left)
        return since_signal_s + rest + self.reserve() > self.lead_s
