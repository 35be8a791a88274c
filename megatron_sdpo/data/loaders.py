"""Loaders from the public dataset schemas the paper uses to our record dicts.

Each schema maps one raw row (a dict) to one record; `load_records` reads the rows from a local
JSONL / JSON / parquet file, converts and validates them, and reports every malformed row as a
one-line DataError naming the file and line (or row). Nothing is dropped silently: with
``on_error="skip"`` bad rows are skipped *and counted* (``RecordList.skipped``).
"""

from __future__ import annotations

import base64
import json
import random
import re
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from megatron_sdpo.data import dolci_rows, reference_rows
from megatron_sdpo.data.code_tests import Unconvertible
from megatron_sdpo.data.records import LETTERS, validate_record
from megatron_sdpo.errors import DataError

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MCQ_INSTRUCTION = "Answer with the letter of the correct choice inside <answer></answer>, e.g. <answer>A</answer>."
TOOL_INSTRUCTION = (
    "Use the tools above. Reply with one or more calls, each as two lines:\n"
    "Action: <tool name>\nAction Input: <JSON object of arguments>"
)
CODE_STDIN_INSTRUCTION = (
    "Write a Python program that reads the input from standard input and prints the answer to "
    "standard output. Put the code in a ```python code block."
)
CODE_FUNCTIONAL_INSTRUCTION = (
    "Complete the function `{fn_name}` in the starter code. Put the code in a ```python code block."
)
CODE_FUNCTION_INSTRUCTION = "Write the Python function `{fn_name}`. Put the code in a ```python code block."
CODE_SCRIPT_INSTRUCTION = (
    "Write the Python code the problem asks for (its functions or classes, with their imports). It "
    "is run without input, then tests that call it are run after it. Put the code in a ```python "
    "code block."
)
_INSTRUCTIONS = {dolci_rows.SCRIPTS: CODE_SCRIPT_INSTRUCTION, dolci_rows.STDIN: CODE_STDIN_INSTRUCTION}


class RowError(Exception):
    """A row that cannot be converted; the loader adds file and line to the message."""


class RecordList(list):
    """A list of records that also carries the messages of rows skipped with on_error="skip"."""

    def __init__(self, records: list[dict], skipped: list[str]):
        super().__init__(records)
        self.skipped = skipped


# ----------------------------------------------------------------------------- reading rows


def _iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (location, raw row) for a JSONL / JSON / parquet file; location is "file:line"."""
    name = str(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover - pyarrow is in the cpu/gpu extras
            raise DataError(f"{name}: reading parquet needs pyarrow (pip install pyarrow)") from None
        try:
            table = pq.read_table(path)
        except Exception as exc:
            raise DataError(f"{name}: cannot read parquet: {exc}") from None
        for i, row in enumerate(table.to_pylist()):
            yield f"{name}:row {i}", row
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{name}: not UTF-8 text ({exc.reason})") from None
    stripped = text.lstrip()
    # A .json file may hold one array/object or (as BFCL ships it) one object per line.
    if suffix == ".json" and stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{name}:{exc.lineno}: invalid JSON: {exc.msg}") from None
        for i, row in enumerate(data):
            yield f"{name}:item {i}", row
        return
    # Only "\n" ends a JSONL line: str.splitlines() also breaks at U+2028, U+0085 and other
    # separators that JSON allows unescaped inside strings (real MMLU rows hold them).
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            yield f"{name}:{lineno}", RowError(f"invalid JSON: {exc.msg} (column {exc.colno})")
            continue
        yield f"{name}:{lineno}", row


# ----------------------------------------------------------------------------- helpers


def _get(row: dict, *keys: str) -> Any:
    """The first present key of `row`; RowError naming the candidates when none is."""
    if not isinstance(row, dict):
        raise RowError(f"row must be a JSON object, got {type(row).__name__}")
    for key in keys:
        if key in row and row[key] is not None:
            return row[key]
    raise RowError(f"missing field {' / '.join(repr(k) for k in keys)}")


def _as_json(value: Any, field: str) -> Any:
    """Decode `value` when it is a JSON string (several schemas store nested data that way)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"field {field!r} is not valid JSON: {exc.msg}") from None
    return value


