"""Multiple-choice verifier: the letter inside the last ``<answer>...</answer>``."""

from __future__ import annotations

import re

from megatron_sdpo.errors import DataError
from megatron_sdpo.rewards.result import RewardResult, clip_text

__all__ = ["extract_choice", "score_mcq"]

# "B", "(B)", "B)", "B.", "B:" and "Answer: B" forms; anything else is a format error.
_LETTER = re.compile(r"^(?:answer\s*[:：]?\s*)?\(?\s*([A-Za-z])\s*\)?\s*[.:)]?$", re.IGNORECASE)
_MAX_RESPONSE_CHARS = 200_000


def extract_choice(response: str) -> tuple[str | None, str | None]:
    """(letter, raw) from the last answer tag: letter upper-cased or None when the tag's content
    is not a single letter; raw is the tag's content (None when there is no tag)."""
    # rfind, not a regex: `<answer>(.*?)</answer>` is quadratic on many unclosed tags.
    text = response[-_MAX_RESPONSE_CHARS:]
    low = text.lower()
    end = low.rfind("</answer>")
    start = low.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return None, None
    raw = text[start + len("<answer>") : end].strip()
    match = _LETTER.match(raw)
    return (match.group(1).upper() if match else None), raw


def score_mcq(response: str, record: dict) -> RewardResult:
    """1.0 iff the chosen letter equals `record["answer"]`; letters outside the record's choices
    score 0 with a format feedback. The gold letter is never revealed."""
    gold = str(record["answer"]).strip().upper()
    choices = record.get("choices") or []
    if not (len(gold) == 1 and "A" <= gold <= "Z"):
        raise DataError(f"record {record.get('id')!r}: MCQ answer must be a letter, got {gold!r}")
    n = len(choices) if choices else 26
    valid = [chr(ord("A") + i) for i in range(n)]
    letter, raw = extract_choice(response)
    if raw is None:
        return RewardResult(
            0.0,
            "No <answer>...</answer> tag found; end with <answer>X</answer> where X is the letter of your choice.",
            {"error": "no_tag"},
        )
    if letter is None or letter not in valid:
        return RewardResult(
            0.0,
            f"Invalid answer {clip_text(raw, 40)!r}: the <answer> tag must "
            f"contain one letter from {valid[0]} to {valid[-1]}.",
            {"error": "invalid_letter", "raw": clip_text(raw, 40)},
        )
    if letter == gold:
        return RewardResult(1.0, f"Your answer {letter} is correct.", {"answer": letter})
    return RewardResult(0.0, f"Your answer {letter} is incorrect.", {"answer": letter})
