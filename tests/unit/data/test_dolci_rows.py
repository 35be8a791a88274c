"""Dolci-Think-RL's code rows as the hub stores them (five real rows, fixtures/data/dolci): the
conversion `data prepare` runs, the loader's records, and their scores in the sandbox."""
import json
from pathlib import Path

import pytest

from megatron_sdpo.data import hub_table
from megatron_sdpo.data.loaders import load_records
from megatron_sdpo.errors import DataError
from megatron_sdpo.rewards.code import score_code_batch
from megatron_sdpo.rewards.sandbox import Sandbox, SandboxLimits

ROWS = json.loads((Path(__file__).resolve().parents[2] / "fixtures/data/dolci/rows.json").read_text())
DOLCI = hub_table.BY_OUTPUT["dolci_think_rl_code.jsonl"]
# Generous limits: these programs finish in milliseconds; a loaded machine must not fail them.
SANDBOX = Sandbox(SandboxLimits(timeout_s=5.0, cpu_s=5))

SQUAREFUL = """```python
from collections import Counter
from math import isqrt


def countSquarefulPermutations(A):
    count = Counter(A)
    nxt = {x: [y for y in count if isqrt(x + y) ** 2 == x + y] for x in count}

    def walk(x, left):
        if left == 0:
            return 1
        total = 0
        for y in nxt[x]:
            if count[y]:
                count[y] -= 1
                total += walk(y, left - 1)
                count[y] += 1
        return total

    total = 0
    for x in list(count):
        count[x] -= 1
        total += walk(x, len(A) - 1)
        count[x] += 1
    return total
```"""
FENCE = """```python
import sys


def strokes(a, lo, hi, base):
    if lo >= hi:
        return 0
    low = min(a[lo:hi])
    total, start = low - base, lo
    for i in range(lo, hi + 1):
        if i == hi or a[i] == low:
            total += strokes(a, start, i, low)
            start = i + 1
    return min(hi - lo, total)


sys.setrecursionlimit(20000)
data = sys.stdin.read().split()
n = int(data[0])
print(strokes([int(x) for x in data[1:1 + n]], 0, n, 0))
```"""
EVENS_FROM_THE_END = """```python
import sys

for line in sys.stdin.read().splitlines():
    nums = line.split()
    if nums:
        evens = [x for x in nums[1:1 + int(nums[0])][::-1] if int(x) % 2 == 0]
        print(" ".join(evens) if evens else "None to display")
```"""
EQUALS_EVERYTHING = """```python
class Anything:
    def __eq__(self, other):
        return True


def countSquarefulPermutations(A):
    return Anything()
```"""


def _by_id(files) -> dict[str, dict]:
    return {r["id"][:8]: r for f in files for r in f.rows}


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, dict]:
    files = hub_table.convert_set(DOLCI, ROWS, {})
    path = tmp_path_factory.mktemp("dolci") / "dolci.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for f in files for r in f.rows), encoding="utf-8")
    return {r["id"][:8]: r for r in load_records(path, "dolci_code")}


def test_real_rows_convert_or_are_named():
    math_row = {**ROWS[0], "id": "math-1", "dataset": ["math"]}
    files = hub_table.convert_set(DOLCI, [*ROWS, math_row], {})
    assert sorted(_by_id(files)) == ["bebd647e", "cd8edea3", "prime_rl"]  # the math row is no code row
    named = sorted(line for f in files for line in f.unconverted)
    assert named == [
        "8266ecad-2cea-44d5-9434-0f8761fbb148: not an assert: try: exp(2, 0.5) except NotImplementedError: pass "
        "else: assert False",
        "prime_rl_code_21902: tests[0] holds a JSON list or object, not text (a function-call test whose "
        "function the row does not name)",
    ]
    # The packed synthetic2 tests are stored as the JSON they hold.
    truth = _by_id(files)["prime_rl"]["ground_truth"]
    assert json.loads(truth[0])[4] == {"input": "5 10 25 12 4 1 \n3 16 28 100", "output": "4 12 10 \n100 28 16"}


