"""Dolci-Think-RL's code rows as the hub stores them (seven real rows, fixtures/data/dolci): the
conversion `data prepare` runs, the loader's records, and their scores in the sandbox."""

import base64
import json
import os
import pickle
import zlib
from pathlib import Path

import pytest

from megatron_sdpo.data import dolci_rows, hub_table
from megatron_sdpo.data.code_tests import Unconvertible
from megatron_sdpo.data.loaders import CODE_SCRIPT_INSTRUCTION, CODE_STDIN_INSTRUCTION, load_records
from megatron_sdpo.errors import DataError
from megatron_sdpo.rewards.code import score_code_batch
from megatron_sdpo.rewards.sandbox import Sandbox, SandboxLimits

ROWS = json.loads((Path(__file__).resolve().parents[2] / "fixtures/data/dolci/rows.json").read_text())
BY_ID = {r["id"][:8]: r for r in ROWS}
DOLCI = hub_table.BY_OUTPUT["dolci_think_rl_code.jsonl"]
# These programs need milliseconds of CPU; the limit is CPU time, so load cannot fail them.
SANDBOX = Sandbox(SandboxLimits(timeout_s=2.0, cpu_s=2))

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
EXP = """```python
def exp(a, b):
    if b != int(b):
        raise NotImplementedError("only whole exponents")
    b = int(b)
    if b < 0:
        return 0 if a == 0 else round(1 / exp(a, -b))
    out = 1
    for _ in range(b):
        out *= a
    return out
```"""
ANU = """```python
def maximize_array_value(a):
    for bit in range(30, -1, -1):
        holders = [i for i, x in enumerate(a) if x >> bit & 1]
        if len(holders) == 1:
            i = holders[0]
            return [a[i]] + a[:i] + a[i + 1:]
    return list(a)
```"""
STEPAN = """```python
def repair_favorite_string(n, c):
    c = list(c) + [0]
    at_least = [c[i] - c[i + 1] for i in range(n)] + [0]  # runs of length >= i + 1
    out = []
    for length in range(n, 0, -1):
        for _ in range(at_least[length - 1] - at_least[length]):  # runs of exactly this length
            out.append(chr(ord("a") + len(out) % 26) * length)
    return "".join(out)
```"""
EQUALS_EVERYTHING = """```python
class Anything:
    def __eq__(self, other):
        return True


def countSquarefulPermutations(A):
    return Anything()
```"""


WRONG = {
    "bebd647e": "```python\ndef countSquarefulPermutations(A):\n    return 0\n```",
    "8266ecad": "```python\ndef exp(a, b):\n    return a ** b\n```",
    "d4bfea1d": "```python\ndef maximize_array_value(a):\n    return sorted(a)\n```",
    "09a76a68": "```python\ndef repair_favorite_string(n, c):\n    return 'a' * n\n```",
    "cd8edea3": "```python\nprint(input())\n```",
}
RIGHT = {"bebd647e": SQUAREFUL, "8266ecad": EXP, "d4bfea1d": ANU, "09a76a68": STEPAN, "cd8edea3": FENCE}


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
    assert sorted(_by_id(files)) == ["09a76a68", "8266ecad", "bebd647e", "cd8edea3", "d4bfea1d", "prime_rl"]
    named = [line for f in files for line in f.unconverted]
    assert named == [f"prime_rl_code_21902: {dolci_rows.LIST_TYPED}"]  # the math row is no code row
    # The packed SYNTHETIC-2 tests are stored as the JSON they hold; the try/except script verbatim.
    rows = _by_id(files)
    assert json.loads(rows["prime_rl"]["ground_truth"][0])[4] == {
        "input": "5 10 25 12 4 1 \n3 16 28 100",
        "output": "4 12 10 \n100 28 16",
    }
    assert json.loads(rows["8266ecad"]["ground_truth"][0]) == json.loads(BY_ID["8266ecad"]["ground_truth"][0])


@pytest.mark.parametrize(
    "key,encoding", [("bebd647e", "json"), ("cd8edea3", "json"), ("prime_rl", "base64-zlib-pickle")]
)
def test_encodings_are_named(key, encoding):
    assert dolci_rows.tests_of(BY_ID[key]["ground_truth"], packed=True)[1] == encoding
    with pytest.raises(Unconvertible, match="data prepare"):
        dolci_rows.tests_of(ROWS[-1]["ground_truth"], packed=False)


def test_real_rows_as_records(records):
    scripts, fence, evens = records["8266ecad"], records["cd8edea3"], records["prime_rl"]
    # Each snippet is one case, verbatim; the multi-line try/except one too.
    assert len(scripts["tests"]) == 15 and all(t["testtype"] == "code" for t in scripts["tests"])
    assert scripts["tests"][13]["input"] == (
        "try:\n    exp(2, 0.5)\nexcept NotImplementedError:\n    pass\nelse:\n    assert False"
    )
    assert fence["tests"][0] == {"input": "5\n2 2 1 2 1\n", "output": "3\n"} and len(fence["tests"]) == 21
    assert len(evens["tests"]) == 5 and "fn_name" not in fence and "fn_name" not in scripts
    # The "user: " of the hub's rendering goes; one instruction follows, chosen by dataset[0].
    assert scripts["prompt"].startswith("Write a Python function exp(a, b)")
    assert scripts["prompt"].endswith("\n\n" + CODE_SCRIPT_INSTRUCTION)
    assert fence["prompt"].startswith("Solve the following coding problem")
    assert fence["prompt"].endswith("Now solve the problem and return the code.\n\n" + CODE_STDIN_INSTRUCTION)
    assert evens["prompt"].endswith("```\nat the end.\n\n" + CODE_STDIN_INSTRUCTION)
    assert {r["source"] for r in records.values()} == {"dolci_code"}
    assert scripts["original_dataset"] == "hamishivi/llama-nemotron-rlvr-difficulty-7_filtered"


