"""The record format every part of the system exchanges: plain dicts with a fixed key set.

Common keys: "id", "domain", "split", "prompt", "source" (all str).
Domain keys:
    math     "answer" (str, LaTeX or number); responses end with ``\\boxed{...}``.
    science  "choices" (list[str]), "answer" (letter "A".."Z"); responses hold ``<answer>X</answer>``.
    tooluse  "tools" (list of {"name", "description", "parameters"}), "answer" (list of
             {"Action": str, "Action_Input": dict}, or a JSON string of that list).
    code     "tests" (list of {"input": str, "output": str[, "testtype"]}); functional tests need
             "fn_name" on the record; "testtype": "code" makes the input a test script run after
             the program (rewards/code.py).
Optional: "solution" (str, an ideal full response), "allowed" (tooluse, BFCL-style allowed
argument values), "history" (earlier chat turns shown before the prompt: a list of
{"role": "user" | "assistant", "content": str}, user first, alternating, ending with the
assistant's), any other key a loader keeps for provenance.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from megatron_sdpo.errors import DataError
from megatron_sdpo.interfaces.domains import DOMAINS

COMMON_KEYS: tuple[str, ...] = ("id", "domain", "split", "prompt", "source")

DOMAIN_KEYS: dict[str, tuple[str, ...]] = {
    "math": ("answer",),
    "science": ("choices", "answer"),
    "tooluse": ("tools", "answer"),
    "code": ("tests",),
}

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def unit_hash(text: str) -> float:
    """A stable hash of `text` in [0, 1), the same on every machine and run (Python's hash() is
    salted per process): what splits an item space or a file's questions into parts."""
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def required_keys(domain: str) -> tuple[str, ...]:
    """All keys a record of `domain` must carry."""
    if domain not in DOMAIN_KEYS:
        raise DataError(f"unknown domain {domain!r}; expected one of {', '.join(DOMAINS)}")
    return COMMON_KEYS + DOMAIN_KEYS[domain]


def _fail(where: str, msg: str) -> None:
    raise DataError(f"{where}: {msg}")


def _check_str(rec: dict, key: str, where: str) -> None:
    if not isinstance(rec[key], str):
        _fail(where, f"field {key!r} must be a string, got {type(rec[key]).__name__}")


def _check_history(turns: Any, where: str) -> None:
    if not isinstance(turns, list) or len(turns) % 2:
        _fail(where, "field 'history' must be a list of user / assistant turn pairs")
    for i, turn in enumerate(turns):
        role = "user" if i % 2 == 0 else "assistant"
        if not isinstance(turn, dict) or turn.get("role") != role or not isinstance(turn.get("content"), str):
            _fail(where, f"history[{i}] must be {{'role': {role!r}, 'content': <text>}}")


def _tool_calls(value: Any, where: str) -> list:
    """The tooluse "answer" as a list of calls (decoding the JSON-string form)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            _fail(where, f"field 'answer' is not valid JSON: {exc.msg}")
    if not isinstance(value, list) or not value:
        _fail(where, "field 'answer' must be a non-empty list of {Action, Action_Input}")
    for i, call in enumerate(value):
        if not isinstance(call, dict) or "Action" not in call or "Action_Input" not in call:
            _fail(where, f"answer[{i}] must be a dict with 'Action' and 'Action_Input'")
        if not isinstance(call["Action"], str):
            _fail(where, f"answer[{i}].Action must be a string")
        if not isinstance(call["Action_Input"], dict):
            _fail(where, f"answer[{i}].Action_Input must be a JSON object")
    return value


def validate_record(rec: Any, where: str) -> dict:
    """Check `rec` against the record format; return it unchanged.

    `where` names the origin (e.g. ``"train.jsonl:3"``) and prefixes every error message.
    Raises DataError on a missing key, a wrong type or an inconsistent value.
    """
    if not isinstance(rec, dict):
        _fail(where, f"record must be a JSON object, got {type(rec).__name__}")
    domain = rec.get("domain")
    if domain not in DOMAIN_KEYS:
        _fail(where, f"field 'domain' must be one of {', '.join(DOMAINS)}, got {domain!r}")
    missing = [k for k in required_keys(domain) if k not in rec]
    if missing:
        _fail(where, f"missing field(s) {', '.join(repr(k) for k in missing)} for domain {domain!r}")
    for key in COMMON_KEYS:
        _check_str(rec, key, where)
    if not rec["prompt"].strip():
        _fail(where, "field 'prompt' is empty")
    if "solution" in rec and rec["solution"] is not None:
        _check_str(rec, "solution", where)
    if "history" in rec:
        _check_history(rec["history"], where)

    if domain == "math":
        _check_str(rec, "answer", where)
        if not rec["answer"].strip():
            _fail(where, "field 'answer' is empty")
    elif domain == "science":
        choices = rec["choices"]
        if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
            _fail(where, "field 'choices' must be a list of 2..26 strings")
        if not all(isinstance(c, str) for c in choices):
            _fail(where, "field 'choices' must hold strings only")
        ans = rec["answer"]
        if not isinstance(ans, str) or ans not in LETTERS[: len(choices)]:
            _fail(where, f"field 'answer' must be a letter A..{LETTERS[len(choices) - 1]}, got {ans!r}")
    elif domain == "tooluse":
        tools = rec["tools"]
        if not isinstance(tools, list) or not tools:
            _fail(where, "field 'tools' must be a non-empty list of tool docs")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                _fail(where, f"tools[{i}] must be a dict with a string 'name'")
        _tool_calls(rec["answer"], where)
    elif domain == "code":
        tests = rec["tests"]
        if not isinstance(tests, list) or not tests:
            _fail(where, "field 'tests' must be a non-empty list of {input, output}")
        functional = False
        for i, case in enumerate(tests):
            if not isinstance(case, dict) or "input" not in case or "output" not in case:
                _fail(where, f"tests[{i}] must be a dict with 'input' and 'output'")
            if not isinstance(case["input"], str) or not isinstance(case["output"], str):
                _fail(where, f"tests[{i}] 'input' and 'output' must be strings")
            functional |= case.get("testtype") == "functional"
        if functional and not isinstance(rec.get("fn_name"), str):
            _fail(where, "functional tests need a string 'fn_name' on the record")
    return rec


def tool_calls(rec: dict) -> list[dict]:
    """The tooluse record's expected calls as a list (the JSON-string form decoded)."""
    return _tool_calls(rec["answer"], f"record {rec.get('id', '?')}")
