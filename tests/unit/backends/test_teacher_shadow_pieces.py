"""The fp32 teacher shadow's checkpoint pieces load under another data-parallel split: pieces
saved by two DP ranks fill one rank that owns everything, and a missing piece is an error."""

import pytest
import torch

from megatron_sdpo.backends.megatron.teacher_state import FP32TeacherShadow
from megatron_sdpo.errors import CheckpointError


def _shadow(shapes, ranges):
    sh = FP32TeacherShadow.__new__(FP32TeacherShadow)  # the piece bookkeeping only, no optimizer
    sh.shapes, sh.ranges, sh.group, sh.buckets = shapes, ranges, None, []
    sh.offsets = [0]
    for a, b in ranges:
        sh.offsets.append(sh.offsets[-1] + b - a)
    sh.local = torch.full((sh.offsets[-1],), float("nan"))
    return sh


def test_pieces_of_two_dp_ranks_fill_one_rank_that_owns_every_element():
    shapes = [(3, 5), (7,), (2, 2)]
    truth = [torch.randn(s, generator=torch.Generator().manual_seed(k)) for k, s in enumerate(shapes)]
    # DP=2 with a bucket boundary inside param 0 and param 2 wholly on rank 1.
    split = [[(0, 9), (0, 7), (0, 0)], [(9, 15), (0, 0), (0, 4)]]
    states = []
    for ranges in split:
        saver = _shadow(shapes, ranges)
        saver.resync(truth)
        states.append(saver.state())
    whole = _shadow(shapes, [(0, 15), (0, 7), (0, 4)])
    whole.load_states(states, "ck")
    assert all(torch.equal(f, t) for f, t in zip(whole.full(), truth, strict=True))
    # A rank of another split (elements 4..12 of param 0) takes what it owns.
    part = _shadow(shapes, [(4, 12), (0, 0), (1, 3)])
    part.load_states(states, "ck")
    assert torch.equal(part.piece(0), truth[0].view(-1)[4:12]) and torch.equal(part.piece(2), truth[2].view(-1)[1:3])
    assert torch.isnan(part.full()[1]).all()  # owned elsewhere


def test_a_missing_piece_or_other_shapes_are_checkpoint_errors():
    shapes = [(4,)]
    saver = _shadow(shapes, [(0, 2)])
    saver.resync([torch.arange(4.0)])
    with pytest.raises(CheckpointError, match="misses elements of parameter 0"):
        _shadow(shapes, [(0, 4)]).load_states([saver.state()], "ck")
    with pytest.raises(CheckpointError, match="shapes differ"):
        _shadow([(5,)], [(0, 5)]).load_states([saver.state()], "ck")
