"""Code rows of allenai/Dolci-Think-RL-7B as the hub stores them, converted one row at a time
(real rows with their provenance: tests/fixtures/data/dolci/).

- `dataset` is a one-element list naming the row's verifier: "code" or "code_stdio" (any other
  label: not a code row). `dataset[0]` decides how the tests are read and run, and which
  instruction the prompt gets (loaders._dolci_code).
- `ground_truth` is a one-element list holding the serialized tests: a JSON array, or (the
  SYNTHETIC-2 rows) base64(zlib(pickle(list))), read as plain data only (packed_tests: no global
  is resolved).
- `prompt` is one string, "user: " + the problem; the prefix is dropped.

`code` rows hold Python test snippets (mostly one assert; also multi-statement scripts and
try / except blocks). Each runs verbatim after the program as one test case, `"testtype":
"code"` (rewards/code.py: it passes when it runs to its end), as the set's builder ran them.
`code_stdio` rows hold {input, output} pairs fed to stdin (the KlearReasoner rows add
`"type": "code"`, which does not mean scripts). A pair whose input or output is a list is a
function-call test whose function the row does not name: no stdin grader can score it (its pass
rate upstream is 0), so the row is refused with LIST_TYPED.

Rows without a Dolci label keep this project's older layout (MBPP / HumanEval from `data local`,
hand-made files): `tests` or `ground_truth` as {input, output[, testtype]} pairs or
{"inputs": [...], "outputs": [...]}, and `fn_name` for functional cases.
"""

from __future__ import annotations

import json
from typing import Any

from megatron_sdpo.data.code_tests import Unconvertible
from megatron_sdpo.data.packed_tests import PICKLE_OPCODE, PackedError, load_plain, unpack
from megatron_sdpo.rewards.sandbox import SandboxLimits

CODE, CODE_STDIO = "code", "code_stdio"
CODE_LABELS = (CODE, CODE_STDIO)
_USER_TURN = "user: "
LIST_TYPED = "list-typed test cases (function-call tests that name no function: no stdin grader can score them)"

# Per row, what `data prepare` keeps of its tests. A stdin case whose expected output is longer
# than the sandbox keeps of a program's stdout can never pass, so it is dropped. The tests kept
# are the longest first run of the row's cases within MAX_TESTS_BYTES (UTF-8 of inputs, outputs
# and scripts): the trainer holds every record of the file in memory, and one KlearReasoner row
# can hold several MB. The manifest counts the rows either rule changes.
MAX_OUTPUT_CHARS = SandboxLimits().output_chars
MAX_TESTS_BYTES = 1 << 20


def label(row: dict) -> str | None:
    """The row's verifier, `dataset[0]` ("code", "code_stdio", another set's label), or None
    for a row of the older layout (no list, or a string that is no Dolci code label)."""
    value = row.get("dataset")
    if isinstance(value, list):
        return value[0] if value and isinstance(value[0], str) else None
    return value if value in CODE_LABELS else None


def is_code(row: dict) -> bool:
    return label(row) in CODE_LABELS


def prompt_text(text: str) -> str:
    return text[len(_USER_TURN) :] if text.startswith(_USER_TURN) else text


def _unwrapped(value: Any) -> Any:
    """The one element of a hub row's ground-truth list; any other value as it is."""
    return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) else value


