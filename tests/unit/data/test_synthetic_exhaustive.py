"""`n = 0` on a synthetic split: every item of its space, counted by hand for small spaces."""

import math

import pytest

from megatron_sdpo.data.synthetic import generate
from megatron_sdpo.data.synthetic.base import all_keys
from megatron_sdpo.errors import DataError


def test_the_walk_takes_every_path_of_each_choice_kind():
    def draw(rng):
        xs = [1, 2, 3]
        rng.shuffle(xs)
        return (tuple(xs), tuple(rng.sample("abcd", 2)), rng.random() < 0.5, rng.randint(4, 6), rng.choice("xy"))

    keys = all_keys(draw, "ood_near", what="test")
    assert len(keys) == math.factorial(3) * (4 * 3) * 2 * 3 * 2
    assert len(set(keys)) == len(keys)
    # random() is only compared with a difficulty: at 0 and 1 one branch is walked
    assert {k for (k,) in all_keys(lambda rng: (rng.random() < 0.0,), "ood_near", what="t")} == {False}
    assert {k for (k,) in all_keys(lambda rng: (rng.random() < 1.0,), "ood_near", what="t")} == {True}


def test_science_train_and_id_partition_the_three_choice_space():
    # difficulty 0: three of the readings 1..8, listed in ascending order, under one of 4
    # phrasings, with the threshold below, at or above the extreme reading
    train = generate("science", "train", 0, seed=0, difficulty=0.0)
    held = generate("science", "id", 0, seed=0, difficulty=0.0)
    assert len(train) + len(held) == 4 * math.comb(8, 3) * 3
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert 0.15 < len(held) / (len(train) + len(held)) < 0.25  # the id share is 0.2 by hash


def test_hand_counted_spaces():
    # math ood_far: 8 names x 6 objects x a, b in 2..9
    assert len(generate("math", "ood_far", 0, seed=0)) == 8 * 6 * 8 * 8
    # code ood_mid: two folded constants of one sign (+ or -, then 1..9 twice) or one op of 3 with 2..20
    assert len(generate("code", "ood_mid", 0, seed=0)) == 2 * 9**2 + 3 * 19
    # code ood_far: the three list reducers
    assert len(generate("code", "ood_far", 0, seed=0)) == 3


@pytest.mark.parametrize("domain,split", [("math", "id"), ("code", "id"), ("science", "ood_near")])
def test_every_sampled_item_is_in_the_exhaustive_set_which_is_the_same_for_every_seed(domain, split):
    every = generate(domain, split, 0, seed=0)
    prompts = [r["prompt"] for r in every]
    assert len(set(prompts)) == len(prompts)
    assert prompts == [r["prompt"] for r in generate(domain, split, 0, seed=5)]
    assert {r["prompt"] for r in generate(domain, split, 200, seed=3)} <= set(prompts)


def test_a_space_too_large_to_walk_is_one_error():
    with pytest.raises(DataError, match="too large to evaluate exhaustively.*give n > 0"):
        generate("science", "ood_far", 0, seed=0)


def test_compact_spaces_counted_by_hand():
    # math ood_far: 2 names x 2 objects x a, b in 2..9
    assert len(generate("math", "ood_far", 0, seed=0, compact=True)) == 2 * 2 * 8 * 8
    # science one-digit spaces are small already: compact keeps them (4 phrasings x three of 1..8
    # in ascending order x 3 outcomes); the two-digit ood_mid draws three or four of 11..16
    assert len(generate("science", "ood_near", 0, seed=0, difficulty=0.0, compact=True)) == 4 * math.comb(8, 3) * 3
    assert len(generate("science", "ood_mid", 0, seed=0, difficulty=1.0, compact=True)) == 4 * math.comb(6, 4) * 3
    # code ood_mid never names a variable: compact changes nothing there
    assert len(generate("code", "ood_mid", 0, seed=0, compact=True)) == 2 * 9**2 + 3 * 19
    # science train + id at difficulty 1: four of 1..8 in ascending order, the 4 phrasings, 3 outcomes
    train = generate("science", "train", 0, seed=0, difficulty=1.0, compact=True)
    held = generate("science", "id", 0, seed=0, difficulty=1.0, compact=True)
    assert len(train) + len(held) == 4 * math.comb(8, 4) * 3


@pytest.mark.parametrize("domain", ["math", "science", "tooluse", "code"])
def test_compact_is_a_subset_of_the_full_space_on_the_same_train_id_partition(domain):
    small_id = {r["prompt"] for r in generate(domain, "id", 0, seed=0, compact=True)}
    small_train = {r["prompt"] for r in generate(domain, "train", 0, seed=0, compact=True)}
    assert small_id and small_train and not small_id & small_train
    if domain in ("math", "code"):  # full id spaces small enough to walk here
        assert small_id <= {r["prompt"] for r in generate(domain, "id", 0, seed=0)}
    # a sampled full-surface train draw never holds a compact id item
    assert not small_id & {r["prompt"] for r in generate(domain, "train", 400, seed=1)}
    # sampling the compact surface stays inside it
    assert {r["prompt"] for r in generate(domain, "id", 50, seed=2, compact=True)} <= small_id


def test_compact_is_for_synthetic_sources():
    from megatron_sdpo.config import load_config
    from megatron_sdpo.errors import ConfigError

    cfg = load_config("tiny_study")
    assert all(cfg.domains[d].eval["id"].compact and cfg.domains[d].eval["id"].n == 0 for d in cfg.domains)
    assert not cfg.domains["math"].train.compact
    with pytest.raises(ConfigError, match=r"domains.math.eval.id.compact applies to synthetic sources only"):
        load_config("tiny", ["domains.math.eval.id.source=x.jsonl", "domains.math.eval.id.compact=true"])
