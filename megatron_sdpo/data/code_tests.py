"""Assert statements (MBPP's `test_list`, HumanEval's `check`) -> the verifier's functional cases.

A functional case (see rewards/code.py) calls `fn_name` with one JSON value per input line and
compares the JSON of the return value with the case's output. Only asserts of the form
``assert f(<literals>) == <literal>`` (or ``candidate(...)`` inside HumanEval's `check`) fit that
contract; anything else (floating tolerances, `set(...)`, keyword arguments, a helper called
on the result) is reported as unconvertible with the reason, never dropped silently.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any


class Unconvertible(Exception):
    """An assert (or a whole item) that has no exact functional-case form."""


def _shown(src: str) -> str:
    """A test's source on one line (a reason is one line of the manifest), cut at 80 characters."""
    return " ".join(src.split())[:80]


def _literal(node: ast.expr, what: str) -> Any:
    try:
        value = ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise Unconvertible(f"{what} is not a literal: {_shown(ast.unparse(node))}") from None
    _check_json(value, what)
    return value


def _check_json(value: Any, what: str) -> None:
    """Sets, complex numbers, bytes and non-string dict keys do not survive the JSON round trip
    that carries arguments and results through the sandbox."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Unconvertible(f"{what} is not a finite number")
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_json(v, what)
        return
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise Unconvertible(f"{what} is a dict with non-string keys")
        for v in value.values():
            _check_json(v, what)
        return
    raise Unconvertible(f"{what} holds a {type(value).__name__}, which JSON cannot carry")


def _case(call: ast.expr, expected: ast.expr, fn_names: tuple[str, ...]) -> tuple[str, dict]:
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.func.id not in fn_names:
        raise Unconvertible(f"left side is not a call of {' / '.join(fn_names)}: {_shown(ast.unparse(call))}")
    if call.keywords or any(isinstance(a, ast.Starred) for a in call.args):
        raise Unconvertible("keyword or starred arguments")
    args = [_literal(a, "an argument") for a in call.args]
    value = _literal(expected, "the expected value")
    case = {
        "input": "\n".join(json.dumps(a, ensure_ascii=False) for a in args),
        "output": json.dumps(value, ensure_ascii=False),
        "testtype": "functional",
    }
    return call.func.id, case


def assert_case(stmt: ast.stmt, fn_names: tuple[str, ...]) -> tuple[str, dict]:
    """(called name, functional case) for ``assert f(args) == expected``; else Unconvertible."""
    if not isinstance(stmt, ast.Assert):
        raise Unconvertible(f"not an assert: {_shown(ast.unparse(stmt))}")
    test = stmt.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        raise Unconvertible(f"not an equality assert: {_shown(ast.unparse(test))}")
    left, right = test.left, test.comparators[0]
    if isinstance(right, ast.Call) and not isinstance(left, ast.Call):
        left, right = right, left  # `assert expected == f(x)`
    return _case(left, right, fn_names)


def mbpp_cases(test_list: list[str], setup_code: str = "") -> tuple[str, list[dict]]:
    """(function name, cases) from MBPP's assert strings; every assert must convert. (Dolci's
    `code` rows are not converted so: their snippets run verbatim as test scripts, dolci_rows.)"""
    if setup_code.strip():
        raise Unconvertible("needs test_setup_code")
    if not test_list:
        raise Unconvertible("no tests")
    name: str | None = None
    cases = []
    for src in test_list:
        try:
            tree = ast.parse(src.strip())
        except SyntaxError:
            raise Unconvertible(f"test does not parse: {_shown(src)}") from None
        if len(tree.body) != 1:
            raise Unconvertible(f"test is not one statement: {_shown(src)}")
        stmt = tree.body[0]
        called = _called_name(stmt)
        fn, case = assert_case(stmt, (called,) if called else ())
        if name is not None and fn != name:
            raise Unconvertible(f"tests call two functions ({name}, {fn})")
        name = fn
        cases.append(case)
    assert name is not None
    return name, cases


def _called_name(stmt: ast.stmt) -> str | None:
    """The function an MBPP assert calls on its left (or right) side."""
    if isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Compare):
        for side in (stmt.test.left, *stmt.test.comparators):
            if isinstance(side, ast.Call) and isinstance(side.func, ast.Name):
                return side.func.id
    return None


def humaneval_cases(test_src: str) -> list[dict]:
    """Cases from HumanEval's `check(candidate)`: every statement of its body must be a literal
    ``assert candidate(...) == ...`` (a trailing `assert True` sanity line is allowed)."""
    try:
        tree = ast.parse(test_src)
    except SyntaxError:
        raise Unconvertible("test does not parse") from None
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        raise Unconvertible("no check() function")
    cases = []
    for stmt in checks[0].body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring
        if isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Constant) and stmt.test.value is True:
            continue
        cases.append(assert_case(stmt, ("candidate",))[1])
    if not cases:
        raise Unconvertible("check() holds no assert")
    return cases
