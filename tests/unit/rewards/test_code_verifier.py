import json
import time

import pytest

from megatron_sdpo.errors import DataError
from megatron_sdpo.rewards import sandbox as sb
from megatron_sdpo.rewards import score, score_batch
from megatron_sdpo.rewards.code import extract_code, score_code
from megatron_sdpo.rewards.sandbox import Sandbox, SandboxLimits

SANDBOX = Sandbox(SandboxLimits(timeout_s=1.0, cpu_s=1))
STDIO = {"id": "c1", "domain": "code", "tests": [
    {"input": "1 2\n", "output": "3\n"}, {"input": "10 -4", "output": "6"},
    {"input": "5 5", "output": "10  \n\n"}]}
FUNCTIONAL = {"id": "c2", "domain": "code", "fn_name": "twoSum", "tests": json.dumps([
    {"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"},
    {"input": "[3, 2, 4]\n6", "output": "[1, 2]", "testtype": "functional"}])}
ADD = "a, b = map(int, input().split())\nprint(a + b)"
TWO_SUM = """class Solution:
    def twoSum(self, nums, target):
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return [seen[target - x], i]
            seen[x] = i
"""


def fenced(code, lang="python"):
    return f"Here you go:\n```{lang}\n{code}\n```\nDone."


def test_extract_code():
    assert extract_code(fenced("print(1)")) == "print(1)\n"
    assert extract_code("```python\nx=1\n```\n```python\nx=2\n```") == "x=2\n"
    assert extract_code("```python\nx=1\n```\n```text\nhello\n```") == "x=1\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("print(4)") == "print(4)"
    assert extract_code("```python\nprint(5)") == "print(5)"
    assert extract_code("   \n") is None


def test_stdio_right_and_wrong():
    good = score_code(fenced(ADD), STDIO, sandbox=SANDBOX)
    assert good.score == 1.0 and good.details["pass_fraction"] == 1.0
    bad = score_code(fenced("a, b = map(int, input().split())\nprint(a + b if a < 9 else 0)"),
                     STDIO, sandbox=SANDBOX)
    assert bad.score == 0.0
    assert bad.details["passed"] == 2 and bad.details["pass_fraction"] == pytest.approx(2 / 3)
    assert bad.feedback == "Wrong answer on test 2.\nInput:\n10 -4\nExpected:\n6\nGot:\n0"


def test_functional_solution_class_and_top_level_function():
    assert score_code(fenced(TWO_SUM), FUNCTIONAL, sandbox=SANDBOX).score == 1.0
    top = "def twoSum(nums, target):\n    return [0, 1]"
    result = score_code(fenced(top), FUNCTIONAL, sandbox=SANDBOX)
    assert result.score == 0.0 and result.details["passed"] == 1
    assert "Expected:\n[1, 2]\nGot:\n[0, 1]" in result.feedback


def test_functional_missing_function():
    result = score_code(fenced("def other():\n    pass"), FUNCTIONAL, sandbox=SANDBOX)
    assert result.score == 0.0 and "'twoSum' is not defined" in result.feedback


@pytest.mark.parametrize("code,fragment", [
    ("def f(:\n  pass", "does not compile"),
    ("print(1/0)", "ZeroDivisionError: division by zero"),
    ("import sys\nsys.exit(3)", "Runtime error on test 1"),
    ("while True:\n    pass", "Time limit exceeded (1 s) on test 1"),
])
def test_feedback_kinds(code, fragment):
    result = score_code(fenced(code), STDIO, sandbox=SANDBOX)
    assert result.score == 0.0
    assert fragment in result.feedback, result.feedback
    assert "sandbox_runner" not in result.feedback  # harness frames are not the model's


def test_timeout_skips_remaining_cases():
    start = time.monotonic()
    result = score_code(fenced("while True:\n    pass"), STDIO, sandbox=SANDBOX)
    assert result.details["statuses"] == ["timeout", "skipped", "skipped"]
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("response", ["", "```python\n```", "   "])
def test_format_error(response):
    result = score_code(response, STDIO, sandbox=SANDBOX)
    assert result.score == 0.0 and result.feedback.startswith("Format error")


def test_bad_records_raise_data_error():
    with pytest.raises(DataError, match="fn_name"):
        score_code("print(1)", {"id": "x", "tests": [{"input": "", "output": "",
                                                      "testtype": "functional"}]})
    with pytest.raises(DataError, match="no code tests"):
        score_code("print(1)", {"id": "x", "tests": []})


@pytest.mark.skipif(sb.isolation_mode() != "namespaces", reason="needs namespace isolation")
def test_score_batch_batched_matches_unbatched():
    responses = [fenced(ADD), fenced("print(0)"), "no code at all?", fenced(TWO_SUM)]
    records = [STDIO, STDIO, STDIO, FUNCTIONAL]
    plain = score_batch("code", responses, records)
    batched = score_batch("code", responses, records, batched_code=True)
    assert [r.score for r in plain] == [1.0, 0.0, 0.0, 1.0]
    assert [(r.score, r.feedback) for r in plain] == [(r.score, r.feedback) for r in batched]


def test_adversarial_responses_do_not_raise():
    assert score("code", "```python\n" * 20_000, STDIO).score == 0.0
    assert score("code", b"\x00\xff\xfe" * 1000, STDIO).score == 0.0
    assert score("code", "x" * 60_000, STDIO).feedback.startswith("Format error")
