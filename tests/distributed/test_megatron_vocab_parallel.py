"""Vocab-parallel logprob / entropy / generalized JSD vs the full-vocabulary computation (the JSD:
the specification in algorithms/divergence.py).

Two ranks split an odd vocabulary (13 real ids, padded to 14: widths 7 and 6); values and
gradients (with a non-uniform grad_output) must match the unsharded computation.
"""

import pytest
import torch

from megatron_sdpo.algorithms.divergence import generalized_jsd

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

V = 13


def _data():
    g = torch.Generator().manual_seed(3)
    s = 3.0 * torch.randn(3, 5, V, generator=g, dtype=torch.float64).float()
    t = 3.0 * torch.randn(3, 5, V, generator=g, dtype=torch.float64).float()
    y = torch.randint(0, V, (3, 5), generator=g)
    w = torch.rand(3, 5, generator=g) + 0.5  # grad_output != 1
    return s, t, y, w


def _reference(alpha):
    s, t, y, w = _data()
    s.requires_grad_(True)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    lp = ls.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    jsd = generalized_jsd(ls, lt, alpha)  # the specification, on the unsharded vocabulary
    out = {}
    for name, val in (("logprobs", lp), ("entropy", ent), ("jsd", jsd)):
        (g,) = torch.autograd.grad((val * w).sum(), s, retain_graph=True)
        out[name] = (val.detach(), g)
    return out


def _worker(alphas):
    import torch.distributed as dist

    from megatron_sdpo.backends import vocab_parallel as vp

    rank, group = dist.get_rank(), dist.new_group([0, 1])
    start, width = vp.shard_bounds(14, V, 2, rank)
    res = {"bounds": (start, width)}
    for alpha in alphas:
        s, t, y, w = _data()
        s_loc = s[..., start : start + width].clone().requires_grad_(True)
        t_loc = t[..., start : start + width].clone()
        vals = {
            "logprobs": vp.logprobs(s_loc, y, start, group)[0],
            "entropy": vp.entropy(s_loc, group),
            "jsd": vp.generalized_jsd(s_loc, t_loc, alpha, group),
        }
        for name, val in vals.items():
            (g,) = torch.autograd.grad((val * w).sum(), s_loc, retain_graph=True)
            res[(alpha, name)] = (val.detach(), g)
    return res


def test_sharded_statistics_and_gradients_match_full_vocabulary():
    from megatron_sdpo.backends.megatron.launch import spawn

    alphas = [0.0, 0.5, 1.0]
    ranks = spawn(_worker, 2, alphas, timeout_s=120)
    assert [r["bounds"] for r in ranks] == [(0, 7), (7, 6)]
    for alpha in alphas:
        ref = _reference(alpha)
        for name, (val, grad) in ref.items():
            for r in ranks:
                got_val, _ = r[(alpha, name)]
                torch.testing.assert_close(got_val, val, rtol=1e-5, atol=1e-5)
            got_grad = torch.cat([r[(alpha, name)][1] for r in ranks], dim=-1)
            torch.testing.assert_close(got_grad, grad, rtol=1e-5, atol=1e-6, msg=f"{name} alpha={alpha}")


KS = (3, 7, 9)  # within one shard, > the last rank's width 6, > both widths


def _topk_worker():
    import torch.distributed as dist

    from megatron_sdpo.backends import vocab_parallel as vp

    rank, group = dist.get_rank(), dist.new_group([0, 1])
    start, width = vp.shard_bounds(14, V, 2, rank)
    s, t, _, w = _data()
    wk = torch.linspace(0.5, 1.5, 9)  # a different weight per rank of the k ids
    res = {}
    for k in KS:
        s_loc = s[..., start : start + width].clone().requires_grad_(True)
        top_s, top_t, ids = vp.topk_logprobs(s_loc, t[..., start : start + width].clone(), k, start, V, group)
        (g,) = torch.autograd.grad((top_s * w.unsqueeze(-1) * wk[:k]).sum(), s_loc)
        res[k] = (top_s.detach(), top_t, ids, g)
    try:
        vp.topk_logprobs(s_loc, t[..., start : start + width], V + 1, start, V, group)
    except ValueError as exc:
        res["error"] = str(exc)
    return res


def test_sharded_topk_logprobs_and_gradients_match_full_vocabulary():
    from megatron_sdpo.backends.megatron.launch import spawn

    ranks = spawn(_topk_worker, 2, timeout_s=120)
    s, t, _, w = _data()
    wk = torch.linspace(0.5, 1.5, 9)
    for k in KS:
        s_full = s.clone().requires_grad_(True)
        ls = torch.log_softmax(s_full, -1)
        ids = ls.detach().topk(k, dim=-1).indices
        top_s, top_t = ls.gather(-1, ids), torch.log_softmax(t, -1).gather(-1, ids)
        (g,) = torch.autograd.grad((top_s * w.unsqueeze(-1) * wk[:k]).sum(), s_full)
        for r in ranks:  # every rank holds the same (replicated) top-k
            assert torch.equal(r[k][2], ids), k
            torch.testing.assert_close(r[k][0], top_s.detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(r[k][1], top_t, rtol=1e-6, atol=1e-6)
        got = torch.cat([ranks[0][k][3], ranks[1][k][3]], dim=-1)
        torch.testing.assert_close(got, g, rtol=1e-5, atol=1e-6, msg=f"k={k}")
    assert all("vocabulary size 13" in r["error"] for r in ranks)
