"""DAPO's dynamic sampling: which groups stay, how the batch is filled, and the step that runs it."""

import pytest

from megatron_sdpo.rollout.base import Completion
from megatron_sdpo.rollout.group_filter import Group, GroupPool, informative


def test_informative_groups_are_those_whose_rewards_differ():
    assert informative([1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.25], 4) == [True, False, False, True]


def _groups(tag, n):
    return [Group({"id": f"{tag}{i}"}, [i], [Completion(0, [1], [0.0], "x", False)] * 2, [None] * 2) for i in range(n)]


def test_pool_takes_the_first_informative_groups_and_fills_with_the_latest_dropped():
    pool = GroupPool(want=3)
    pool.add(_groups("a", 3), [True, False, False])
    assert not pool.full
    pool.add(_groups("b", 3), [False, True, False])
    assert not pool.full and [g.record["id"] for g in pool.batch()] == ["a0", "b1", "b2"]
    m = pool.metrics(group_size=2)
    assert m == {
        "dynamic/rounds": 2.0,
        "dynamic/extra_rollouts": 6.0,
        "dynamic/kept_groups": 2.0,
        "dynamic/filled_groups": 1.0,
        "dynamic/informative_frac": pytest.approx(2 / 6),
    }
    pool.add(_groups("c", 3), [True, True, True])
    assert pool.full and [g.record["id"] for g in pool.batch()] == ["a0", "b1", "c0"]
    assert pool.metrics(2)["dynamic/filled_groups"] == 0.0 and pool.metrics(2)["dynamic/kept_groups"] == 3.0


def test_extra_rounds_draw_pure_functions_of_the_position():
    from megatron_sdpo.continual import train_batch

    records = [{"id": i} for i in range(10)]
    kw = dict(seed=3, stage=1, step=4, size=6)
    assert train_batch(records, **kw, round_=1) == train_batch(records, **kw, round_=1)
    assert train_batch(records, **kw, round_=1) != train_batch(records, **kw, round_=2)
    assert train_batch(records, **kw, round_=1) != train_batch(records, **{**kw, "step": 5}, round_=1)
    assert train_batch(records, **kw) == train_batch(records, **kw, round_=0)  # the first round unchanged