def _message_text(value: Any, field: str) -> str:
    """A prompt given as a string or as chat messages -> the user text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[0], list):
        value = value[0]  # BFCL nests one conversation per turn: [[{role, content}]]
    if isinstance(value, list):
        users = [m.get("content", "") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if users and all(isinstance(u, str) for u in users):
            return "\n\n".join(users)
    raise RowError(f"field {field!r} must be a string or a list of chat messages with a user turn")


def _mcq_prompt(question: str, choices: list[str]) -> str:
    lines = [question.strip(), ""]
    lines += [f"{LETTERS[i]}) {c}" for i, c in enumerate(choices)]
    return "\n".join(lines) + "\n\n" + MCQ_INSTRUCTION


def _math_prompt(problem: str) -> str:
    return problem.strip() + "\n\n" + MATH_INSTRUCTION


# DAPO-Math-17k wraps each problem in an "Answer: $Answer" instruction; our verifier reads the
# last \boxed{}, so the wrapper is replaced by the boxed instruction.
_DAPO_PREFIX = re.compile(r"^Solve the following math problem step by step\..*?\n\n", re.S)
_DAPO_SUFFIX = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$")


def _source(row: dict, default: str) -> str:
    """The row's own "source" (a set converted into this schema, e.g. MMLU in the MMLU-Redux
    schema, keeps its name), else the schema's set."""
    value = row.get("source")
    return value if isinstance(value, str) and value else default


def _row_id(row: dict, schema: str, index: int, *keys: str) -> str:
    for key in keys:
        if isinstance(row, dict) and row.get(key) not in (None, ""):
            return str(row[key])
    return f"{schema}-{index}"


# ----------------------------------------------------------------------------- schemas
# Each converter: (row, index, ctx) -> record without "split" (added by load_records).


def _dapo_math(row: dict, index: int, ctx: dict) -> dict:
    text = _message_text(_get(row, "prompt"), "prompt")
    core = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", text, count=1))
    rm = _get(row, "reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") in (None, ""):
        raise RowError("missing field 'reward_model.ground_truth'")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    return {
        "id": _row_id(extra, "dapo_math", index, "index") if extra else f"dapo_math-{index}",
        "domain": "math",
        "prompt": _math_prompt(core),
        "answer": str(rm["ground_truth"]),
        "source": str(row.get("data_source") or "dapo_math"),
    }


def _math500(row: dict, index: int, ctx: dict) -> dict:
    rec = {
        "id": _row_id(row, "math500", index, "unique_id", "id"),
        "domain": "math",
        "prompt": _math_prompt(str(_get(row, "problem"))),
        "answer": str(_get(row, "answer")),
        "source": _source(row, "math500"),
    }
    if isinstance(row.get("solution"), str):
        rec["reference_solution"] = row["solution"]
    return rec


def _aime(row: dict, index: int, ctx: dict) -> dict:
    return {
        "id": _row_id(row, "aime", index, "id", "ID"),
        "domain": "math",
        "prompt": _math_prompt(str(_get(row, "problem", "Problem", "question"))),
        "answer": str(_get(row, "answer", "Answer")),
        "source": _source(row, "aime"),
    }


def _sciknoweval(row: dict, index: int, ctx: dict) -> dict:
    if isinstance(row, dict) and "choices" not in row and "prompt" in row:
        return _sciknoweval_reference(row, index)
    choices = _get(row, "choices")
    if not isinstance(choices, dict) or not isinstance(choices.get("text"), list):
        raise RowError('field \'choices\' must be {"text": [...], "label": [...]}')
    texts = [str(t) for t in choices["text"]]
    labels = [str(x) for x in choices.get("label") or LETTERS[: len(texts)]]
    key = str(_get(row, "answerKey")).strip()
    if key not in labels:
        raise RowError(f"answerKey {key!r} is not one of the labels {labels}")
    rec = {
        "id": _row_id(row, "sciknoweval", index, "id"),
        "domain": "science",
        "prompt": _mcq_prompt(str(_get(row, "question")), texts),
        "choices": texts,
        "answer": LETTERS[labels.index(key)],  # our prompt always letters choices A, B, C, ...
        "source": _source(row, "sciknoweval"),
    }
    if isinstance(row.get("domain"), str):
        rec["subject"] = row["domain"]
    return rec