def tests_of(value: Any, *, packed: bool) -> tuple[Any, str]:
    """(the decoded tests, their encoding) of a `ground_truth` / `tests` value: "json" (a JSON
    string, or the one of a hub row's list), "base64-zlib-pickle" / "base64-zlib-json" (with
    `packed`; else refused, naming `data prepare`, which stores them as JSON) or "data"."""
    value = _unwrapped(value)
    if not isinstance(value, str):
        return value, "data"
    text = value.strip()
    if text[:1] in ("[", "{"):
        try:
            return json.loads(text), "json"
        except json.JSONDecodeError as exc:
            raise Unconvertible(f"the ground truth is not valid JSON: {exc.msg}") from None
    if not text:
        raise Unconvertible("no test cases")
    if not packed:
        raise Unconvertible(
            "the ground truth is packed (base64); `megatron-sdpo data prepare` stores it as the JSON it holds"
        )
    try:
        raw = unpack(text)
        if raw.startswith(PICKLE_OPCODE):
            return load_plain(raw), "base64-zlib-pickle"
        return json.loads(raw.decode("utf-8")), "base64-zlib-json"
    except PackedError as exc:
        raise Unconvertible(f"the ground truth is unreadable ({exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise Unconvertible("the ground truth unpacks to neither a pickle nor JSON") from None


def _pairs(value: dict) -> list[dict]:
    inputs, outputs = value.get("inputs"), value.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise Unconvertible("'tests.inputs' and 'tests.outputs' must be lists of equal length")
    return [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]


def _scripts(tests: list[str]) -> list[dict]:
    if any(not t.strip() for t in tests):
        raise Unconvertible("an empty test script (it would pass any program)")
    return [{"input": t, "output": "", "testtype": "code"} for t in tests]


def cases(row: dict, tests: Any) -> list[dict]:
    """The row's test cases from its decoded tests, read as `dataset[0]` says; Unconvertible
    with the reason when they do not fit it."""
    which = label(row)
    if isinstance(tests, dict) and "inputs" in tests and which != CODE:
        tests = _pairs(tests)
    if not isinstance(tests, list) or not tests:
        raise Unconvertible("no test cases" if tests in ([], {}, None) else "the tests are not a list")
    scripts = all(isinstance(t, str) for t in tests)
    if which == CODE:
        if not scripts:
            raise Unconvertible("a `code` row whose tests are not a list of test scripts")
        return _scripts(tests)
    if scripts:
        if which == CODE_STDIO:
            raise Unconvertible("a `code_stdio` row whose tests are test scripts, not stdin pairs")
        return _scripts(tests)  # the older layout: a list of snippets runs as scripts too
    if which == CODE_STDIO:
        if not all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
            raise Unconvertible("a `code_stdio` row whose tests are not {input, output} pairs")
        if any(isinstance(t[k], (list, dict)) for t in tests for k in ("input", "output")):
            raise Unconvertible(LIST_TYPED)
        if not all(isinstance(t[k], str) for t in tests for k in ("input", "output")):
            raise Unconvertible("a `code_stdio` row whose inputs or outputs are not text")
        return [{"input": t["input"], "output": t["output"]} for t in tests]  # "type" says nothing
    return tests


SCRIPTS, STDIN = "scripts", "stdin"


def instruction(which: str | None, found: list[dict]) -> str | None:
    """The instruction that follows the problem (SCRIPTS, STDIN, or None: the prompt as
    written), chosen by the row's verifier, `dataset[0]`, never by its text. Dolci's texts were
    written for other pipelines and state the contract unevenly (an AceCoder row names its
    function but not that tests call it, a KlearReasoner row ends "The input will be stdin...",
    a SYNTHETIC-2 row asks for a fenced block), while the verifier runs what dataset[0] says.
    Rows of the older layout follow their cases: scripts and stdin pairs get the same
    instructions; functional rows (MBPP, HumanEval from `data local`) are kept as written, their
    prompts carry this project's instruction."""
    kind = found[0].get("testtype")
    if which == CODE or (which is None and kind == "code"):
        return SCRIPTS
    if which == CODE_STDIO or (which is None and kind is None):
        return STDIN
    return None


def _size(case: dict) -> int:
    return len(case["input"].encode("utf-8")) + len(case["output"].encode("utf-8"))


def capped(found: list[dict]) -> tuple[list[dict], int, int]:
    """(the cases `data prepare` keeps of a row's `cases`, how many were dropped for an output
    longer than the sandbox keeps, how many for the byte cap); order kept."""
    fit = [c for c in found if len(c["output"]) <= MAX_OUTPUT_CHARS]
    kept, total = [], 0
    for case in fit:
        total += _size(case)
        if total > MAX_TESTS_BYTES:
            break
        kept.append(case)
    return kept, len(found) - len(fit), len(fit) - len(kept)


def hub_form(found: list[dict]) -> list:
    """Cases as a Dolci row's ground truth holds them (scripts, or {input, output} pairs)."""
    if found and found[0].get("testtype") == "code":
        return [c["input"] for c in found]
    return [{"input": c["input"], "output": c["output"]} for c in found]
