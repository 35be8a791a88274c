"""Skipping rows without signal (algorithms/signal_rows.py) leaves the megatron backend's steps as
they were, at DP 2, where one rank's share of a mini-batch has no signal (batch 0's first
mini-batch: its second group has all rewards 0) and where a whole mini-batch has none (batch
1's first: both ranks run one placeholder each, so the schedule and the gradient all-reduce run
on every rank and the optimizer steps with zero gradients).

Gradients are compared with the plain optimizer (all-reduced gradients: every rank holds them
whole); with the distributed one (its default: each rank's buffer holds only its own shard
reduced) the losses, grad norms and the policy after the four steps. Tolerances as in
tests/unit/backends/test_hf_skip.py (the same losses and batches).
"""

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

LR = 1e-3
KINDS = ("grpo", "sdpo", "hybrid")


def _worker(model_dir: str, distributed_optimizer: bool) -> dict:
    from skip_cases import skip_batch, skip_loss

    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig, destroy
    from megatron_sdpo.trainer import minibatch_update

    out = {}
    for kind in KINDS:
        for skip in (False, True):
            be = MegatronBackend(
                model_dir,
                lr=LR,
                micro_batch_size=2,
                grad_clip=1.0,
                parallel=ParallelConfig(tp=1, pp=1),
                distributed_optimizer=distributed_optimizer,
            )
            assert be.dp_size == 2
            params = list(be.policy.parameters())
            steps, grads = [], []
            real_step, real_train = be.optimizer.step, be.train_step

            def step(*a, _real=real_step, _grads=grads, _params=params, **k):
                _grads.append([p.main_grad.detach().clone() for p in _params])
                return _real(*a, **k)

            def train(batch, loss_fn, _real=real_train, _steps=steps):
                _steps.append(_real(batch, loss_fn))
                return _steps[-1]

            be.optimizer.step, be.train_step = step, train
            for w in (0, 1):
                minibatch_update(be, skip_batch(w), skip_loss(kind), mini_batches=2, group_size=4, skip=skip)
            out[kind, skip] = {
                "steps": [(m["loss"], m["grad_norm"], m.get("train/rows_skipped")) for m in steps],
                "grads": grads,
                "after": be.logprobs(skip_batch(0)),
                "count": be.step,
            }
            del be
            destroy()
    return out


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["plain-optimizer", "distributed-optimizer"])
def test_dp2_skipping_keeps_losses_gradients_and_the_policy(model_dir, distributed_optimizer):
    from megatron_sdpo.backends.megatron.launch import spawn

    ranks = spawn(_worker, 2, model_dir, distributed_optimizer, timeout_s=600)
    for rank in ranks:
        for kind in KINDS:
            off, on = rank[kind, False], rank[kind, True]
            assert on["count"] == off["count"] == 4  # the all-skipped step stepped
            assert [s[2] for s in on["steps"]][2] == 8.0 and all(s[2] is None for s in off["steps"])
            for i, ((l_off, n_off, _), (l_on, n_on, _)) in enumerate(zip(off["steps"], on["steps"], strict=True)):
                tol = 1e-5 if i == 0 else 1e-4
                assert abs(l_on - l_off) <= tol * max(abs(l_off), 1e-12) + 1e-12, (kind, i, l_on, l_off)
                assert abs(n_on - n_off) <= tol * max(abs(n_off), 1e-12) + 1e-12, (kind, i, n_on, n_off)
                for a, b in zip(on["grads"][i], off["grads"][i], strict=True) if not distributed_optimizer else ():
                    scale = max(float(b.abs().max()), 1e-30)
                    torch.testing.assert_close(a, b, atol=(1e-4 if i == 0 else 1e-3) * scale, rtol=0)
            if not distributed_optimizer:
                assert all(float(g.abs().max()) == 0.0 for g in on["grads"][2] + off["grads"][2])
            torch.testing.assert_close(on["after"], off["after"], atol=1e-3, rtol=0)
    # Every rank reports the same reduced metrics.
    for kind in KINDS:
        assert ranks[0][kind, True]["steps"] == ranks[1][kind, True]["steps"]
