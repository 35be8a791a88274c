"""Refit guard: mismatch metrics as global-mean shares, and the one-line stop naming the tensor."""

import math

import pytest
import torch

from megatron_sdpo.errors import RefitError
from megatron_sdpo.rollout.guard import (
    SEQ_WEIGHT,
    TOKEN_WEIGHT,
    GuardedLoss,
    RefitGuard,
    attach_guard_tensors,
    first_changed,
    mismatch_metrics,
)


def _case():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]])
    trainer = rollout + torch.tensor([[0.1, -0.2, 0.0], [0.4, 7.0, 7.0]])  # padding differs: ignored
    return mask, rollout, trainer


def test_metrics_match_their_definitions_and_split_into_shares():
    mask, rollout, trainer = _case()
    t = {}
    attach_guard_tensors(t, mask)
    m = {k: float(v) for k, v in mismatch_metrics(trainer, rollout, t[TOKEN_WEIGHT], t[SEQ_WEIGHT]).items()}
    d = [0.1, 0.2, 0.0, 0.4]
    assert m["refit/logprob_diff_mean"] == pytest.approx(sum(d) / 4, rel=1e-6)
    assert m["refit/logprob_diff_max"] == pytest.approx(0.4, rel=1e-6)
    assert m["refit/token_mult_prob_error"] == pytest.approx(sum(math.exp(x) for x in d) / 4, rel=1e-6)
    assert m["refit/seq_prob_ratio_mean"] == pytest.approx((math.exp(-0.1) + math.exp(0.4)) / 2, rel=1e-6)
    # Row by row (micro-batches / ranks), the sum-reduced metrics add up to the same values.
    parts = [
        mismatch_metrics(trainer[i : i + 1], rollout[i : i + 1], t[TOKEN_WEIGHT][i : i + 1], t[SEQ_WEIGHT][i : i + 1])
        for i in range(2)
    ]
    for k in ("refit/logprob_diff_mean", "refit/token_mult_prob_error", "refit/seq_prob_ratio_mean"):
        assert float(parts[0][k] + parts[1][k]) == pytest.approx(m[k], rel=1e-6)
    assert max(float(p["refit/logprob_diff_max"]) for p in parts) == pytest.approx(0.4, rel=1e-6)


def test_guarded_loss_adds_logprobs_and_keeps_the_inner_loss():
    from megatron_sdpo.interfaces.backend import LossFn
    from megatron_sdpo.interfaces.distillation import DistillationSpec

    spec = DistillationSpec(alpha=0.5, temperature=1.3, topk=5, topk_source="shards", mask_key="distill_mask")

    class Inner:
        requires = frozenset({"logits"})
        distillation = spec
        on_policy = True
        alpha = 0.5  # not part of the protocol: not forwarded
        mask_keys = ("distill_mask",)

        def global_normalizer(self, tensors):
            return torch.tensor(4.0)

        def signal_rows(self, tensors):
            return torch.ones(1, dtype=torch.bool)

        def __call__(self, outputs, tensors, normalizer):
            return torch.tensor(1.5), {"x": torch.tensor(2.0)}

    mask, rollout, trainer = _case()
    tensors = {"rollout_logprobs": rollout}
    attach_guard_tensors(tensors, mask)
    g = GuardedLoss(Inner())
    assert g.requires == {"logits", "logprobs"} and isinstance(g, LossFn)
    # The protocol's declarations are forwarded explicitly; nothing else leaks through.
    assert g.distillation is spec and g.on_policy is True and not hasattr(g, "alpha")
    assert g.mask_keys == ("distill_mask", TOKEN_WEIGHT, SEQ_WEIGHT)
    loss, metrics = g({"logprobs": trainer}, tensors, g.global_normalizer(tensors))
    assert float(loss) == 1.5 and float(metrics["x"]) == 2.0 and "refit/logprob_diff_max" in metrics


class Engine:
    def __init__(self, sent, received):
        self.sent_checksums, self.received_checksums = sent, received


def test_guard_names_the_step_and_the_first_changed_tensor():
    sent = {"a": (1.0, 2.0), "b": (3.0, 4.0), "c": (5.0, 6.0)}
    assert first_changed(sent, dict(sent)) is None
    assert first_changed(sent, {**sent, "b": (3.0, 4.5), "c": (0.0, 0.0)}) == "b"
    assert first_changed(sent, {"a": (1.0, 2.0)}) == "b"  # never arrived
    guard = RefitGuard(0.5)
    guard.check("stage 1 step 2", {"refit/logprob_diff_mean": 0.1}, Engine(sent, dict(sent)))
    with pytest.raises(RefitError, match=r"^refit guard at stage 1 step 2: mean \|Δ logprob\| 3 > .* 0\.5; .*: b$"):
        guard.check("stage 1 step 2", {"refit/logprob_diff_mean": 3.0}, Engine(sent, {**sent, "b": (0.0, 4.0)}))
    # A changed tensor stops the run even below the threshold.
    with pytest.raises(RefitError, match="changed on the way; .*: c$"):
        guard.check("step 1", {"refit/logprob_diff_mean": 0.0}, Engine(sent, {**sent, "c": (5.0, 7.0)}))
    with pytest.raises(RefitError, match="all 3 refit tensors arrived intact"):
        guard.check("step 1", {"refit/logprob_diff_mean": float("nan")}, Engine(sent, dict(sent)))
    with pytest.raises(RefitError, match="no refit has happened yet"):
        guard.check("step 1", {"refit/logprob_diff_mean": 1.0}, Engine({}, {}))
    RefitGuard(None).check("step 1", {"refit/logprob_diff_mean": 99.0}, Engine({}, {}))  # metrics only
