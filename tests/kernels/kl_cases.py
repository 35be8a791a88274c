"""Shared test inputs and an independent plain-torch oracle (deliberately written differently
from ``kernels/megatron_sdpo_kernels/reference.py``: probabilities via softmax and explicit KL sums, no logaddexp)."""

from __future__ import annotations

import pytest
import torch

ODD = (37, 96, 1031)  # N, H, V: nothing is a multiple of a tile size


def make_inputs(n=ODD[0], h=ODD[1], v=ODD[2], dtype=torch.float32, seed=0, masked=True):
    g = torch.Generator().manual_seed(seed)
    # Scales give peaked but not one-hot distributions (logit std ~ 3).
    hs = torch.randn(n, h, generator=g)
    ht = hs + 0.5 * torch.randn(n, h, generator=g)
    ws = torch.randn(v, h, generator=g) * (3.0 / h**0.5)
    wt = ws + torch.randn(v, h, generator=g) * (1.0 / h**0.5)
    mask = torch.rand(n, generator=g) > 0.3 if masked else None
    go = torch.randn(n, generator=g) * 1.7 + 0.3  # grad_output != 1, mixed sign
    labels = torch.randint(0, v, (n,), generator=g)
    if mask is not None:
        labels[~mask] = -100
    cast = lambda t: t.to(dtype)
    return dict(hs=cast(hs), ht=cast(ht), ws=cast(ws), wt=cast(wt), mask=mask, go=go, labels=labels)


def oracle_kl(hs, ht, ws, wt, alpha, temperature, mask):
    """Per-token loss with the textbook definition; float64 for a tight oracle."""
    zs = hs.double() @ ws.double().t() / temperature
    zt = (ht.double() @ wt.double().t() / temperature).detach()
    p_s, p_t = torch.softmax(zs, -1), torch.softmax(zt, -1)
    if alpha == 0.0:
        out = (p_t * (p_t.log() - p_s.log())).sum(-1)
    elif alpha == 1.0:
        out = (p_s * (p_s.log() - p_t.log())).sum(-1)
    else:
        m = (1 - alpha) * p_s + alpha * p_t
        out = (1 - alpha) * (p_s * (p_s.log() - m.log())).sum(-1) + alpha * (p_t * (p_t.log() - m.log())).sum(-1)
    if mask is not None:
        out = out * mask.double()
    return out


def oracle_logprobs(h, w, labels, temperature, mask):
    z = h.double() @ w.double().t() / temperature
    p = torch.softmax(z, -1)
    safe = labels.clamp(min=0)
    lp = torch.log(p[torch.arange(len(labels)), safe])
    ent = -(p * p.log()).sum(-1)
    if mask is not None:
        lp, ent = lp * mask.double(), ent * mask.double()
    return lp, ent


def grads_of(fn, hs, ws, go, *extra_go):
    """Run fn(hs, ws) -> tensor or tuple, backprop sum(out * go), return (outs, dh, dw)."""
    hs = hs.detach().clone().requires_grad_(True)
    ws = ws.detach().clone().requires_grad_(True)
    out = fn(hs, ws)
    outs = out if isinstance(out, tuple) else (out,)
    gos = (go,) + extra_go
    total = sum((o.double() * g.double()).sum() for o, g in zip(outs, gos, strict=True))
    total.backward()
    return tuple(o.detach() for o in outs), hs.grad.double(), ws.grad.double()


@pytest.fixture(autouse=False)
def one_thread():
    """These shapes are tiny: on a shared 2-core machine two intra-op threads spend their time
    waiting for each other (measured 80x slower under load). Restores the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
