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