def _sciknoweval_reference(row: dict, index: int) -> dict:
    """The reference's committed split: the question and choices read back from its prompt."""
    try:
        question, texts = reference_rows.mcq_from_prompt(str(_get(row, "prompt")))
    except reference_rows.ReferenceRowError as exc:
        raise RowError(str(exc)) from None
    key = str(_get(row, "answer")).strip()
    if key not in LETTERS[: len(texts)]:
        raise RowError(f"answer {key!r} is not one of the choices' letters {list(LETTERS[: len(texts)])}")
    return {
        "id": _row_id(row, "sciknoweval", index, "id", "idx"),
        "domain": "science",
        "prompt": _mcq_prompt(question, texts),
        "choices": texts,
        "answer": key,
        "source": "sciknoweval",
    }


def _gpqa(row: dict, index: int, ctx: dict) -> dict:
    correct = str(_get(row, "Correct Answer")).strip()
    wrong = [str(_get(row, f"Incorrect Answer {i}")).strip() for i in (1, 2, 3)]
    rid = _row_id(row, "gpqa", index, "Record ID", "id")
    order = [correct] + wrong
    # Per-item RNG keyed by (seed, id): the order does not depend on file order or on `limit`.
    random.Random(f"{ctx['seed']}:{rid}").shuffle(order)
    return {
        "id": rid,
        "domain": "science",
        "prompt": _mcq_prompt(str(_get(row, "Question")), order),
        "choices": order,
        "answer": LETTERS[order.index(correct)],
        "source": "gpqa",
    }


def _mmlu_redux(row: dict, index: int, ctx: dict) -> dict:
    choices = _get(row, "choices")
    if not isinstance(choices, list) or len(choices) < 2:
        raise RowError("field 'choices' must be a list of at least 2 strings")
    ans = _get(row, "answer")
    if isinstance(ans, bool) or not isinstance(ans, int) or not 0 <= ans < len(choices):
        raise RowError(f"field 'answer' must be an index 0..{len(choices) - 1}, got {ans!r}")
    rec = {
        "id": _row_id(row, "mmlu_redux", index, "id"),
        "domain": "science",
        "prompt": _mcq_prompt(str(_get(row, "question")), [str(c) for c in choices]),
        "choices": [str(c) for c in choices],
        "answer": LETTERS[ans],
        "source": _source(row, "mmlu_redux"),
    }
    for key in ("error_type", "subject"):
        if isinstance(row.get(key), str):
            rec[key] = row[key]
    return rec


def render_tools(tools: list[dict]) -> str:
    """Tool docs as the prompt shows them: one JSON object per line."""
    return "\n".join(json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools)


def tool_prompt(question: str, tools: list[dict]) -> str:
    """The tool-use user message: tool docs, the request, the ReAct format instruction."""
    return f"Tools:\n{render_tools(tools)}\n\nRequest: {question.strip()}\n\n{TOOL_INSTRUCTION}"


def _norm_calls(value: Any) -> list[dict]:
    calls = _as_json(value, "answer")
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise RowError("field 'answer' must be a non-empty list of {Action, Action_Input}")
    out = []
    for i, call in enumerate(calls):
        if not isinstance(call, dict) or "Action" not in call:
            raise RowError(f"answer[{i}] has no 'Action'")
        args = _as_json(call.get("Action_Input", {}), f"answer[{i}].Action_Input")
        if not isinstance(args, dict):
            raise RowError(f"answer[{i}].Action_Input must be a JSON object")
        out.append({"Action": str(call["Action"]), "Action_Input": args})
    return out


def _tool_docs(value: Any) -> list[dict]:
    tools = _as_json(value, "tools")
    if not isinstance(tools, list) or not tools:
        raise RowError("field 'tools' must be a non-empty list of tool docs")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise RowError(f"tools[{i}] must be an object with a string 'name'")
    return [
        {"name": t["name"], "description": str(t.get("description", "")), "parameters": t.get("parameters", {})}
        for t in tools
    ]


