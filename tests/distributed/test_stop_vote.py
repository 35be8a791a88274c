"""A stop agreed across ranks: the signal any rank received and whether any rank votes to abandon
the step come back the same on every rank, from one collective (stop_request.StopRequest)."""

import pytest

pytestmark = pytest.mark.distributed


def _rank_votes():
    import signal

    import torch.distributed as dist

    from megatron_sdpo.stop_request import StopRequest

    rank = dist.get_rank()
    req = StopRequest()
    out = [req.agreed_with(False)]  # nobody received a signal
    if rank == 1:  # only rank 1 saw the scheduler's signal, and only it finds the step too long
        req.received, req._received_at = signal.SIGUSR1, 0.0
    out.append(req.agreed_with(rank == 1))
    out.append(req.agreed_with(False))  # the signal is still agreed; nobody votes to abandon
    out.append((req.agreed(), False))
    return out


def test_every_rank_takes_the_same_decision():
    import signal

    from megatron_sdpo.backends.megatron.launch import spawn

    r0, r1 = spawn(_rank_votes, 2, timeout_s=300)
    assert r0 == r1 == [(0, False), (signal.SIGUSR1, True), (signal.SIGUSR1, False), (signal.SIGUSR1, False)]
