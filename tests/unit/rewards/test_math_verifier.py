import time

import pytest

from megatron_sdpo.rewards import score
from megatron_sdpo.rewards.math import MathVerifier, extract_boxed, score_math


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{12}", "12"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("nested \\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
    ("\\boxed 5.", "5"),
    ("\\fbox{7}", "7"),
    ("\\boxed{3} and unclosed \\boxed{4", "3"),
    ("escaped \\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("no box here", None),
    ("\\boxed{", None),
    ("\\boxedx{3}", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("gold,response,want", [
    ("12", "The answer is \\boxed{12}.", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("x^2+1", "\\boxed{1 + x^2}", 1.0),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", 1.0),
    ("12", "\\boxed{13}", 0.0),
    ("12", "\\boxed{12} wait no \\boxed{14}", 0.0),
    ("12", "\\boxed{14} wait no \\boxed{12}", 1.0),
    ("12", "\\boxed{hello world}", 0.0),
])
def test_right_and_wrong_answers(gold, response, want):
    result = score("math", response, {"answer": gold})
    assert result.score == want, result


def test_feedback_hides_gold_unless_asked():
    result = score_math("\\boxed{13}", {"answer": "4217"})
    assert result.feedback == "Your final answer 13 is incorrect."
    assert "4217" not in result.feedback
    revealed = score_math("\\boxed{13}", {"answer": "4217"}, reveal_gold=True)
    assert "4217" in revealed.feedback and revealed.score == 0.0


def test_format_errors():
    assert score("math", "I think it's 12", {"answer": "12"}).feedback == "No \\boxed{} answer found."
    assert score("math", "\\boxed{}", {"answer": "12"}).score == 0.0


@pytest.mark.parametrize("answer", ["9^{9^{9}}", "2^{1234567}", "1" * 5000])
def test_pathological_answers_are_refused_fast(answer):
    start = time.monotonic()
    result = score("math", f"\\boxed{{{answer}}}", {"answer": "12"})
    assert result.score == 0.0 and result.details["error"] == "too_complex"
    # Refused before evaluation (the error says so); evaluated, these would not finish at all.
    # The bound only catches a refusal that became slow, with room for a loaded machine.
    assert time.monotonic() - start < 10.0


def test_hang_that_evades_the_guards_is_killed():
    verifier = MathVerifier(timeout_s=1.5)
    try:
        verifier.check("1", "1")  # start the worker outside the timed region
        start = time.monotonic()
        result = score_math("\\boxed{(9^{9999})^{9999}}", {"answer": "12"}, verifier=verifier)
        # Without the kill this never returns; the slack covers the worker's kill and a loaded machine.
        assert time.monotonic() - start < 1.5 + 5.0
        assert result.score == 0.0 and result.details["error"] == "timeout"
        assert "could not be checked in time" in result.feedback
        # The worker restarts and keeps working after the kill.
        assert score_math("\\boxed{12}", {"answer": "12"}, verifier=verifier).score == 1.0
    finally:
        verifier.close()


def test_huge_and_binary_responses_do_not_raise():
    huge = "x" * 2_000_000 + "\\boxed{12}"
    assert score("math", huge, {"answer": "12"}).score == 1.0
    start = time.monotonic()
    assert score("math", "\\boxed{" * 50_000, {"answer": "12"}).score == 0.0
    assert score("math", "\\boxed " * 50_000, {"answer": "12"}).score == 0.0
    assert time.monotonic() - start < 10.0  # loose on purpose: catches a scan gone badly super-linear, not a loaded machine
    garbage = bytes(range(256)) * 100
    assert score("math", garbage, {"answer": "12"}).score == 0.0