def _toolalpaca(row: dict, index: int, ctx: dict) -> dict:
    """ToolAlpaca in the reference's rows (the rendered ReAct prompt, kept as the paper trains on
    it; the tools read back from its documentation block), or with `tools` and `instruction`."""
    if isinstance(row, dict) and "tools" not in row and "functions" not in row and "prompt" in row:
        prompt = str(_get(row, "prompt"))
        try:
            tools = reference_rows.tool_docs_from_prompt(prompt)
            reference_rows.tool_question(prompt)  # the request must be there too
        except reference_rows.ReferenceRowError as exc:
            raise RowError(str(exc)) from None
    else:
        tools = _tool_docs(_get(row, "tools", "functions"))
        prompt = tool_prompt(str(_get(row, "instruction", "question")), tools)
    return {
        "id": _row_id(row, "toolalpaca", index, "id", "idx"),
        "domain": "tooluse",
        "prompt": prompt,
        "tools": tools,
        "answer": _norm_calls(_get(row, "answer", "Golden_Answers")),
        "source": "toolalpaca",
    }


def _bfcl_answers(path: Path) -> dict[str, list]:
    """id -> ground_truth from BFCL's separate possible_answer file."""
    if not path.is_file():
        raise DataError(f"{path}: BFCL possible_answer file not found (pass answers_path=)")
    out: dict[str, list] = {}
    for where, row in _iter_rows(path):
        if isinstance(row, RowError):
            raise DataError(f"{where}: {row}")
        if not isinstance(row, dict) or "id" not in row or not isinstance(row.get("ground_truth"), list):
            raise DataError(f"{where}: possible_answer rows need 'id' and a list 'ground_truth'")
        out[str(row["id"])] = row["ground_truth"]
    return out


def _bfcl_multiple(row: dict, index: int, ctx: dict) -> dict:
    rid = str(_get(row, "id"))
    question = _message_text(_get(row, "question"), "question")
    tools = _tool_docs(_get(row, "function"))
    truth = ctx["answers"].get(rid)
    if truth is None:
        raise RowError(f"id {rid!r} has no entry in the possible_answer file")
    answer, allowed = [], []
    for call in truth:
        if not isinstance(call, dict) or len(call) != 1:
            raise RowError("each ground_truth entry must be {fn_name: {arg: [allowed values]}}")
        ((name, args),) = call.items()
        if not isinstance(args, dict) or not all(isinstance(v, list) for v in args.values()):
            raise RowError(f"ground_truth of {name!r} must map each argument to a list of values")
        # BFCL lists "" among allowed values for an optional argument that may be omitted.
        chosen = {}
        for arg, values in args.items():
            present = [v for v in values if v != ""]
            if present:
                chosen[arg] = present[0]
        answer.append({"Action": name, "Action_Input": chosen})
        allowed.append({"Action": name, "Action_Input": args})
    return {
        "id": rid,
        "domain": "tooluse",
        "prompt": tool_prompt(question, tools),
        "tools": tools,
        "answer": answer,
        "allowed": allowed,
        "source": _source(row, "bfcl_v4_multiple"),
    }


def decode_lcb_tests(value: Any, field: str) -> list[dict]:
    """LiveCodeBench test cases: a JSON string, or base64(zlib(JSON string)); the official
    base64(zlib(pickle)) form is refused here (`data prepare` stores it as JSON, packed_tests)."""
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise RowError(f"field {field!r} must be a JSON string or a list")
    s = value.strip()
    if s.startswith("["):
        return _as_json(s, field)
    try:
        raw = zlib.decompress(base64.b64decode(s, validate=True))
    except Exception:
        raise RowError(f"field {field!r} is neither JSON nor base64+zlib data") from None
    if raw[:1] == b"\x80":  # the pickle protocol opcode
        raise RowError(
            f"field {field!r} holds pickled data, which is refused (unpickling can execute code); "
            "convert it to a JSON string first (`megatron-sdpo data prepare` does, with no globals)"
        )
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RowError(f"field {field!r} decompresses to something that is not JSON") from None


