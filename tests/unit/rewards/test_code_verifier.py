import json
import time

import pytest

from megatron_sdpo.errors import DataError
from megatron_sdpo.rewards import sandbox as sb
from megatron_sdpo.rewards import score, score_batch
from megatron_sdpo.rewards.code import extract_code, score_code, score_code_batch
from megatron_sdpo.rewards.sandbox import Sandbox, SandboxLimits

SANDBOX = Sandbox(SandboxLimits(timeout_s=1.0, cpu_s=1))
STDIO = {
    "id": "c1",
    "domain": "code",
    "tests": [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "10 -4", "output": "6"},
        {"input": "5 5", "output": "10  \n\n"},
    ],
}
FUNCTIONAL = {
    "id": "c2",
    "domain": "code",
    "fn_name": "twoSum",
    "tests": json.dumps(
        [
            {"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"},
            {"input": "[3, 2, 4]\n6", "output": "[1, 2]", "testtype": "functional"},
        ]
    ),
}
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
    bad = score_code(fenced("a, b = map(int, input().split())\nprint(a + b if a < 9 else 0)"), STDIO, sandbox=SANDBOX)
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


@pytest.mark.parametrize(
    "code,fragment",
    [
        ("def f(:\n  pass", "does not compile"),
        ("print(1/0)", "ZeroDivisionError: division by zero"),
        ("import sys\nsys.exit(3)", "Runtime error on test 1"),
        ("while True:\n    pass", "Time limit exceeded (1 s) on test 1"),
    ],
)
def test_feedback_kinds(code, fragment):
    result = score_code(fenced(code), STDIO, sandbox=SANDBOX)
    assert result.score == 0.0
    assert fragment in result.feedback, result.feedback
    assert "sandbox_runner" not in result.feedback  # harness frames are not the model's


def test_timeout_skips_remaining_cases():
    # "skipped" cases never ran (the runner marks them without forking). The limit is CPU time,
    # so the wall time this takes grows with the machine's load and is not bounded here.
    sandbox = Sandbox(SandboxLimits(timeout_s=0.5, cpu_s=1))
    start = time.process_time()
    result = score_code(fenced("while True:\n    pass"), STDIO, sandbox=sandbox)
    assert result.details["statuses"] == ["timeout", "skipped", "skipped"]
    assert result.feedback.startswith("Time limit exceeded (0.5 s) on test 1.")
    assert time.process_time() - start < 0.5  # the loop's CPU is the sandbox's, not this process's


@pytest.mark.parametrize("response", ["", "```python\n```", "   "])
def test_format_error(response):
    result = score_code(response, STDIO, sandbox=SANDBOX)
    assert result.score == 0.0 and result.feedback.startswith("Format error")


def test_bad_records_raise_data_error():
    with pytest.raises(DataError, match="fn_name"):
        score_code("print(1)", {"id": "x", "tests": [{"input": "", "output": "", "testtype": "functional"}]})
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


# Test scripts (`"testtype": "code"`): run verbatim after the program, one per case.
SCRIPTS = {
    "id": "c3",
    "domain": "code",
    "tests": [
        {"input": "assert exp(2, 3) == 8", "output": "", "testtype": "code"},
        {
            "input": "from datetime import date\nassert shift(date(2024, 1, 31)) == date(2024, 2, 1)",
            "output": "",
            "testtype": "code",
        },
        {
            "input": "try:\n    exp(2, 0.5)\nexcept NotImplementedError:\n    pass\nelse:\n    assert False",
            "output": "",
            "testtype": "code",
        },
    ],
}
EXP = """import datetime


def exp(a, b):
    if b != int(b):
        raise NotImplementedError("integer exponents only")
    out = 1
    for _ in range(int(b)):
        out *= a
    return out


def shift(d):
    return d + datetime.timedelta(days=1)
"""


def test_scripts_pass_when_they_run_to_their_end():
    result = score_code(fenced(EXP), SCRIPTS, sandbox=SANDBOX)
    assert (result.score, result.details["statuses"]) == (1.0, ["ok", "ok", "ok"]), result.feedback


