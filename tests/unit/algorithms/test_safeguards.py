"""The two safeguards of SDPO's distillation against hand-computed cases: the contrast gate's
weights at, below and above s0 (and the binary gate), the agreement mask on mixed-sign tokens
and on a zero-advantage group; and the trainer applying both to the distillation mask."""

import math

import pytest
import torch

from megatron_sdpo.algorithms.safeguards import agreement_mask, contrast_weights
from megatron_sdpo.errors import ConfigError


def test_contrast_gate_by_hand():
    # Group 1: rewards 1, 0, 0, 0: mean 1/4, unbiased variance (9/16 + 3/16) / 3 = 1/4, std 1/2.
    # Group 2: all equal: no contrast. Group 3: 0.5, 0.5, 1, 0: variance (0.25 + 0.25) / 3, std sqrt(1/6).
    r = torch.tensor([1.0, 0, 0, 0, 0.3, 0.3, 0.3, 0.3, 0.5, 0.5, 1.0, 0.0])
    for s0, g1, g3 in (
        (1.0, 0.5, math.sqrt(1 / 6)),
        (0.5, 1.0, math.sqrt(1 / 6) / 0.5),
        (0.25, 1.0, 1.0),
        (0.0, 1.0, 1.0),
    ):
        w = contrast_weights(r, group_size=4, s0=s0)
        want = torch.tensor([g1] * 4 + [0.0] * 4 + [g3] * 4)
        torch.testing.assert_close(w, want, rtol=1e-6, atol=0)
    # Around s0: a std just below s0 gives a weight just below 1, at s0 exactly 1.
    assert float(contrast_weights(r[:4], group_size=4, s0=0.5)[0]) == 1.0
    assert 0.99 < float(contrast_weights(r[:4], group_size=4, s0=0.505)[0]) < 1.0


def test_contrast_gate_edges():
    with pytest.raises(ConfigError, match="contrast_gate must be >= 0"):
        contrast_weights(torch.zeros(4), group_size=2, s0=-0.1)
    assert contrast_weights(torch.tensor([1.0, 0.0]), group_size=1, s0=0.0).tolist() == [0.0, 0.0]


def test_agreement_mask_by_hand():
    # One group of 4: rewards 1, 0, 0, 1 -> advantages +1/2, -1/2, -1/2, +1/2. Log-ratios
    # (teacher - student) of each sample's 3 tokens, one exactly 0.
    teacher = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0], [-1.0, -1.0, -1.0]])
    student = torch.tensor([[-1.5, -1.0, -0.5], [-1.5, -1.0, -0.4], [-0.1, -2.0, -2.0], [-2.0, -0.5, -1.0]])
    # ratios: [+0.5, -1, 0], [+0.5, -1, -0.1], [-0.1, -1, +1], [+1, -0.5, 0]
    got = agreement_mask(teacher, student, torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    want = torch.tensor([[1.0, 0, 0], [0, 1, 1], [1, 1, 0], [1, 0, 0]])
    assert torch.equal(got, want)


def test_agreement_mask_drops_a_zero_advantage_group():
    t, s = torch.tensor([[0.0, -1.0], [-3.0, -1.0]]), torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    assert torch.equal(agreement_mask(t, s, torch.tensor([1.0, 1.0]), group_size=2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="differ in shape"):
        agreement_mask(t, s[:, :1], torch.tensor([1.0, 0.0]), group_size=2)


def test_the_trainer_applies_both_to_the_distillation_mask():
    """Two groups of two: one success and one failure (the failure quotes the success; the
    success has no sibling), and two successes (each quotes the other). The gate keeps the
    contrasting group and removes the all-success one; the agreement mask keeps the tokens whose
    teacher log-ratio has the advantage's sign (a stub backend's teacher log-probs)."""
    from types import SimpleNamespace

    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.config import load_config
    from megatron_sdpo.interfaces.backend import SequenceBatch
    from megatron_sdpo.models.tiny import ensure_tiny_base
    from megatron_sdpo.trainer.teacher import SelfTeacher

    class Teacher:
        def logprobs(self, batch, *, model="policy"):
            assert model == "teacher"
            return torch.tensor([[0.0, -2.0], [-2.0, 0.0], [0.0, 0.0], [0.0, 0.0]])

    tok = load_tokenizer(ensure_tiny_base())
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    results = [SimpleNamespace(feedback="")] * 4

    def attach(*overrides):
        teacher = SelfTeacher(load_config("tiny_sdpo", ["algorithm.group_size=2", *overrides]), Teacher(), tok)
        teacher.reasoning_end_ids = None
        attach.teacher = teacher
        b = SequenceBatch([[1, 2]] * 4, [[5, 6]] * 4)
        b.tensors["loss_mask"] = b.response_mask()
        b.tensors["rollout_logprobs"] = torch.full((4, 2), -1.0)
        has, metrics = teacher.attach(
            b, [{"prompt": "Compute 2+2."}] * 4, ["4", "5", "4", "4"], rewards, results, 0, domain="math"
        )
        attach.batch = b
        return has, b.tensors[teacher.mask_key], metrics

    has, plain, m = attach()
    assert has == [False, True, True, True] and plain.sum() == 6 and m == {}
    _, gated, m = attach("algorithm.sdpo.contrast_gate=0")
    assert gated.tolist() == [[0, 0], [1, 1], [0, 0], [0, 0]] and m["sdpo/gate_mean"] == pytest.approx(1 / 3)
    # Advantages +1/2, -1/2, 0, 0; log-ratios [+1, -1], [-1, +1], [+1, +1], [+1, +1].
    _, agreed, m = attach("algorithm.sdpo.agreement_mask=true")
    assert agreed.tolist() == [[0, 0], [1, 0], [0, 0], [0, 0]] and m["sdpo/agree_frac"] == pytest.approx(1 / 6)
    # The teacher signal's KL on the all-success group (samples 2 and 3, whatever the mask kept):
    # rollout log-probs -1, teacher 0 on every token: -1.
    sig = attach.teacher.signal(attach.batch, rewards)
    assert sig["teacher/kl_all_success"] == pytest.approx(-1.0)


def test_a_negative_gate_is_a_config_error():
    from megatron_sdpo.config import load_config

    with pytest.raises(ConfigError, match="contrast_gate must be >= 0"):
        load_config("tiny_sdpo", ["algorithm.sdpo.contrast_gate=-0.5"])
    assert load_config("tiny_sdpo", ["algorithm.sdpo.contrast_gate=0.3"]).algorithm.sdpo.contrast_gate == 0.3