def _check_tests(cases: Any, field: str) -> list[dict]:
    if not isinstance(cases, list):
        raise RowError(f"field {field!r} must decode to a list of test cases")
    out = []
    for i, c in enumerate(cases):
        if not isinstance(c, dict) or "input" not in c or "output" not in c:
            raise RowError(f"{field}[{i}] needs 'input' and 'output'")
        if any(isinstance(c[key], (list, dict)) for key in ("input", "output")):
            # str() of a list is no program's stdin or stdout: such pairs are function-call tests.
            raise RowError(
                f"{field}[{i}] holds a JSON list or object, not text (a function-call test "
                "whose function the row does not name)"
            )
        case = {"input": str(c["input"]), "output": str(c["output"])}
        if c.get("testtype") in ("functional", "code"):  # "code": a test script (rewards/code.py)
            case["testtype"] = c["testtype"]
        out.append(case)
    return out


def _code_prompt(question: str, fn_name: str | None, starter: str) -> str:
    parts = [question.strip()]
    if starter.strip():
        parts.append("Starter code:\n```python\n" + starter.rstrip() + "\n```")
    functional = CODE_FUNCTIONAL_INSTRUCTION if starter.strip() else CODE_FUNCTION_INSTRUCTION
    parts.append(CODE_STDIN_INSTRUCTION if fn_name is None else functional.format(fn_name=fn_name))
    return "\n\n".join(parts)


def _livecodebench(row: dict, index: int, ctx: dict) -> dict:
    tests = _check_tests(decode_lcb_tests(_get(row, "public_test_cases"), "public_test_cases"), "public_test_cases")
    if row.get("private_test_cases") not in (None, ""):
        tests += _check_tests(decode_lcb_tests(row["private_test_cases"], "private_test_cases"), "private_test_cases")
    if not tests:
        raise RowError("no test cases")
    meta = _as_json(row.get("metadata") or {}, "metadata")
    fn_name = meta.get("func_name") if isinstance(meta, dict) else None
    functional = any(t.get("testtype") == "functional" for t in tests)
    if functional and not isinstance(fn_name, str):
        raise RowError("functional tests need 'metadata.func_name'")
    rec: dict[str, Any] = {
        "id": _row_id(row, "livecodebench", index, "question_id", "id"),
        "domain": "code",
        "prompt": _code_prompt(
            str(_get(row, "question_content")), fn_name if functional else None, str(row.get("starter_code") or "")
        ),
        "tests": tests,
        "source": "livecodebench",
    }
    if functional:
        rec["fn_name"] = fn_name
    return rec


def _dolci_code(row: dict, index: int, ctx: dict) -> dict:
    """Dolci-Think-RL's code rows (dolci_rows), and the older layout (MBPP / HumanEval)."""
    question = dolci_rows.prompt_text(_message_text(_get(row, "prompt", "question", "messages"), "prompt"))
    label = dolci_rows.label(row)
    if label is not None and label not in dolci_rows.CODE_LABELS:
        raise RowError(f"dataset {label!r} is not a code verifier ({' / '.join(dolci_rows.CODE_LABELS)})")
    try:
        decoded, _ = dolci_rows.tests_of(_get(row, "tests", "ground_truth", "test_cases"), packed=False)
        tests = _check_tests(dolci_rows.cases(row, decoded), "tests")
    except Unconvertible as exc:
        raise RowError(str(exc)) from None
    fn_name = row.get("fn_name")
    functional = any(t.get("testtype") == "functional" for t in tests)
    if functional and not isinstance(fn_name, str):
        raise RowError("functional tests need 'fn_name'")
    kind = dolci_rows.instruction(label, tests)
    rec: dict[str, Any] = {
        "id": _row_id(row, "dolci_code", index, "id", "custom_id"),
        "domain": "code",
        "prompt": question if kind is None else question.strip() + "\n\n" + _INSTRUCTIONS[kind],
        "tests": tests,
        "source": _source(row, "dolci_code"),
    }
    if functional:
        rec["fn_name"] = fn_name
    for key in ("reference_solution", "original_dataset", "hub_revision"):  # provenance, as given
        if isinstance(row.get(key), str):
            rec[key] = row[key]
    return rec


