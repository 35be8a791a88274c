"""Code rows of allenai/Dolci-Think-RL-7B as the hub stores them (checked on five real rows,
tests/fixtures/data/dolci/).

- `dataset` is a list of verifier labels; code rows carry ["code"] or ["code_stdio"]. The set's
  builder (allenai/open-instruct) picked the test runner by that label: `code` rows hold assert
  statements run after the program, `code_stdio` rows {input, output} pairs fed to stdin.
- `ground_truth` is a list holding one string: a JSON array, or base64(zlib(pickle)) of one (the
  synthetic2 rows), which `data prepare` turns into the JSON it holds (packed_tests).
- `prompt` is the one user turn rendered as "user: <text>".

The asserts become functional cases (code_tests): the program's return value is compared outside
the sandbox, so a program whose result claims to equal everything cannot pass, as it could an
assert run beside it. A row with an assert of no such form (a try/except script, a tolerance) is
left out and named, as is a row whose stdin pairs are not text (lists: function-call tests
whose function the row does not name).
"""
from __future__ import annotations

import json
from typing import Any

from megatron_sdpo.data.code_tests import Unconvertible, mbpp_cases

CODE_LABELS = ("code", "code_stdio")
_USER_TURN = "user: "


def labels(row: dict) -> list[str]:
    """The row's verifier labels (`dataset`: a list on the hub, a string in older files)."""
    value = row.get("dataset")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def is_code(row: dict) -> bool:
    return any(label in CODE_LABELS for label in labels(row))


def is_packed(text: str) -> bool:
    """A ground-truth string that is not JSON: the base64 form (JSON opens with [ or {)."""
    return text.lstrip()[:1] not in ("[", "{", "")


def _unwrapped(value: Any) -> Any:
    """The one string of a hub row's ground-truth list; any other value as it is."""
    return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) else value


def packed(value: Any) -> str | None:
    """The base64 string a ground truth holds, or None when it holds JSON or data."""
    value = _unwrapped(value)
    return value if isinstance(value, str) and is_packed(value) else None


def prompt_text(text: str) -> str:
    return text[len(_USER_TURN):] if text.startswith(_USER_TURN) else text


def tests_of(value: Any) -> Any:
    """The decoded tests of a `ground_truth` / `tests` value: the one JSON string of a hub row's
    list, a JSON string, or the data itself; {"inputs": [...], "outputs": [...]} as pairs."""
    value = _unwrapped(value)
    if isinstance(value, str):
        if is_packed(value):
            raise Unconvertible("the ground truth is packed (base64); `megatron-sdpo data prepare` stores it "
                                "as the JSON it holds")
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise Unconvertible(f"the ground truth is not valid JSON: {exc.msg}") from None
    if isinstance(value, dict) and isinstance(value.get("inputs"), list):
        outs = value.get("outputs")
        if not isinstance(outs, list) or len(outs) != len(value["inputs"]):
            raise Unconvertible("'tests.inputs' and 'tests.outputs' must be lists of equal length")
        value = [{"input": i, "output": o} for i, o in zip(value["inputs"], outs, strict=True)]
    return value


def cases(row: dict, value: Any) -> tuple[str | None, Any]:
    """(the function the asserts call, or None; the row's cases) for the `ground_truth` /
    `tests` value of `row`. Assert rows give functional cases; other rows their pairs unchecked
    (the loader checks them, as LiveCodeBench's)."""
    tests = tests_of(value)
    if not tests:
        raise Unconvertible("no test cases")
    row_labels = labels(row)
    if isinstance(tests, list) and all(isinstance(t, str) for t in tests):
        if "code_stdio" in row_labels:
            raise Unconvertible("a code_stdio row whose tests are assert statements")
        return mbpp_cases(tests)
    if "code" in row_labels:
        raise Unconvertible("a `code` row whose tests are not a list of assert statements")
    return None, tests
