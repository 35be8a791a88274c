"""Code verifier: run the response's program on the record's tests inside the sandbox.

Score 1 iff every test passes; details carry the pass fraction. Feedback (the SDPO teacher's
environment signal) is the first problem: format error, error trace, time-out, output limit,
or the first failing case with its input, expected and actual output.

Three kinds of test case (a record's cases are all of one kind):
- stdin (no `testtype`): the input is the program's stdin, its stdout is compared by line;
- `"testtype": "functional"`: the record's `fn_name` is called with the input's JSON values and
  its return value compared with the output's JSON (LiveCodeBench, MBPP);
- `"testtype": "code"`: the input is a test script (asserts, or any statements) run verbatim
  after the program in its globals; it passes if it runs to its end without raising, and the
  output is unused. The name and meaning are the reference's (lasgroup/SDPO: exec the program,
  then the test); Dolci-Think-RL's `code` rows are tested so. A failing script is named in the
  feedback. The script shares the program's interpreter, so a program that answers every `==`
  with True, or reads the runner's frames, can pass a verbatim assert: as with the reference's
  and the set builder's own runners, which do the same.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, cast

from megatron_sdpo.errors import DataError
from megatron_sdpo.rewards.process_wide import ProcessWide
from megatron_sdpo.rewards.result import RewardResult, clip_text
from megatron_sdpo.rewards.sandbox import CaseOutcome, Program, Sandbox

__all__ = ["extract_code", "score_code", "score_code_batch", "default_sandbox"]

_MAX_CODE_CHARS = 50_000
_FENCED = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_SHOW = 300  # characters of input / expected / got shown in feedback

_SANDBOX = ProcessWide(Sandbox)


def default_sandbox() -> Sandbox:
    """The process-wide sandbox with default limits (created on first use)."""
    return _SANDBOX.get()


def extract_code(response: str) -> str | None:
    """The last ```python fenced block, else the last fenced block of any language, else the
    whole response; None when that is empty."""
    blocks = _FENCED.findall(response)
    python_blocks = [body for lang, body in blocks if lang]
    if python_blocks:
        code = python_blocks[-1]
    elif blocks:
        code = blocks[-1][1]
    else:
        code = response
    return code if code.strip() else None


KINDS = ("stdin", "functional", "code")


def _kind(case: dict) -> str:
    kind = case.get("testtype") or "stdin"
    if kind not in KINDS:
        raise KeyError(f"testtype {kind!r} is none of {', '.join(KINDS)}")
    return str(kind)


def _tests(record: dict) -> tuple[list[dict], str | None]:
    tests = record.get("tests")
    try:
        if isinstance(tests, str):
            tests = json.loads(tests)
        # Not a list (None, a number): the iteration's TypeError names the record below.
        cases = [{"input": str(t["input"]), "output": str(t["output"]), "kind": _kind(t)} for t in cast(list, tests)]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise DataError(f"record {record.get('id')!r}: malformed code tests ({exc})") from None
    if not cases:
        raise DataError(f"record {record.get('id')!r}: no code tests")
    kinds = {c["kind"] for c in cases}
    if len(kinds) > 1:
        raise DataError(f"record {record.get('id')!r}: mixes {' and '.join(sorted(kinds))} tests")
    functional = cases[0]["kind"] == "functional"
    fn_name = record.get("fn_name") if functional else None
    if functional and not fn_name:
        raise DataError(f"record {record.get('id')!r}: functional tests need 'fn_name'")
    return cases, fn_name


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    return a == b


def _passed(case: dict, outcome: CaseOutcome) -> bool:
    if outcome.status != "ok":
        return False
    if case["kind"] == "code":
        return True  # the script ran to its end (the runner checks it did run)
    if case["kind"] == "stdin":
        return _lines(outcome.stdout) == _lines(case["output"])
    try:
        return _values_equal(json.loads(outcome.result or ""), json.loads(case["output"]))
    except ValueError:
        return False


def _trace_tail(stderr: str, n: int = 6) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def _feedback(index: int, case: dict, outcome: CaseOutcome, timeout_s: float) -> str:
    where = f"test {index + 1}"
    shown_input = clip_text(case["input"], _SHOW)
    if outcome.status == "refused":
        return outcome.stderr
    if case["kind"] == "code":
        return _script_feedback(where, shown_input, outcome, timeout_s)
    stopped = _stopped(where, outcome, timeout_s)
    if stopped is not None:
        return f"{stopped}\nInput:\n{shown_input}" if outcome.status == "timeout" else stopped
    if outcome.status == "error":
        tail = _trace_tail(outcome.stderr)
        if "SyntaxError" in tail or "IndentationError" in tail:
            return f"The program does not compile:\n{tail}"
        return f"Runtime error on {where}:\n{tail}\nInput:\n{shown_input}"
    got = outcome.result if case["kind"] == "functional" else outcome.stdout
    return (
        f"Wrong answer on {where}.\nInput:\n{shown_input}\n"
        f"Expected:\n{clip_text(case['output'].strip(), _SHOW)}\n"
        f"Got:\n{clip_text((got or '').strip(), _SHOW)}"
    )


def _stopped(where: str, outcome: CaseOutcome, timeout_s: float) -> str | None:
    """The line for a case the sandbox stopped (time, output, a signal); None otherwise."""
    if outcome.status == "timeout":
        return f"Time limit exceeded ({timeout_s:g} s) on {where}."
    if outcome.status == "output_limit":
        return f"Output limit exceeded on {where}."
    if outcome.status == "signal":
        return f"The program was killed by signal {outcome.signal} on {where}."
    return None


def _script_feedback(where: str, shown_test: str, outcome: CaseOutcome, timeout_s: float) -> str:
    """A failed test script, named by its number and its source (the trace says how it failed)."""
    test = f"Test:\n{shown_test}"
    stopped = _stopped(where, outcome, timeout_s)
    if stopped is not None:
        return f"{stopped}\n{test}"
    tail = _trace_tail(outcome.stderr)
    if 'File "solution.py"' in outcome.stderr and 'File "test.py"' not in outcome.stderr:
        if "SyntaxError" in tail or "IndentationError" in tail:
            return f"The program does not compile:\n{tail}"
        return f"The program failed before {where} ran:\n{tail}"
    return f"Failed {where}.\n{test}\n{tail or 'It raised no error but did not run to its end.'}"


def _result(cases: list[dict], outcomes: list[CaseOutcome], timeout_s: float) -> RewardResult:
    passed = [_passed(c, o) for c, o in zip(cases, outcomes, strict=True)]
    details = {
        "passed": sum(passed),
        "total": len(cases),
        "pass_fraction": sum(passed) / len(cases),
        "statuses": [o.status for o in outcomes],
    }
    if all(passed):
        return RewardResult(1.0, f"All {len(cases)} tests passed.", details)
    first = passed.index(False)
    return RewardResult(0.0, _feedback(first, cases[first], outcomes[first], timeout_s), details)


def score_code_batch(
    responses: list[str], records: list[dict], *, sandbox: Sandbox | None = None, batched: bool = False
) -> list[RewardResult]:
    """Score many responses; with `batched` all programs share one sandbox process (cheaper,
    see Sandbox.run_batch), otherwise each gets its own."""
    if len(responses) != len(records):
        raise ValueError(f"{len(responses)} responses but {len(records)} records")
    sandbox = sandbox or default_sandbox()
    results: list[RewardResult | None] = [None] * len(responses)
    jobs: list[tuple[int, list[dict], Program]] = []
    for i, (response, record) in enumerate(zip(responses, records, strict=True)):
        cases, fn_name = _tests(record)
        code = extract_code(response)
        if code is None:
            results[i] = RewardResult(
                0.0, "Format error: no Python code found in the response.", {"error": "no_code", "pass_fraction": 0.0}
            )
        elif len(code) > _MAX_CODE_CHARS:
            results[i] = RewardResult(
                0.0,
                f"Format error: the program is longer than {_MAX_CODE_CHARS} characters.",
                {"error": "too_long", "pass_fraction": 0.0},
            )
        elif "\x00" in code:
            results[i] = RewardResult(
                0.0, "Format error: the program contains NUL bytes.", {"error": "binary", "pass_fraction": 0.0}
            )
        else:
            jobs.append(
                (i, cases, Program(code, [c["input"] for c in cases], fn_name, scripts=cases[0]["kind"] == "code"))
            )
    if jobs:
        # A SandboxError (the sandbox itself broke) propagates: it is never the model's fault.
        outcomes = sandbox.run_batch([p for _, _, p in jobs], batched=batched)
        for (i, cases, _), program_outcomes in zip(jobs, outcomes, strict=True):
            results[i] = _result(cases, program_outcomes, sandbox.limits.timeout_s)
    return results  # type: ignore[return-value]


def score_code(response: str, record: dict, *, sandbox: Sandbox | None = None) -> RewardResult:
    """Score one response; see score_code_batch."""
    return score_code_batch([response], [record], sandbox=sandbox)[0]
