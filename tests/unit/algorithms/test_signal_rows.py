"""Which rows carry signal, what the backend trains instead of a mini-batch, and the metrics."""

import pytest
import torch

from megatron_sdpo.algorithms.losses import GRPOLoss, HybridLoss, SDPOLoss
from megatron_sdpo.algorithms.signal_rows import PresetNormalizer, select_signal_rows
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.rollout.guard import SEQ_WEIGHT, TOKEN_WEIGHT, GuardedLoss, attach_guard_tensors


def batch(adv, has_context, lengths=(3, 2, 4, 1)):
    prompts = [list(range(10 + i, 15 + 2 * i)) for i in range(len(lengths))]
    responses = [list(range(40, 40 + n)) for n in lengths]
    teacher = [p + [7, 8] if h else None for p, h in zip(prompts, has_context, strict=True)]
    b = SequenceBatch(prompts, responses, teacher, {})
    mask = b.response_mask()
    b.tensors.update(
        loss_mask=mask,
        distill_mask=mask * torch.tensor(has_context, dtype=torch.float32)[:, None],
        advantages=torch.tensor(adv, dtype=torch.float32),
        old_logprobs=-torch.arange(mask.numel(), dtype=torch.float32).reshape(mask.shape) / 10 * mask,
    )
    attach_guard_tensors(b.tensors, mask)
    return b


def sdpo():
    return SDPOLoss(variant="logits", topk=None, is_clip=None, mask_key="distill_mask")


def test_signal_rows_per_loss():
    b = batch([0.5, 0.0, -0.5, 0.0], [False, True, False, False])
    assert GRPOLoss().signal_rows(b.tensors).tolist() == [True, False, True, False]
    # The KL term's gradient does not vanish with the advantage: every row with a token counts.
    assert GRPOLoss(kl_coef=0.1).signal_rows(b.tensors).tolist() == [True] * 4
    assert sdpo().signal_rows(b.tensors).tolist() == [False, True, False, False]
    assert HybridLoss(sdpo(), GRPOLoss(), lam=0.5).signal_rows(b.tensors).tolist() == [True, True, True, False]
    # A term of weight 0 brings no signal.
    assert HybridLoss(sdpo(), GRPOLoss(), lam=1.0).signal_rows(b.tensors).tolist() == [True, False, True, False]
    assert HybridLoss(sdpo(), GRPOLoss(), lam=0.0).signal_rows(b.tensors).tolist() == [False, True, False, False]
    # Per-token advantages: a row counts where a loss token has one.
    t = dict(b.tensors, advantages=torch.zeros(4, 4))
    t["advantages"][3, 0] = 1.0
    t["advantages"][1, 3] = 1.0  # past the row's two tokens: no signal
    assert GRPOLoss().signal_rows(t).tolist() == [False, False, False, True]
    assert GuardedLoss(GRPOLoss()).mask_keys == ("loss_mask", TOKEN_WEIGHT, SEQ_WEIGHT)


def test_selection_keeps_signal_rows_in_order_and_the_global_normalizer():
    b = batch([0.5, 0.0, -0.5, 0.0], [False] * 4)
    loss = GuardedLoss(GRPOLoss())
    assert select_signal_rows(batch([1.0, -1.0, 1.0, -1.0], [False] * 4), loss) is None  # nothing to skip
    sel = select_signal_rows(b, loss, min_rows=2)
    assert sel.batch.response_ids == [b.response_ids[0], b.response_ids[2]] and sel.rows == 4 and sel.rows_skipped == 2
    assert sel.trained.tolist() == [True, True]
    assert float(sel.normalizer) == 10.0  # every loss token of the mini-batch, skipped rows included
    assert sel.batch.tensors["loss_mask"].shape == (2, 4)  # per-token tensors at the rows' longest
    assert torch.equal(sel.batch.tensors["old_logprobs"], b.tensors["old_logprobs"][[0, 2]])


@pytest.mark.parametrize("min_rows", [1, 2, 3])
def test_placeholders_hold_the_places_of_ranks_and_add_nothing(min_rows):
    b = batch([0.0, 0.0, 0.0, 0.0], [False, False, False, False], lengths=(3, 2, 4, 1))
    loss = GuardedLoss(HybridLoss(sdpo(), GRPOLoss(), lam=0.5))
    sel = select_signal_rows(b, loss, min_rows=min_rows)
    assert len(sel.batch) == min_rows and not sel.trained.any() and sel.rows_skipped == 4
    # The cheapest rows (prompt + response tokens), cut to one token each, with no teacher.
    cost = sorted(range(4), key=lambda i: len(b.prompt_ids[i]) + len(b.response_ids[i]))[:min_rows]
    assert sel.batch.prompt_ids == [b.prompt_ids[i][-1:] for i in sorted(cost)]
    assert sel.batch.response_ids == [b.response_ids[i][:1] for i in sorted(cost)]
    assert sel.batch.teacher_prompt_ids == [None] * min_rows
    for key in loss.mask_keys:  # every tensor that weighs a token or row is 0 there
        assert float(sel.batch.tensors[key].abs().sum()) == 0.0, key
    assert float(loss.global_normalizer(sel.batch.tensors).sum()) == 0.0


def test_placeholders_only_where_ranks_lack_rows():
    b = batch([0.0, 1.0, 0.0, 0.0], [False] * 4)
    sel = select_signal_rows(b, GRPOLoss(), min_rows=2)
    assert sel.trained.tolist().count(True) == 1 and len(sel.batch) == 2
    assert sel.batch.response_ids[sel.trained.tolist().index(True)] == b.response_ids[1]  # kept whole
    assert float(sel.batch.tensors["loss_mask"][~sel.trained].sum()) == 0.0


def test_preset_normalizer_keeps_loss_shares_and_rescales_token_means():
    b = batch([0.5, 0.0, -0.5, 0.0], [True, False, False, False])
    inner = HybridLoss(sdpo(), GRPOLoss(), lam=0.5)
    sel = select_signal_rows(b, inner)
    trained = inner.global_normalizer(sel.batch.tensors)
    assert trained.tolist() == [7.0, 3.0] and sel.normalizer.tolist() == [10.0, 3.0]
    wrapped = PresetNormalizer(inner, sel.normalizer, trained)
    assert wrapped.global_normalizer({}) is sel.normalizer
    assert wrapped.requires == inner.requires and wrapped.mask_keys == inner.mask_keys

    class Fixed:
        requires, distillation, on_policy, mask_keys = frozenset(), None, False, ()

        def __call__(self, outputs, tensors, normalizer):
            one = torch.tensor(1.0)
            return one, {
                "grpo/pg_loss": one,
                "grpo/ratio_mean": one,
                "grpo/ratio_max": one,
                "sdpo/student_entropy": one,
                "refit/x": one,
            }

    wrapped.inner = Fixed()
    _, m = wrapped({}, {}, sel.normalizer)
    assert float(m["grpo/pg_loss"]) == 1.0 and float(m["grpo/ratio_max"]) == 1.0 and float(m["refit/x"]) == 1.0
    assert float(m["grpo/ratio_mean"]) == pytest.approx(10 / 7) and float(m["sdpo/student_entropy"]) == 1.0
    # A term with no trained token reports none of its token means.
    empty = PresetNormalizer(Fixed(), torch.tensor([10.0, 3.0]), torch.tensor([7.0, 0.0]))
    _, m = empty({}, {}, None)
    assert "sdpo/student_entropy" not in m and "grpo/ratio_mean" in m
