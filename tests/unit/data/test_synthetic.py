"""The synthetic suite: valid, deterministic, train/id disjoint, solutions verified by the rewards."""

import random
import re

import pytest

from megatron_sdpo.data.records import validate_record
from megatron_sdpo.data.synthetic import DEFAULT_DIFFICULTY, SPLITS, generate
from megatron_sdpo.data.synthetic.base import NUMBER_WORDS
from megatron_sdpo.errors import DataError
from megatron_sdpo.interfaces.domains import DOMAINS


def _key(r):
    return (r["prompt"], r["solution"])


@pytest.mark.parametrize("domain", DOMAINS)
def test_records_valid_and_deterministic(domain):
    state = random.getstate()
    for split in SPLITS:
        a = generate(domain, split, 40, seed=1)
        assert len(a) == 40
        for r in a:
            validate_record(r, f"{domain}/{split}")
            assert r["split"] == split and r["domain"] == domain and r["solution"]
        assert generate(domain, split, 40, seed=1) == a
        assert [_key(r) for r in generate(domain, split, 40, seed=2)] != [_key(r) for r in a]
    assert random.getstate() == state  # no global RNG use


@pytest.mark.parametrize("domain", [d for d in DOMAINS])
def test_train_and_id_disjoint(domain):
    train = {r["prompt"] for s in (0, 1) for r in generate(domain, "train", 300, seed=s)}
    held = {r["prompt"] for s in (0, 1) for r in generate(domain, "id", 100, seed=s)}
    assert not train & held
    # items are unique within a split (ood_far code programs repeat by design, tests differ)
    assert len({r["prompt"] for r in generate(domain, "train", 300, seed=0)}) == 300


@pytest.mark.parametrize("domain", DOMAINS)
def test_prompts_are_short(domain):
    for split in SPLITS:
        longest = max(len(r["prompt"].split()) for r in generate(domain, split, 50, seed=0))
        assert longest <= 32, (domain, split, longest)


def test_ood_splits_differ_from_train():
    math_mid = generate("math", "ood_mid", 50, 0)
    hi = 9 + round(90 * DEFAULT_DIFFICULTY["math"])
    assert all(int(r["solution"].split("+")[0].split("-")[0]) > hi for r in math_mid)
    assert all("*" in r["solution"] for r in generate("math", "ood_far", 20, 0))
    assert all(r["prompt"].count(" g,") + r["prompt"].count(" K,") == 5 for r in generate("science", "ood_far", 20, 0))
    assert all(len(r["answer"]) == 2 for r in generate("tooluse", "ood_far", 20, 0))
    assert all(" " in r["tests"][0]["input"] for r in generate("code", "ood_mid", 20, 0))


def _science_readings(prompt: str) -> tuple[int, list[int]]:
    question, listing = prompt.split("? ", 1)
    threshold = int(question.split()[-2])
    return threshold, [int(v) for v in re.findall(r"(\d+) [Kg][,.]", listing)]


@pytest.mark.parametrize("split", SPLITS)
def test_science_answer_compares_the_extreme_reading_with_the_threshold(split):
    recs = generate("science", split, 150, 0)
    for r in recs:
        threshold, vals = _science_readings(r["prompt"])
        high = any(w in r["prompt"] for w in ("hottest", "heaviest", "highest", "largest"))
        extreme = max(vals) if high else min(vals)
        expected = "A" if extreme < threshold else ("B" if extreme == threshold else "C")
        assert r["answer"] == expected and r["choices"] == ["below", "at", "above"]
        assert abs(extreme - threshold) <= 1 and len(str(extreme)) == len(str(threshold))
        unit = "K" if " K," in r["prompt"] else "g"
        relation = r["choices"][ord(r["answer"]) - 65]
        assert r["solution"] == f"{extreme} {unit} vs {threshold} {unit}: {relation} <answer>{r['answer']}</answer>"
        # listed in ascending order (the extreme is first or last) except far out of distribution
        assert vals == sorted(vals) or split == "ood_far"
    if split == "ood_far":  # six readings in no order: 150 all sorted has chance 720**-150
        assert any(v != sorted(v) for v in (_science_readings(r["prompt"])[1] for r in recs))
    # the three outcomes are equally likely: none under 20% of 150 (binomial sd ~ 3.8%)
    assert min(sum(r["answer"] == x for r in recs) for x in "ABC") >= 30


def test_difficulty_knob_changes_items():
    easy = generate("code", "train", 40, 0, difficulty=0.0)
    hard = generate("code", "train", 40, 0, difficulty=1.0)

    def n_words(recs):
        return {sum(r["prompt"].count(f" {w} ") for w in ("plus", "minus", "times")) for r in recs}

    assert n_words(easy) == {1} and n_words(hard) == {2}
    assert max(int(r["answer"]) for r in generate("math", "train", 200, 0, difficulty=0.0)) <= 18
    assert {len(_science_readings(r["prompt"])[1]) for r in generate("science", "train", 50, 0, difficulty=0.0)} == {3}
    assert {len(_science_readings(r["prompt"])[1]) for r in generate("science", "train", 50, 0, difficulty=1.0)} == {4}

    def derived(r):
        return "adult" in r["prompt"] or "hour" in r["prompt"]

    assert all(derived(r) for r in generate("tooluse", "train", 50, 0, difficulty=1.0))
    assert not any(derived(r) for r in generate("tooluse", "train", 50, 0, difficulty=0.0))


