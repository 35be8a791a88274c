"""Tool-use verifier for ReAct traces (``Action: name`` then ``Action Input: {json}``).

Score 1 iff the multiset of called actions equals the gold one and the merged arguments (all
calls' inputs folded into one dict, later calls overriding) equal the gold's merged arguments.
BFCL-style records may instead carry ``allowed``: a list of {"Action": fn, "Action_Input": {arg:
[accepted values]}}, one per expected call, as the BFCL loader writes it (or {fn: {arg: [accepted
values]}}), where "" in a
list marks the argument optional; then every call is checked against its function's table.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from megatron_sdpo.errors import DataError
from megatron_sdpo.rewards.result import RewardResult, clip_text

__all__ = ["parse_actions", "score_tooluse", "ToolCall"]

ToolCall = tuple[str, dict]
_MAX_RESPONSE_CHARS = 100_000
_MAX_CALLS = 64
_ACTION = re.compile(r"^[ \t>*`#-]*Action[ \t]*:[ \t]*(.*)$", re.MULTILINE | re.IGNORECASE)
_INPUT = re.compile(r"Action[ \t_]*Input[ \t]*:", re.IGNORECASE)
_FENCE = re.compile(r"```[a-zA-Z]*")


def parse_actions(response: str) -> tuple[list[ToolCall], list[str]]:
    """ReAct calls in order, plus one error string per call whose input was not a JSON object.

    Text after the JSON object (an Observation, prose) and code fences around it are ignored."""
    text = response[:_MAX_RESPONSE_CHARS]
    calls: list[ToolCall] = []
    errors: list[str] = []
    matches = list(_ACTION.finditer(text))[:_MAX_CALLS]
    decoder = json.JSONDecoder()
    for k, match in enumerate(matches):
        name = match.group(1).strip().strip("`'\"*").strip()
        end = matches[k + 1].start() if k + 1 < len(matches) else len(text)
        body = text[match.end() : end]
        found = _INPUT.search(body)
        if not name:
            errors.append("An `Action:` line has no tool name.")
            continue
        if found is None:
            errors.append(f"Action {clip_text(name, 40)!r} has no `Action Input:` line.")
            continue
        rest = _FENCE.sub(" ", body[found.end() :]).lstrip()
        if not rest.startswith("{"):
            errors.append(f"The Action Input of {clip_text(name, 40)!r} is not a JSON object.")
            continue
        try:
            value, _ = decoder.raw_decode(rest)
        except (ValueError, RecursionError) as exc:
            msg = str(exc).split(":")[0]
            errors.append(f"The Action Input of {clip_text(name, 40)!r} is not valid JSON ({msg}).")
            continue
        if not isinstance(value, dict):
            errors.append(f"The Action Input of {clip_text(name, 40)!r} is not a JSON object.")
            continue
        calls.append((name, value))
    return calls, errors


def _gold_calls(record: dict) -> list[ToolCall]:
    answer = record.get("answer", [])
    try:
        if isinstance(answer, str):
            answer = json.loads(answer)
        calls = []
        for item in answer:
            args = item.get("Action_Input", {})
            if isinstance(args, str):
                args = json.loads(args) if args.strip() else {}
            calls.append((str(item["Action"]), dict(args)))
        return calls
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise DataError(f"record {record.get('id')!r}: malformed tool-use answer ({exc})") from None


def _canon(value: Any) -> Any:
    """Comparable form: numbers as floats, strings stripped, containers recursively."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, list):
        return [_canon(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in value.items()}
    return value


def _loose(value: Any) -> Any:
    """BFCL-style comparison: strings also case-insensitive."""
    value = _canon(value)
    return value.lower() if isinstance(value, str) else value


def _merge(calls: list[ToolCall]) -> dict:
    merged: dict = {}
    for _, args in calls:
        merged.update(args)
    return merged


def _allowed_tables(allowed: Any) -> list[tuple[str, dict]]:
    """(function, {arg: accepted values}) per expected call, from either form of `allowed`: the
    loaders' list of {"Action", "Action_Input"} (one entry per call, so repeated calls of one
    function keep their own values) or {fn: {arg: values}}."""
    if isinstance(allowed, dict):
        return [(str(name), dict(table)) for name, table in allowed.items()]
    return [(str(a["Action"]), dict(a["Action_Input"])) for a in allowed]


def _check_call(name: str, args: dict, table: dict) -> str | None:
    for arg, values in table.items():
        optional = "" in values
        if arg not in args:
            if not optional:
                return f"Missing required argument {arg!r} for {name!r}."
            continue
        if _loose(args[arg]) not in [_loose(v) for v in values if v != ""]:
            return f"Wrong value for argument {arg!r} of {name!r}."
    extra = sorted(set(args) - set(table))
    if extra:
        return f"Unexpected argument {extra[0]!r} for {name!r}."
    return None


def _check_allowed(calls: list[ToolCall], tables: list[tuple[str, dict]]) -> str | None:
    """Each call must satisfy an expected call of its function not already used by another."""
    unused = list(tables)
    for name, args in calls:
        candidates = [t for t in unused if t[0] == name]
        if not candidates:
            return f"{name!r} is not a function that solves this task."
        problems = [_check_call(name, args, table) for _, table in candidates]
        if None not in problems:
            return problems[0]
        unused.remove(candidates[problems.index(None)])
    return None


def score_tooluse(response: str, record: dict) -> RewardResult:
    """1.0 iff actions (as a multiset) and merged arguments match the record's; see module doc.

    Feedback names the first problem found, as an environment would report it: bad JSON, unknown
    tool, wrong calls (the model's own wrong calls and how many calls were needed, never the gold
    tool names), missing / unexpected argument, wrong value (argument names only, never gold
    values)."""
    tool_names = [str(t["name"]) for t in record.get("tools", []) if isinstance(t, dict)]
    allowed = _allowed_tables(record["allowed"]) if record.get("allowed") else []
    gold = _gold_calls(record) if (record.get("answer") or not allowed) else [(fn, {}) for fn, _ in allowed]
    calls, errors = parse_actions(response)
    details: dict = {"calls": [name for name, _ in calls]}
    if errors:
        return RewardResult(0.0, errors[0], {**details, "error": "bad_json"})
    if not calls:
        return RewardResult(
            0.0,
            "No tool call found: write `Action: <tool name>` followed by `Action Input: <JSON object>`.",
            {**details, "error": "no_action"},
        )
    # A gold call's function is never unknown, documented or not (a few of the reference's
    # ToolAlpaca answers call a function its prompt does not document, e.g. `getDetails`).
    known = set(tool_names) | {n for n, _ in gold}
    for name, _ in calls:
        if tool_names and name not in known:
            return RewardResult(
                0.0,
                f"Unknown tool {clip_text(name, 40)!r}; available tools: {', '.join(tool_names)}.",
                {**details, "error": "unknown_tool"},
            )
    want, got = Counter(n for n, _ in gold), Counter(n for n, _ in calls)
    if want != got:
        # Like an environment: say which of the model's own calls were wrong or missing in
        # number, never which gold tools the task needed.
        parts = []
        if sum((got - want).values()):
            parts.append("call(s) to " + ", ".join(sorted(got - want)) + " do not solve this task")
        if sum((want - got).values()):
            parts.append(f"{sum(want.values())} call(s) are needed, {sum(got.values())} were made")
        return RewardResult(0.0, "Wrong tool calls: " + "; ".join(parts) + ".", {**details, "error": "wrong_actions"})
    if allowed:
        problem = _check_allowed(calls, allowed)
    else:
        problem = None
        pred, ref = _merge(calls), _merge(gold)
        for arg in ref:
            if arg not in pred:
                problem = f"Missing argument {arg!r}."
                break
            if _canon(pred[arg]) != _canon(ref[arg]):
                problem = f"Wrong value for argument {arg!r}."
                break
        if problem is None:
            extra = sorted(set(pred) - set(ref))
            if extra:
                problem = f"Unexpected argument {clip_text(str(extra[0]), 40)!r}."
    if problem is not None:
        return RewardResult(0.0, problem, {**details, "error": "wrong_arguments"})
    return RewardResult(1.0, "The tool calls and their arguments are correct.", details)