def _records(row: dict, index: int, ctx: dict) -> dict:
    if not isinstance(row, dict):
        raise RowError(f"row must be a JSON object, got {type(row).__name__}")
    return dict(row)


SCHEMAS: dict[str, tuple[str | None, Callable[[dict, int, dict], dict]]] = {
    "dapo_math": ("math", _dapo_math),
    "math500": ("math", _math500),
    "aime": ("math", _aime),
    "sciknoweval": ("science", _sciknoweval),
    "gpqa": ("science", _gpqa),
    "mmlu_redux": ("science", _mmlu_redux),
    "toolalpaca": ("tooluse", _toolalpaca),
    "bfcl_multiple": ("tooluse", _bfcl_multiple),
    "livecodebench": ("code", _livecodebench),
    "dolci_code": ("code", _dolci_code),
    "records": (None, _records),
}


def load_records(
    path: str | Path,
    schema: str,
    *,
    domain: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    split: str | None = None,
    answers_path: str | Path | None = None,
    on_error: str = "raise",
    where: dict[str, list[str]] | None = None,
) -> RecordList:
    """Read `path` (.jsonl / .json / .parquet) in `schema` and return validated record dicts.

    domain: for schema "records", keep only that domain; for the others it must match the
        schema's domain (a guard against pairing a file with the wrong stage).
    limit: stop after this many records (file order). seed: GPQA choice shuffling.
    split: the records' "split" (default: the file's stem; "records" keep their own).
    answers_path: BFCL's possible_answer file (default: possible_answer/<name> next to `path`).
    on_error: "raise" (default) raises DataError "file:line: reason" at the first bad row;
        "skip" skips bad rows and lists their messages in the result's `.skipped`.
    where: keep only the rows whose column holds one of the listed values, compared as text
        (e.g. {"level": ["1", "2"]}); a row without the column is not kept.
    """
    if schema not in SCHEMAS:
        raise DataError(f"unknown data schema {schema!r}; expected one of {', '.join(sorted(SCHEMAS))}")
    if on_error not in ("raise", "skip"):
        raise DataError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if limit is not None and limit < 0:
        raise DataError(f"limit must be >= 0, got {limit}")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    schema_domain, convert = SCHEMAS[schema]
    if domain is not None and schema_domain is not None and domain != schema_domain:
        raise DataError(f"{path}: schema {schema!r} yields {schema_domain!r} records, not {domain!r}")
    ctx: dict[str, Any] = {"seed": seed}
    if schema == "bfcl_multiple":
        ctx["answers"] = _bfcl_answers(
            Path(answers_path) if answers_path is not None else path.parent / "possible_answer" / path.name
        )

    records: list[dict] = []
    skipped: list[str] = []
    wanted = {column: {str(v) for v in values} for column, values in (where or {}).items()}
    for index, (at, row) in enumerate(_iter_rows(path)):
        if limit is not None and len(records) >= limit:
            break
        if (
            wanted
            and isinstance(row, dict)
            and not all(column in row and str(row[column]) in values for column, values in wanted.items())
        ):
            continue
        try:
            if isinstance(row, RowError):
                raise row
            rec = convert(row, index, ctx)
            if schema != "records" or "split" not in rec:
                rec["split"] = split if split is not None else rec.get("split", path.stem)
            validate_record(rec, at)
        except RowError as exc:
            msg = f"{at}: {exc}"
            if on_error == "raise":
                raise DataError(msg) from None
            skipped.append(msg)
            continue
        except DataError as exc:
            if on_error == "raise":
                raise
            skipped.append(str(exc))
            continue
        if domain is not None and rec["domain"] != domain:
            continue
        records.append(rec)
    if skipped:
        warnings.warn(f"{path}: skipped {len(skipped)} malformed row(s); first: {skipped[0]}", stacklevel=2)
    return RecordList(records, skipped)
