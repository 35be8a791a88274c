"""Skipping rows without signal (algorithms/signal_rows.py) leaves the HF backend's steps as they were.

Two rollout batches of four prompt groups, two mini-batches each (four optimizer steps; the third
has every row skipped), for GRPO, SDPO and the hybrid, on the padded layout one sample per
micro-batch and on packed rows of three: with skipping on and off, each step's loss and
`grad_norm`, every parameter's gradient, and the optimizer's moments at the end agree.

Tolerances: the first step's loss and grad norm differ only by the order of fp32 sums over
fewer terms (relative 1e-5, as the backend's micro-batch invariance test); a gradient element is
a sum with cancellation, so its round-off is relative to the gradient's scale (1e-4 of its max,
as there). Later steps start from weights that already differ: where a gradient element is within round-off
of 0 its sign can flip, and Adam's first update (~lr * sign) then differs by up to 2 lr on that
weight (tests/conftest.py). Their losses and grad norms are held to 1e-4 (the megatron tests'
later-step tolerance) and their gradients to 1e-3 of the scale (measured up to 1.2e-4 here at
lr 1e-3). A wrong normalizer or a skipped row with signal is off by tens of percent.
"""

import pytest
import torch
from skip_cases import skip_batch, skip_loss

from megatron_sdpo.backends.hf import HFBackend
from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3
from megatron_sdpo.trainer import minibatch_update

LR = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=3)


def run(model_dir, kind: str, skip: bool, **layout):
    """Per optimizer step: (step metrics, gradients as the optimizer saw them); the optimizer's
    moments at the end; the backend's step count."""
    be = HFBackend(model_dir, lr=LR, grad_clip=1.0, **layout)
    params = [p for g in be.optimizer.param_groups for p in g["params"]]
    steps, grads = [], []
    real_step, real_train = be.optimizer.step, be.train_step

    def step(*a, **k):
        grads.append([None if p.grad is None else p.grad.clone() for p in params])
        return real_step(*a, **k)

    def train(batch, loss_fn):
        steps.append(real_train(batch, loss_fn))
        return steps[-1]

    be.optimizer.step, be.train_step = step, train
    combined = [
        minibatch_update(be, skip_batch(w), skip_loss(kind), mini_batches=2, group_size=4, skip=skip) for w in (0, 1)
    ]
    moments = [(be.optimizer.state[p]["exp_avg"].clone(), be.optimizer.state[p]["exp_avg_sq"].clone()) for p in params]
    return list(zip(steps, grads, strict=True)), moments, be.step, combined


def _close(got: float, want: float, tol: float, what: str) -> None:
    assert abs(got - want) <= tol * max(abs(want), 1e-12) + 1e-12, (what, got, want)


@pytest.mark.parametrize("kind", ["grpo", "sdpo", "hybrid"])
@pytest.mark.parametrize(
    "layout", [dict(micro_batch_size=1, packing=False), dict(micro_batch_size=3)], ids=["padded-mbs1", "packed-mbs3"]
)
def test_skipping_keeps_losses_gradients_and_optimizer_state(model_dir, kind, layout):
    off, off_moments, off_count, off_combined = run(model_dir, kind, False, **layout)
    on, on_moments, on_count, on_combined = run(model_dir, kind, True, **layout)
    assert len(on) == len(off) == 4 and on_count == off_count == 4  # the all-skipped step stepped
    skipped = [m["train/rows_skipped"] for m, _ in on]
    assert skipped[2] == 8.0 and 0 < min(skipped[:2] + skipped[3:]) and max(skipped[:2] + skipped[3:]) < 8
    assert all(m["samples"] == 8.0 for m, _ in on)
    for i, ((m_off, g_off), (m_on, g_on)) in enumerate(zip(off, on, strict=True)):
        tol = 1e-5 if i == 0 else 1e-4
        _close(m_on["loss"], m_off["loss"], tol, f"loss of step {i}")
        _close(m_on["grad_norm"], m_off["grad_norm"], tol, f"grad_norm of step {i}")
        for a, b in zip(g_on, g_off, strict=True):
            assert a is not None and b is not None  # every parameter has its (zero) gradient
            scale = max(float(b.abs().max()), 1e-30)
            torch.testing.assert_close(a, b, atol=(1e-4 if i == 0 else 1e-3) * scale, rtol=0)
    assert all(float(g.abs().max()) == 0.0 for g in off[2][1] + on[2][1])  # the skipped step: exact 0
    for (m_a, v_a), (m_b, v_b) in zip(on_moments, off_moments, strict=True):
        torch.testing.assert_close(m_a, m_b, atol=1e-3 * float(m_b.abs().max()), rtol=0)
        torch.testing.assert_close(v_a, v_b, atol=1e-3 * float(v_b.abs().max()), rtol=0)
    # The loss shares are the whole mini-batch's; the token means move to the trained rows.
    for a, b in zip(on_combined, off_combined, strict=True):
        for name in ("grpo/pg_loss", "sdpo/loss_per_token"):
            if name in b:
                _close(a[name], b[name], 1e-4, name)
        assert a["samples"] == b["samples"] == 16.0


def test_an_all_skipped_step_moves_the_weights_as_adam_does(model_dir):
    """A step with zero gradients still decays Adam's moments and applies its update (and the
    decoupled weight decay): the weights move by the same amount with and without skipping."""
    from megatron_sdpo.algorithms.losses import GRPOLoss

    deltas = []
    loss = GRPOLoss(clip_low=0.2, clip_high=0.28, tis_cap=2.0, on_policy=True)
    for skip in (False, True):
        be = HFBackend(model_dir, lr=LR, grad_clip=1.0, micro_batch_size=2, weight_decay=0.1)
        minibatch_update(be, skip_batch(0), loss, mini_batches=1, group_size=4, skip=skip)
        before = [p.detach().clone() for p in be.policy.parameters()]
        all_zero = skip_batch(1)
        all_zero.tensors["advantages"] = torch.zeros_like(all_zero.tensors["advantages"])
        m = minibatch_update(be, all_zero, loss, mini_batches=1, group_size=4, skip=skip)
        assert m["grad_norm"] == 0.0 and be.step == 2
        assert m.get("train/rows_skipped", 0.0) == (16.0 if skip else 0.0)
        deltas.append([p.detach() - b for p, b in zip(be.policy.parameters(), before, strict=True)])
    for a, b in zip(*deltas, strict=True):
        assert float(b.abs().max()) > 0
        torch.testing.assert_close(a, b, atol=1e-4 * float(b.abs().max()), rtol=0)