def test_the_instruction_follows_dataset0_not_the_text(tmp_path):
    # A `code` row whose text speaks of stdin and fences still gets the script instruction, and
    # a `code_stdio` row asking for a function the stdin one.
    code = {**BY_ID["bebd647e"], "prompt": "user: Read stdin. ```python``` Write a function f."}
    stdio = {**BY_ID["cd8edea3"], "prompt": "user: Write a Python function `f`."}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(code) + "\n" + json.dumps(stdio) + "\n", encoding="utf-8")
    code_rec, stdio_rec = load_records(path, "dolci_code")
    assert code_rec["prompt"] == "Read stdin. ```python``` Write a function f.\n\n" + CODE_SCRIPT_INSTRUCTION
    assert stdio_rec["prompt"] == "Write a Python function `f`.\n\n" + CODE_STDIN_INSTRUCTION


def test_real_rows_scored_in_the_sandbox(records):
    keys = list(RIGHT)
    right = score_code_batch([RIGHT[k] for k in keys], [records[k] for k in keys], sandbox=SANDBOX)
    wrong = score_code_batch([WRONG[k] for k in keys], [records[k] for k in keys], sandbox=SANDBOX)
    assert [r.score for r in right] == [1.0] * len(keys), [r.feedback for r in right]
    assert [r.details["passed"] for r in right] == [13, 15, 9, 10, 21]
    assert [r.score for r in wrong] == [0.0] * len(keys)
    # a ** b fails exp(5, -2) == 0 first (0.04), and the try/except script (no error raised).
    exp = wrong[1]
    assert exp.feedback.startswith("Failed test 2.\nTest:\nassert exp(5, -2) == 0\n")
    assert exp.details["statuses"][13] == "error"


def test_an_object_equal_to_everything_passes_verbatim_asserts(records):
    # The price of running the row's asserts as written (the reference and the set's builder do
    # the same): an `==` that always says True passes a bare `assert f(x) == y`. The snippets
    # that use the value otherwise (len, set, a loop over it) still fail it.
    scores = score_code_batch([EQUALS_EVERYTHING], [records["bebd647e"]], sandbox=SANDBOX)
    assert scores[0].score == 1.0
    anything = (
        "```python\nclass Any:\n    def __eq__(self, other):\n        return True\n\n\n"
        "def repair_favorite_string(n, c):\n    return Any()\n```"
    )
    stepan = score_code_batch([anything], [records["09a76a68"]], sandbox=SANDBOX)[0]
    assert stepan.score == 0.0 and stepan.details["passed"] == 0


def test_the_misaligned_synthetic2_row_converts_but_no_program_passes_it(records):
    # Upstream, tests 1 and 3 of prime_rl_code_18280 hold each other's outputs (pass rate 0
    # there): a program that does what the prompt asks passes the other three. A conversion
    # fixture only.
    evens = score_code_batch([EVENS_FROM_THE_END], [records["prime_rl"]], sandbox=SANDBOX)[0]
    assert (evens.score, evens.details["passed"]) == (0.0, 3)
    assert evens.feedback.startswith("Wrong answer on test 1.")


def test_unreadable_packed_truth_is_named_and_the_rest_kept():
    blob = base64.b64encode(zlib.compress(pickle.dumps([os.system]))).decode()
    files = hub_table.convert_set(DOLCI, [*ROWS, {**ROWS[-2], "id": "evil", "ground_truth": [blob]}], {})
    assert len(_by_id(files)) == 6
    named = [line for f in files for line in f.unconverted if line.startswith("evil")]
    assert named == [
        "evil: the ground truth is unreadable (not a plain-data pickle (UnpicklingError: refused global posix.system))"
    ]


def test_caps_drop_what_no_program_can_pass_and_bound_a_row():
    small = {"input": "1\n", "output": "1\n"}
    huge_out = {"input": "x", "output": "y" * (dolci_rows.MAX_OUTPUT_CHARS + 1)}
    big = {"input": "z" * (dolci_rows.MAX_TESTS_BYTES // 3), "output": ""}
    kept, over_output, over_bytes = dolci_rows.capped([small, huge_out, big, big, big, small])
    # 1 + 3 * (cap // 3) bytes would pass the cap: the third big case and what follows go.
    assert kept == [small, big, big] and (over_output, over_bytes) == (1, 2)
    assert dolci_rows.capped([small]) == ([small], 0, 0)


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"dataset": ["code_stdio"]}, "a `code_stdio` row whose tests are test scripts"),
        (
            {"ground_truth": ['[{"input": "1", "output": "1"}]']},
            "a `code` row whose tests are not a list of test scripts",
        ),
        ({"ground_truth": ['["assert f(1)", "  "]']}, r"an empty test script \(it would pass any program\)"),
        ({"ground_truth": ["[]"]}, "no test cases"),
        ({"ground_truth": ["[1, 2"]}, "the ground truth is not valid JSON"),
        (
            {"ground_truth": ["eJxrYJm6iAEC"]},
            r"the ground truth is packed \(base64\); `megatron-sdpo data prepare` stores it",
        ),
        ({"dataset": ["math"]}, "dataset 'math' is not a code verifier"),
    ],
)
def test_malformed_rows_fail_with_one_line(tmp_path, change, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({**ROWS[0], **change}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"bad.jsonl:2: {reason}") as exc:
        load_records(path, "dolci_code")
    assert "\n" not in str(exc.value)
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        kept = load_records(path, "dolci_code", on_error="skip")
    assert len(kept) == 1 and len(kept.skipped) == 1
