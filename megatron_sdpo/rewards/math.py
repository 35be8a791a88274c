"""Math verifier: the last ``\\boxed{...}`` of a response, checked against the gold with math-verify.

math-verify (and sympy under it) can hang on pathological answers, in C code that no signal
reaches (``9^{9^{9}}`` never returns), and its own timeouts only work in the main thread. So the
comparison runs in a worker process (:mod:`math_worker`) that is killed and restarted when it
misses its deadline; before that, answers are bounded in length and obvious power towers are
refused, which keeps the worker from being killed in the common degenerate cases.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import subprocess
import sys
import threading

from megatron_sdpo.rewards.result import RewardResult, clip_text

__all__ = ["extract_boxed", "MathVerifier", "score_math"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_BRACE = re.compile(r"(?<!\\)([{}])")
_TOKEN = re.compile(r"[^\s$]+")
_MAX_RESPONSE_CHARS = 200_000  # only the tail is searched: the last box is what counts
_MAX_ANSWER_CHARS = 300
_TOWER = re.compile(r"\^\s*\{?[^{}^]*\^|\^\s*\{?\s*\d{5,}|!\s*!")


def _matching_braces(text: str) -> dict[int, int]:
    """Position of each unescaped '{' -> its matching '}' (one linear pass)."""
    match: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE.finditer(text):
        if m.group(1) == "{":
            stack.append(m.start(1))
        elif stack:
            match[stack.pop()] = m.start(1)
    return match


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces) or of the last
    ``\\boxed 5`` (a single token after a space); None when there is none or it is unclosed."""
    text = text[-_MAX_RESPONSE_CHARS:]
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    closing = _matching_braces(text)
    for box in reversed(boxes):
        i = box.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            if i in closing:
                return text[i + 1 : closing[i]].strip()
            continue  # unclosed: an earlier, complete box may still count
        if i > box.end():
            token = _TOKEN.match(text, i)
            if token:
                return token.group(0).rstrip(".,;")
    return None


class MathVerifier:
    """math-verify behind a process boundary with a hard per-answer deadline. Thread-safe."""

    def __init__(self, timeout_s: float = 5.0, startup_timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def _start(self) -> None:
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_worker.py")
        self._proc = subprocess.Popen(
            [sys.executable, "-I", worker], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, bufsize=1,
        )
        ready = self._readline(self.startup_timeout_s)
        if ready is None or not json.loads(ready).get("ready"):
            self.close()
            raise RuntimeError("math-verify worker did not start (is math-verify installed?)")

    def _readline(self, timeout: float) -> str | None:
        """One line from the worker, or None (and the worker killed) after `timeout` seconds."""
        assert self._proc is not None and self._proc.stdout is not None
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self._proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive() or not box or not box[0]:
            self.close()
            return None
        return box[0]

    def check(self, gold: str, answer: str) -> dict | None:
        """{"correct", "parsed", "error"} from math-verify, or None if it missed the deadline."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps({"gold": gold, "answer": answer}) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self.close()
                return None
            line = self._readline(self.timeout_s)
        return None if line is None else json.loads(line)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def _default_verifier() -> MathVerifier:
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier()
        return _default


def score_math(response: str, record: dict, *, reveal_gold: bool = False,
               verifier: MathVerifier | None = None) -> RewardResult:
    """1.0 iff the last boxed answer of `response` equals `record["answer"]` per math-verify.

    Feedback names the model's own answer, and the gold only when `reveal_gold`."""
    gold = str(record["answer"])
    answer = extract_boxed(response)
    if answer is None:
        return RewardResult(0.0, "No \\boxed{} answer found.", {"error": "no_box"})
    if not answer:
        return RewardResult(0.0, "The \\boxed{} answer is empty.", {"error": "empty_box"})
    shown = clip_text(answer, 80)
    suffix = f" The correct answer is {gold}." if reveal_gold else ""
    if len(answer) > _MAX_ANSWER_CHARS or _TOWER.search(answer):
        return RewardResult(0.0, f"Your final answer {shown} is too long or too large to check."
                            + suffix, {"error": "too_complex", "answer": shown})
    result = (verifier or _default_verifier()).check(gold, answer)
    if result is None:
        return RewardResult(0.0, f"Your final answer {shown} could not be checked in time."
                            + suffix, {"error": "timeout", "answer": shown})
    details = {"answer": shown, "parsed": result["parsed"], "error": result["error"]}
    if result["correct"]:
        return RewardResult(1.0, f"Your final answer {shown} is correct.", details)
    return RewardResult(0.0, f"Your final answer {shown} is incorrect." + suffix, details)
