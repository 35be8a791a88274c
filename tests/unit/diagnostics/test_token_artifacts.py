"""Token-level artifact rates and endorsement on hand-built responses."""

import math

import pytest
import torch

from megatron_sdpo.diagnostics.token_artifacts import (
    artifact_endorsement,
    format_repeat_mask,
    mask_tensor,
    repeated_ngram_mask,
    token_artifact_masks,
    token_artifact_rates,
)
from megatron_sdpo.errors import DataError

# "\boxed{1} and \boxed{1}" in five tokens; the format string spans token boundaries.
BOXED = ["\\", "boxed{1}", " and ", "\\box", "ed{1}"]


def test_format_repeat_marks_only_tokens_of_later_occurrences():
    # Character spans: [0,1) [1,9) [9,14) [14,18) [18,23); occurrences of "\boxed" at [0,6) and
    # [14,20): the second overlaps tokens 3 and 4 only.
    assert format_repeat_mask(BOXED, "\\boxed") == [False, False, False, True, True]
    assert format_repeat_mask(["\\boxed{1}"], "\\boxed") == [False]  # one occurrence: the format
    assert format_repeat_mask(["\\boxed\\boxed", "", "x"], "\\boxed") == [True, False, False]
    with pytest.raises(ValueError):
        format_repeat_mask(BOXED, "")


def test_repeated_ngram_marks_later_copies():
    # bigrams (1,2) (2,3) (3,1) new; then (1,2)@3 (2,3)@4 (3,1)@5 repeat -> tokens 3..6
    assert repeated_ngram_mask([1, 2, 3, 1, 2, 3, 1], 2) == [False, False, False, True, True, True, True]
    assert repeated_ngram_mask([5, 5, 5], 2) == [False, True, True]  # (5,5)@0 new, (5,5)@1 repeats
    assert repeated_ngram_mask([1, 2], 3) == [False, False]
    assert repeated_ngram_mask([], 1) == []
    with pytest.raises(ValueError):
        repeated_ngram_mask([1], 0)


def test_token_rates_pool_all_tokens():
    pieces = [BOXED, ["a", "a", "a"]]
    ids = [[1, 2, 3, 4, 5], [7, 7, 7]]
    rates = token_artifact_rates(pieces, ids, format_tokens=("\\boxed", "</answer>"), ngram=2)
    # 8 tokens: format repeat on 2 (response 1), bigram repeat on 2 (response 2), disjoint.
    assert rates["tokens"] == 8.0
    assert rates["fmt_boxed_token_rate"] == 2 / 8 and rates["fmt_answer_close_token_rate"] == 0.0
    assert rates["format_any_token_rate"] == 2 / 8
    assert rates["ngram_token_rate"] == 2 / 8 and rates["any_token_rate"] == 4 / 8
    assert math.isnan(token_artifact_rates([[]], [[]])["any_token_rate"])
    with pytest.raises(DataError, match="pieces for"):
        token_artifact_masks([["a"]], [[1, 2]])
    with pytest.raises(DataError, match="piece lists"):
        token_artifact_masks([["a"]], [])


def test_endorsement_means_over_marked_and_other_tokens():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -math.inf]])
    art = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]])  # the last one is padding: not counted
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    got = artifact_endorsement(lp, art, mask)
    assert (got["artifact_tokens"], got["other_tokens"]) == (3.0, 2.0)
    assert got["artifact_logprob"] == pytest.approx((-2 - 3 - 0.5) / 3, rel=1e-12)
    assert got["other_logprob"] == pytest.approx((-1 - 4) / 2, rel=1e-12)
    assert got["logprob_gap"] == pytest.approx(-5.5 / 3 + 2.5, rel=1e-12)
    assert got["artifact_prob"] == pytest.approx((math.exp(-2) + math.exp(-3) + math.exp(-0.5)) / 3, rel=1e-6)
    assert got["other_prob"] == pytest.approx((math.exp(-1) + math.exp(-4)) / 2, rel=1e-6)
    none = artifact_endorsement(lp, torch.zeros_like(art), mask)
    assert math.isnan(none["artifact_logprob"]) and none["artifact_tokens"] == 0.0


def test_mask_tensor_left_aligned():
    t = mask_tensor([[True, False], [True]], (2, 3))
    assert t.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    with pytest.raises(DataError):
        mask_tensor([[True] * 4], (1, 3))