@pytest.mark.parametrize(
    "changes,passed,feedback",
    [
        # The try/except script fails by its `else: assert False`: the failing script is shown.
        (
            [('raise NotImplementedError("integer exponents only")', "return 1.4142")],
            2,
            "Failed test 3.\nTest:\ntry:\n    exp(2, 0.5)\nexcept NotImplementedError:\n    pass\nelse:\n   "
            " assert False\n"
            'Traceback (most recent call last):\n  File "test.py", line 6, in <module>\n    assert '
            "False\nAssertionError",
        ),
        ([("days=1", "days=2")], 2, "Failed test 2.\nTest:\nfrom datetime import date\n"),
        # Exiting with status 0 before the script runs does not pass it.
        ([("import datetime", "import os\nos._exit(0)")], 0, "The program ended (exit status 0) before the test ran."),
        # Neither does making the scripts no-ops: the runner bound exec and compile before the program
        # ran, so the wrong exp still fails test 1 (tests 2 and 3 do not meet the change: they pass).
        (
            [
                ("out = 1", "return 0"),
                (
                    "import datetime",
                    "import builtins, datetime\nbuiltins.exec = builtins.compile = lambda *a, **k: None",
                ),
            ],
            2,
            "Failed test 1.",
        ),
        ([("import datetime", "import datetime\nraise KeyError('x')")], 0, "The program failed before test 1 ran:"),
    ],
)
def test_scripts_fail_and_name_the_failing_one(changes, passed, feedback):
    program = EXP
    for old, new in changes:
        program = program.replace(old, new)
    assert program != EXP
    result = score_code(fenced(program), SCRIPTS, sandbox=SANDBOX)
    assert result.score == 0.0 and result.details["passed"] == passed, result.feedback
    assert feedback in result.feedback, result.feedback


def test_scripts_get_no_stdin_and_do_not_run_main_blocks():
    main = "import sys\nif __name__ == '__main__':\n    sys.exit(3)\nDATA = sys.stdin.read()\n"
    record = {
        "id": "c4",
        "tests": [{"input": "assert DATA == '' and __name__ == 'solution'", "output": "", "testtype": "code"}],
    }
    assert score_code(fenced(main), record, sandbox=SANDBOX).score == 1.0


def test_mixed_or_unknown_test_kinds_are_refused():
    mixed = {"id": "m", "tests": [SCRIPTS["tests"][0], {"input": "1", "output": "1"}]}
    with pytest.raises(DataError, match="mixes code and stdin tests"):
        score_code(fenced(EXP), mixed, sandbox=SANDBOX)
    with pytest.raises(DataError, match="testtype 'assert' is none of"):
        score_code(
            fenced(EXP), {"id": "u", "tests": [{"input": "", "output": "", "testtype": "assert"}]}, sandbox=SANDBOX
        )


def test_time_is_judged_on_cpu_time_of_the_whole_process_tree():
    # Sleeping uses no CPU: within the wall backstop it passes, past it it times out.
    sleepy = "import time\ntime.sleep(1.5)\nprint(3)"
    assert (
        score_code(fenced(sleepy), {"id": "s", "tests": [{"input": "", "output": "3"}]}, sandbox=SANDBOX).score == 1.0
    )
    short = Sandbox(SandboxLimits(timeout_s=1.0, cpu_s=1, wall_factor=1.2))
    slept = score_code(fenced(sleepy), {"id": "s", "tests": [{"input": "", "output": "3"}]}, sandbox=short)
    assert slept.details["statuses"] == ["timeout"]
    # Four busy workers share the limit: their summed CPU time is judged, so the case stops soon
    # after 1 s of CPU in all. RLIMIT_CPU alone is per process: each worker would get its own
    # second (4 s and more in all), and the 10 s wall backstop would end them.
    workers = (
        "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        while True:\n"
        "            pass\ntime.sleep(30)\n"
    )
    outcome = SANDBOX.run(sb.Program(workers, [""]))[0]
    assert outcome.status == "timeout" and 1.0 < outcome.cpu_s < 3.0, outcome


def test_scripts_and_stdin_programs_share_a_batched_sandbox():
    square = {
        "id": "sq",
        "tests": [
            {"input": "assert f(2) == 4", "output": "", "testtype": "code"},
            {"input": "assert f(3) == 9", "output": "", "testtype": "code"},
        ],
    }
    stdin = {"id": "in", "tests": [{"input": "3\n", "output": "9\n"}]}
    responses = [
        fenced("def f(x):\n    return x * x"),
        fenced("print(int(input()) ** 2)"),
        fenced("def f(x):\n    return x + x"),
    ]
    for batched in (False, True):
        results = score_code_batch(responses, [square, stdin, square], sandbox=SANDBOX, batched=batched)
        assert [(r.score, r.details["statuses"]) for r in results] == [
            (1.0, ["ok", "ok"]),
            (1.0, ["ok"]),
            (0.0, ["ok", "error"]),
        ], batched
