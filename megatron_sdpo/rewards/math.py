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
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from megatron_sdpo.rewards.process_wide import ProcessWide
from megatron_sdpo.rewards.result import RewardResult, clip_text

__all__ = ["extract_boxed", "MathVerifier", "score_math", "score_math_batch", "prepare_math", "check_math_batch"]

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
    """math-verify behind a process boundary with a hard per-answer deadline. Thread-safe.

    A batch goes to the worker as one request; the worker answers item by item, and every
    answer must arrive within `timeout_s` of the previous one (or of the request), so a batch
    keeps the per-answer deadline of one-at-a-time checking. An item that misses it gets None,
    the worker is killed and restarted, and the items after it are sent again."""

    def __init__(self, timeout_s: float = 5.0, startup_timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._lock = threading.Lock()
        atexit.register(self.close)

    def _start(self) -> None:
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_worker.py")
        self._buf = b""
        self._proc = subprocess.Popen(
            [sys.executable, "-I", worker, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )
        ready = self._readline(self.startup_timeout_s)
        if ready is None or not json.loads(ready).get("ready"):
            self.close()
            raise RuntimeError("math-verify worker did not start (is math-verify installed?)")

    def _readline(self, timeout: float) -> str | None:
        """One line from the worker, or None (and the worker killed) after `timeout` seconds.
        Reads the pipe with select: no thread per line, and no blocking read to abandon."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], left)[0] if left > 0 else []
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk:  # deadline missed, or the worker died
                self.close()
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def check(self, gold: str, answer: str) -> dict | None:
        """{"correct", "parsed", "error"} from math-verify, or None if it missed the deadline."""
        return self.check_many([(gold, answer)])[0]

    def check_many(self, pairs: list[tuple[str, str]]) -> list[dict | None]:
        """check() of every (gold, answer) pair in one request to the worker; equal pairs are
        checked once (math-verify is deterministic). None where an answer missed its deadline."""
        unique = list(dict.fromkeys(pairs))
        found: dict[tuple[str, str], dict | None] = {}
        with self._lock:
            todo = unique
            while todo:
                if self._proc is None or self._proc.poll() is not None:
                    self._start()
                assert self._proc is not None and self._proc.stdin is not None
                try:
                    self._proc.stdin.write((json.dumps({"items": todo}) + "\n").encode())
                    self._proc.stdin.flush()
                except (BrokenPipeError, OSError):
                    self.close()
                    found[todo[0]] = None  # the worker died on this batch: blame its first item
                    todo = todo[1:]
                    continue
                for k, pair in enumerate(todo):
                    line = self._readline(self.timeout_s)
                    found[pair] = None if line is None else json.loads(line)
                    if line is None:  # worker killed: send what is left to a new one
                        todo = todo[k + 1 :]
                        break
                else:
                    todo = []
        return [found[p] for p in pairs]

    def close(self) -> None:
        proc, self._proc = self._proc, None
        self._buf = b""
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    f.close()


_VERIFIER = ProcessWide(MathVerifier)


@dataclass
class _Pending:
    """A response whose boxed answer goes to math-verify, with what its feedback needs."""

    gold: str
    answer: str
    shown: str
    suffix: str


def prepare_math(response: str, record: dict, *, reveal_gold: bool = False) -> RewardResult | _Pending:
    """First half of score_math: the result when it is decided without math-verify (no box,
    empty, too complex), else the pending check for `check_math_batch`."""
    gold = str(record["answer"])
    answer = extract_boxed(response)
    if answer is None:
        return RewardResult(0.0, "No \\boxed{} answer found.", {"error": "no_box"})
    if not answer:
        return RewardResult(0.0, "The \\boxed{} answer is empty.", {"error": "empty_box"})
    shown = clip_text(answer, 80)
    suffix = f" The correct answer is {gold}." if reveal_gold else ""
    if len(answer) > _MAX_ANSWER_CHARS or _TOWER.search(answer):
        return RewardResult(
            0.0,
            f"Your final answer {shown} is too long or too large to check." + suffix,
            {"error": "too_complex", "answer": shown},
        )
    return _Pending(gold, answer, shown, suffix)


def _finish(p: _Pending, result: dict | None) -> RewardResult:
    if result is None:
        return RewardResult(
            0.0,
            f"Your final answer {p.shown} could not be checked in time." + p.suffix,
            {"error": "timeout", "answer": p.shown},
        )
    details = {"answer": p.shown, "parsed": result["parsed"], "error": result["error"]}
    if result["correct"]:
        return RewardResult(1.0, f"Your final answer {p.shown} is correct.", details)
    return RewardResult(0.0, f"Your final answer {p.shown} is incorrect." + p.suffix, details)


def score_math(
    response: str, record: dict, *, reveal_gold: bool = False, verifier: MathVerifier | None = None
) -> RewardResult:
    """1.0 iff the last boxed answer of `response` equals `record["answer"]` per math-verify.

    Feedback names the model's own answer, and the gold only when `reveal_gold`."""
    return score_math_batch([response], [record], reveal_gold=reveal_gold, verifier=verifier)[0]


def check_math_batch(
    prepared: list[RewardResult | _Pending], verifier: MathVerifier | None = None
) -> list[RewardResult]:
    """Results for `prepare_math` outputs: every pending answer of the batch goes to the
    worker in one request (MathVerifier.check_many)."""
    pending = [p for p in prepared if isinstance(p, _Pending)]
    checked = iter((verifier or _VERIFIER.get()).check_many([(p.gold, p.answer) for p in pending]) if pending else [])
    return [_finish(p, next(checked)) if isinstance(p, _Pending) else p for p in prepared]


def score_math_batch(
    responses: list[str], records: list[dict], *, reveal_gold: bool = False, verifier: MathVerifier | None = None
) -> list[RewardResult]:
    """score_math of each (response, record) pair, with one worker request for the batch."""
    return check_math_batch(
        [prepare_math(r, rec, reveal_gold=reveal_gold) for r, rec in zip(responses, records, strict=True)], verifier
    )


# The reference's math reward feedback with its default `format_feedback=True` and
# `correctness_feedback=False` (SDPO-CL verl/utils/reward_score/feedback/math.py).
FORMAT_FEEDBACK = "Your answer had the wrong format. The solution must be given in the format: \\boxed{your_answer}."
TRUNCATED_FEEDBACK = "Your response was truncated because it exceeded the maximum length."


def format_feedback(result: RewardResult, truncated: bool) -> str | None:
    """Format-only feedback on a scored math response, as the reference writes it: a missing or
    empty \\boxed{} answer of a complete response, or a truncated response; None otherwise (a
    wrong answer in the right format gets no feedback)."""
    if truncated:
        return TRUNCATED_FEEDBACK
    if result.details.get("error") in ("no_box", "empty_box"):
        return FORMAT_FEEDBACK
    return None