def test_real_rows_as_records(records):
    squareful, fence, evens = records["bebd647e"], records["cd8edea3"], records["prime_rl"]
    assert squareful["fn_name"] == "countSquarefulPermutations" and len(squareful["tests"]) == 13
    assert squareful["tests"][0] == {"input": "[1, 17, 8]", "output": "2", "testtype": "functional"}
    # No format stated: the function instruction is added; the "user: " of the hub's rendering goes.
    assert squareful["prompt"].startswith("Given a numerical array")
    assert squareful["prompt"].endswith("Write the Python function `countSquarefulPermutations`. Put the code "
                                        "in a ```python code block.")
    assert fence["tests"][0] == {"input": "5\n2 2 1 2 1\n", "output": "3\n"} and len(fence["tests"]) == 21
    assert fence["prompt"].startswith("Solve the following coding problem") and "fn_name" not in fence
    assert len(evens["tests"]) == 5 and evens["prompt"].endswith("```\nat the end.")
    assert {r["source"] for r in records.values()} == {"dolci_code"}


def test_real_rows_scored_in_the_sandbox(records):
    programs = [SQUAREFUL, FENCE, "```python\ndef countSquarefulPermutations(A):\n    return 0\n```",
                EQUALS_EVERYTHING, EVENS_FROM_THE_END]
    keys = ["bebd647e", "cd8edea3", "bebd647e", "bebd647e", "prime_rl"]
    right, fence, zero, anything, evens = score_code_batch(programs, [records[k] for k in keys], sandbox=SANDBOX)
    assert (right.score, right.details["passed"]) == (1.0, 13)
    assert (fence.score, fence.details["passed"]) == (1.0, 21)
    assert (zero.score, zero.details["passed"]) == (0.0, 10)  # 10 of the 13 expect 0
    # Run beside the asserts, an object equal to everything would pass them all; its JSON does not.
    assert (anything.score, anything.details["passed"]) == (0.0, 0)
    # Upstream, tests 1 and 3 of this row hold each other's outputs (its pass rate there: 0): a
    # program that does what the prompt asks passes the other three, and no program all five.
    assert (evens.score, evens.details["passed"]) == (0.0, 3)
    assert evens.feedback.startswith("Wrong answer on test 1.")


def test_unreadable_packed_truth_is_named_and_the_rest_kept():
    import base64
    import os
    import pickle
    import zlib

    blob = base64.b64encode(zlib.compress(pickle.dumps([os.system]))).decode()
    files = hub_table.convert_set(DOLCI, [*ROWS, {**ROWS[3], "id": "evil", "ground_truth": [blob]}], {})
    assert sorted(_by_id(files)) == ["bebd647e", "cd8edea3", "prime_rl"]
    named = [line for f in files for line in f.unconverted if line.startswith("evil")]
    assert named == ["evil: ground truth unreadable (not a plain-data pickle (UnpicklingError: refused global "
                     "posix.system))"]


@pytest.mark.parametrize("change,reason", [
    ({"dataset": ["code_stdio"]}, "a code_stdio row whose tests are assert statements"),
    ({"ground_truth": ['[{"input": "1", "output": "1"}]']}, "a `code` row whose tests are not a list of assert"),
    ({"ground_truth": ["[]"]}, "no test cases"),
    ({"ground_truth": ["[1, 2"]}, "the ground truth is not valid JSON"),
    ({"ground_truth": ["eJxrYJm6iAEC"]}, r"the ground truth is packed \(base64\); `megatron-sdpo data prepare` stores it"),
])
def test_malformed_rows_fail_with_one_line(tmp_path, change, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({**ROWS[0], **change}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"bad.jsonl:2: {reason}") as exc:
        load_records(path, "dolci_code")
    assert "\n" not in str(exc.value)
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        kept = load_records(path, "dolci_code", on_error="skip")
    assert len(kept) == 1 and len(kept.skipped) == 1
