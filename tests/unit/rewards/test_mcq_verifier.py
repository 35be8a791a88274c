import pytest

from megatron_sdpo.errors import DataError
from megatron_sdpo.rewards import score

REC = {"id": "q", "domain": "science", "choices": ["w", "x", "y", "z"], "answer": "B"}


@pytest.mark.parametrize(
    "response,want",
    [
        ("<answer>B</answer>", 1.0),
        ("reasoning...<answer> (B) </answer>", 1.0),
        ("<answer>B)</answer>", 1.0),
        ("<answer>B.</answer>", 1.0),
        ("<answer>b</answer>", 1.0),
        ("<ANSWER>\n  B\n</ANSWER>", 1.0),
        ("<answer>A</answer>", 0.0),
        ("<answer>B</answer> no wait <answer>C</answer>", 0.0),
        ("<answer>C</answer> no wait <answer>B</answer>", 1.0),
    ],
)
def test_letters(response, want):
    assert score("science", response, REC).score == want


@pytest.mark.parametrize(
    "response,fragment",
    [
        ("The answer is B", "No <answer>"),
        ("<answer>E</answer>", "from A to D"),
        ("<answer>BC</answer>", "Invalid answer"),
        ("<answer></answer>", "Invalid answer"),
        ("<answer>the second one</answer>", "Invalid answer"),
        ("<answer>B", "No <answer>"),
    ],
)
def test_format_errors(response, fragment):
    result = score("science", response, REC)
    assert result.score == 0.0 and fragment in result.feedback
    assert "correct answer" not in result.feedback


def test_wrong_answer_does_not_reveal_gold():
    result = score("science", "<answer>C</answer>", REC)
    assert result.feedback == "Your answer C is incorrect."


def test_bad_record_raises_data_error():
    with pytest.raises(DataError, match="letter"):
        score("science", "<answer>B</answer>", {**REC, "answer": "banana"})


def test_adversarial_inputs():
    assert score("science", "<answer>" * 100_000, REC).score == 0.0
    assert score("science", "\x00\xff<answer>B</answer>", REC).score == 1.0
