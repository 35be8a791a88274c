"""Assert statements -> functional cases; what does not fit is refused with a reason."""

import pytest

from megatron_sdpo.data.benchmarks import drop_failing_references
from megatron_sdpo.data.code_tests import Unconvertible, humaneval_cases, mbpp_cases
from megatron_sdpo.data.dataset_files import DatasetFile, last_boxed


def test_mbpp_literal_asserts_convert():
    fn, cases = mbpp_cases(
        ["assert add(1, [2, 3]) == 6", "assert 7 == add(3, [4])", "assert add(0, []) == {'a': (1, 2)}"]
    )
    assert fn == "add"
    assert cases[0] == {"input": "1\n[2, 3]", "output": "6", "testtype": "functional"}
    assert cases[1]["input"] == "3\n[4]" and cases[1]["output"] == "7"
    assert cases[2]["output"] == '{"a": [1, 2]}'


@pytest.mark.parametrize(
    "tests,reason",
    [
        (["assert f({1, 2}) == 3"], "set"),
        (["assert f(1) == {1: 2}"], "non-string keys"),
        (["assert f(x=1) == 2"], "keyword"),
        (["assert math.isclose(f(1), 2.0)"], "not an equality"),
        (["assert set(f(1)) == set([1])"], "not a literal"),
        (["assert 1 + f(1) == 2"], "not a call of"),
        (["assert f(1) == 2", "assert g(1) == 2"], "two functions"),
        (["assert f(float('inf')) == 1"], "not a literal"),
    ],
)
def test_mbpp_refuses_what_json_cannot_carry(tests, reason):
    with pytest.raises(Unconvertible, match=reason):
        mbpp_cases(tests)
    with pytest.raises(Unconvertible, match="test_setup_code"):
        mbpp_cases(["assert f(1) == 2"], "import os")


def test_humaneval_check_body():
    src = '''
METADATA = {}


def check(candidate):
    """doc"""
    assert candidate([1, 2], 3) == True, "message"
    assert candidate([], 0) == False
    assert True
'''
    assert humaneval_cases(src) == [
        {"input": "[1, 2]\n3", "output": "true", "testtype": "functional"},
        {"input": "[]\n0", "output": "false", "testtype": "functional"},
    ]
    with pytest.raises(Unconvertible, match="not an equality"):
        humaneval_cases("def check(candidate):\n    assert abs(candidate(1.5) - 0.5) < 1e-6\n")
    with pytest.raises(Unconvertible, match="no check"):
        humaneval_cases("x = 1\n")


def test_items_whose_reference_fails_the_verifier_are_named_not_kept():
    # The JSON round trip turns the tuple argument into a list: `t + (1,)` then fails.
    fn, cases = mbpp_cases(["assert grow((1, 2)) == (1, 2, 1)"])
    ok_fn, ok_cases = mbpp_cases(["assert double(2) == 4"])
    item = DatasetFile(
        "mbpp.jsonl",
        "dolci_code",
        [
            {
                "id": "bad",
                "prompt": "p python",
                "tests": cases,
                "fn_name": fn,
                "reference_solution": "```python\ndef grow(t):\n    return t + (1,)\n```",
            },
            {
                "id": "good",
                "prompt": "p python",
                "tests": ok_cases,
                "fn_name": ok_fn,
                "reference_solution": "```python\ndef double(x):\n    return 2 * x\n```",
            },
        ],
        {},
        "MIT",
    )
    drop_failing_references(item)
    assert [r["id"] for r in item.rows] == ["good"]
    assert len(item.unconverted) == 1 and item.unconverted[0].startswith("bad: the reference solution fails")


def test_last_boxed_matches_braces():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed {x^{2}}") == "x^{2}"
    assert last_boxed(r"\boxed{unclosed") is None and last_boxed("none") is None
