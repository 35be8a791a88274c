import time

import pytest

from megatron_sdpo.rewards import score
from megatron_sdpo.rewards.math import MathVerifier, extract_boxed, score_math


@pytest.mark.parametrize(
    "text,expected",
    [
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
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "gold,response,want",
    [
        ("12", "The answer is \\boxed{12}.", 1.0),
        ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
        ("x^2+1", "\\boxed{1 + x^2}", 1.0),
        ("\\sqrt{2}", "\\boxed{2^{1/2}}", 1.0),
        ("12", "\\boxed{13}", 0.0),
        ("12", "\\boxed{12} wait no \\boxed{14}", 0.0),
        ("12", "\\boxed{14} wait no \\boxed{12}", 1.0),
        ("12", "\\boxed{hello world}", 0.0),
    ],
)
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
    assert (
        time.monotonic() - start < 10.0
    )  # loose on purpose: catches a scan gone badly super-linear, not a loaded machine
    garbage = bytes(range(256)) * 100
    assert score("math", garbage, {"answer": "12"}).score == 0.0


def test_batch_equals_one_at_a_time_including_a_hang():
    """score_batch sends the whole batch to the worker at once: same results as scoring each
    response alone, the per-answer deadline still holds, and the answers after a killed one
    are checked by the restarted worker."""
    from megatron_sdpo.rewards.math import score_math_batch

    hang = "\\boxed{(9^{9999})^{9999}}"  # evades the refusal guards; math-verify never returns
    responses = [
        "\\boxed{12}",
        "\\boxed{13}",
        "no box",
        "\\boxed{}",
        "\\boxed{9^{9^{9}}}",
        "\\boxed{12}",
        hang,
        "\\boxed{0.5}",
        "\\boxed{\\frac{1}{2}}",
        "\\boxed{hello world}",
        "\\boxed{12}",
    ]
    records = [{"answer": "12"}] * 7 + [{"answer": "\\frac{1}{2}"}] * 2 + [{"answer": "12"}] * 2
    alone_verifier, batch_verifier = MathVerifier(timeout_s=1.5), MathVerifier(timeout_s=1.5)
    try:
        alone = [score_math(r, rec, verifier=alone_verifier) for r, rec in zip(responses, records, strict=True)]
        batch_verifier.check("1", "1")  # start the worker outside the timed region
        start = time.monotonic()
        batch = score_math_batch(responses, records, verifier=batch_verifier)
        # One deadline for the hang, plus a worker restart; far below the hang itself (forever).
        assert time.monotonic() - start < 1.5 + 60.0
    finally:
        alone_verifier.close()
        batch_verifier.close()
    assert [(r.score, r.feedback, r.details) for r in batch] == [(r.score, r.feedback, r.details) for r in alone]
    assert [r.score for r in batch] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert batch[6].details["error"] == "timeout" and batch[4].details["error"] == "too_complex"


def test_score_batch_math_matches_score():
    from megatron_sdpo.rewards import score_batch

    responses = ["\\boxed{4}", "\\boxed{5}", "", "\\boxed{2+2}", b"\\boxed{4}", None]
    records = [{"answer": "4"}] * 6
    batch = score_batch("math", responses, records)
    assert [(r.score, r.feedback) for r in batch] == [
        (s.score, s.feedback) for s in (score("math", x, rec) for x, rec in zip(responses, records, strict=True))
    ]
    assert [r.score for r in batch] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_a_bad_record_fails_only_its_own_sample():
    from megatron_sdpo.rewards import score_batch

    out = score_batch("math", ["\\boxed{4}", "\\boxed{4}"], [{"answer": "4"}, {}])
    assert out[0].score == 1.0 and out[1].details["error"] == "verifier_exception"


def test_format_feedback_is_the_reference_math_reward_default():
    """SDPO-CL's math reward with format_feedback=True, correctness_feedback=False: a wrong
    format or a truncated response gets its sentence, a wrong answer in the right format none."""
    from megatron_sdpo.rewards.math import FORMAT_FEEDBACK, TRUNCATED_FEEDBACK, format_feedback
    from megatron_sdpo.rewards.result import RewardResult

    assert (
        FORMAT_FEEDBACK
        == "Your answer had the wrong format. The solution must be given in the format: \\boxed{your_answer}."
    )
    assert TRUNCATED_FEEDBACK == "Your response was truncated because it exceeded the maximum length."
    no_box = RewardResult(0.0, "x", {"error": "no_box"})
    empty = RewardResult(0.0, "x", {"error": "empty_box"})
    wrong = RewardResult(0.0, "x", {"answer": "6", "error": None})
    assert format_feedback(no_box, False) == FORMAT_FEEDBACK and format_feedback(empty, False) == FORMAT_FEEDBACK
    assert format_feedback(wrong, False) is None
    assert format_feedback(no_box, True) == TRUNCATED_FEEDBACK and format_feedback(wrong, True) == TRUNCATED_FEEDBACK
