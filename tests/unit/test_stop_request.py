"""Stop signals: recorded by the handler, agreed across ranks, a second one stops at once."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from megatron_sdpo.stop_request import StopRequest


def test_a_signal_is_recorded_not_acted_on():
    before = signal.getsignal(signal.SIGUSR1)
    req = StopRequest().install()
    try:
        assert req.agreed() == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert req.agreed() == signal.SIGUSR1
    finally:
        req.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_second_signal_stops_the_process_at_once(tmp_path):
    """A repeat of the first signal at once is the same request delivered twice (the scheduler and
    a forwarding parent) and is absorbed; a signal after DUPLICATE_S, or another signal, insists."""
    code = textwrap.dedent(
        """
        import os, signal, sys, time
        from megatron_sdpo.stop_request import DUPLICATE_S, StopRequest
        req = StopRequest().install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert req.agreed() == signal.SIGTERM
        print("first recorded", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        print("duplicate absorbed", flush=True)
        if sys.argv[1] == "other":
            os.kill(os.getpid(), signal.SIGUSR1)
        else:
            time.sleep(DUPLICATE_S + 0.5)
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("not reached", flush=True)
        """
    )
    for how, sig in (("later", signal.SIGTERM), ("other", signal.SIGUSR1)):
        proc = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=60)
        assert proc.returncode == -sig, (how, proc.returncode, proc.stderr[-2000:])
        assert "duplicate absorbed" in proc.stdout and "not reached" not in proc.stdout, how


def _agree_worker() -> int:
    import torch.distributed as dist

    req = StopRequest()
    if dist.get_rank() == 1:
        req._handle(signal.SIGUSR1, None)  # as if the signal reached this rank only
    return req.agreed()


@pytest.mark.distributed
def test_one_rank_signalled_stops_every_rank():
    from megatron_sdpo.backends.megatron.launch import spawn

    assert spawn(_agree_worker, 2, timeout_s=60) == [signal.SIGUSR1, signal.SIGUSR1]


def test_the_window_finishes_a_step_that_fits_and_abandons_one_that_does_not():
    from megatron_sdpo.stop_request import StopWindow

    assert not StopWindow.from_env({}).active
    assert not StopWindow(None).abandon(1e9, ("train",))  # no lead known: a step always finishes
    w = StopWindow.from_env({"SDPO_STOP_LEAD_S": "100", "SDPO_STOP_RESERVE_S": "40"})
    assert w.active and w.lead_s == 100 and w.reserve_s == 40
    assert w.abandon(0.0, ("train", "sync"))  # nothing measured yet: the boundary is the safe checkpoint
    assert (
        w.observe_step(
            {
                "time/rollout": 10.0,
                "time/teacher": 5.0,
                "time/train": 30.0,
                "time/sync": 4.0,
                "time/step": 50.0,
                "loss": 1.0,
            }
        )
        is None
    )
    # since + the rest of the step + the reserve against the lead: 20 + 34 + 40 = 94 <= 100.
    assert not w.abandon(20.0, ("train", "sync"))
    assert w.abandon(27.0, ("train", "sync"))  # 101
    assert not w.abandon(20.0, ("teacher", "train", "sync"))  # 20 + 39 + 40 = 99
    assert w.abandon(22.0, ("teacher", "train", "sync"))  # 101
    # A save measured longer than planned raises the reserve (its time plus the minimum margin).
    w.observe_save(25.0)
    assert w.reserve() == 25.0 + 30.0 and w.abandon(20.0, ("train", "sync"))  # 20 + 34 + 55
    # A step that no longer fits the lead with its reserve is said once.
    late = w.observe_step({"time/step": 60.0})
    assert late is not None and "a step took 60 s" in late and w.observe_step({"time/step": 70.0}) is None
    from megatron_sdpo.errors import UserError

    with pytest.raises(UserError, match="SDPO_STOP_LEAD_S='x'"):
        StopWindow.from_env({"SDPO_STOP_LEAD_S": "x"})


def test_agreed_with_a_vote_on_one_process():
    req = StopRequest()
    assert req.agreed_with(True) == (0, True) and req.since_signal_s() == 0.0
    req.received, req._received_at = signal.SIGUSR1, 0.0
    assert req.agreed_with(False) == (signal.SIGUSR1, False)