_WORD = {w: i for i, w in enumerate(NUMBER_WORDS)}


def test_code_constants_are_folded():
    """The reference program computes the chained constants: it is not a word-for-word copy. The
    two constants share their sign (recipe 3), so the fold is an unsigned one-digit sum."""
    signs = set()
    for r in generate("code", "train", 200, 0, difficulty=1.0):
        words = r["prompt"].split(" print ")[1].split(".")[0].split()
        ops = words[1::2]
        assert len(set(ops)) == 1 and ops[0] in ("plus", "minus"), r["prompt"]
        signs.add(ops[0])
        var, total = words[0], 0
        for op, k in zip(words[1::2], words[2::2], strict=True):
            total += _WORD[k] if op == "plus" else -_WORD[k]
        want = var if total == 0 else f"{var}{'+' if total > 0 else '-'}{abs(total)}"
        assert f"print({want})" in r["solution"], (r["prompt"], r["solution"])
    assert signs == {"plus", "minus"}


def test_tooluse_derived_arguments():
    for r in generate("tooluse", "train", 200, 0, difficulty=1.0):
        (call,) = r["answer"]
        (value,) = call["Action_Input"].values()
        words = r["prompt"].split()
        if "adult" in r["prompt"]:
            i = words.index("and") - 1
            assert value == _WORD[words[i - 1]] + _WORD[words[i + 2]], r["prompt"]
        else:
            i = next(j for j, w in enumerate(words) if w.startswith("hour"))
            assert value == 60 * int(words[i - 1]) + int(words[i + 1]), r["prompt"]
        assert call["Action"] in r["prompt"].split("\n")[0]  # the tool is listed


def test_science_readings_by_split():
    def digits(recs):
        return {len(str(v)) for r in recs for v in _science_readings(r["prompt"])[1]}

    assert digits(generate("science", "train", 50, 0)) == {1}
    assert digits(generate("science", "ood_near", 50, 0)) == {1}
    assert digits(generate("science", "ood_mid", 50, 0)) == {2}
    assert digits(generate("science", "ood_far", 50, 0)) == {2}
    assert "reading" not in generate("science", "ood_near", 1, 0)[0]["prompt"]


def test_bad_arguments():
    with pytest.raises(DataError, match="unknown domain 'poetry'"):
        generate("poetry", "train", 1, 0)
    with pytest.raises(DataError, match="unknown synthetic split 'dev'"):
        generate("math", "dev", 1, 0)
    with pytest.raises(DataError, match="difficulty must be in"):
        generate("math", "train", 1, 0, difficulty=2.0)
    with pytest.raises(DataError, match="cannot give"):
        generate("code", "id", 500, 0, difficulty=0.0)


@pytest.mark.parametrize("domain", DOMAINS)
def test_solutions_score_one(domain):
    score = pytest.importorskip("megatron_sdpo.rewards").score

    for split in SPLITS:
        for r in generate(domain, split, 25, seed=3):
            res = score(domain, r["solution"], r)
            assert res.score == 1.0, (split, r["prompt"], r["solution"], res.feedback)


@pytest.mark.parametrize("domain", DOMAINS)
def test_instruction_replaces_only_the_prompt_ending(domain):
    from megatron_sdpo.data import synthetic

    own = generate(domain, "id", 8, 3)
    worded = generate(domain, "id", 8, 3, instruction="Say it plainly.")
    suffix = synthetic._MODULES[domain].INSTRUCTION
    for a, b in zip(own, worded, strict=True):
        assert a["prompt"].endswith(suffix) and b["prompt"] == a["prompt"][: -len(suffix)] + "Say it plainly."
        assert {k: v for k, v in a.items() if k != "prompt"} == {k: v for k, v in b.items() if k != "prompt"}


def test_worked_math_solutions_count_every_number_and_score_one():
    from megatron_sdpo.data.synthetic import math as synthetic_math
    from megatron_sdpo.rewards.math import score_math

    assert synthetic_math.worked_solution("+", "Ann", "pens", 9, 3, 12) == (
        "Ann starts with 9 pens and gets 3. Count on 3 from 9: 10, 11, 12. So Ann has 12 pens. "
        "The answer is 12. \\boxed{12}"
    )
    assert "Count back 2 from 5: 4, 3." in synthetic_math.worked_solution("-", "Bob", "cards", 5, 2, 3)
    assert "Add 4 for each bag: 4, 8, 12." in synthetic_math.worked_solution("*", "Eve", "coins", 3, 4, 12)
    for split in SPLITS:
        short = generate("math", split, 30, 0)
        long = synthetic_math.generate(split, 30, 0, long_answers=True)
        # the prompts and answers are the same items; only the reference solution changes
        assert [r["prompt"] for r in long] == [r["prompt"] for r in short]
        for r in long:
            assert r["solution"].count("\\boxed{") == 1 and len(r["solution"]) > 3 * len(short[0]["solution"])
            assert score_math(r["solution"], r).score == 1.0
