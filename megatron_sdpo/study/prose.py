"""Verdict words in a findings document's prose: generated, or checked against the cell they state.

A sentence that says a metric is *established*, *equivalent*, lower, higher, the same, ... must
not disagree with its interval. Two ways to write one:

- a generated cell, `<!-- cell: results/<study> BASELINE ARM METRIC -->…<!-- /cell -->`, which
  `results render` fills from the data (`cell_text`: the direction word the interval supports,
  arm − baseline with its interval at the level the metric is judged at, the seeds' signs and
  the verdict), so the word is the data's;
- a word of the prose in the same sentence as a cell, which `check` holds to the nearest cell:
  "lower" / "less" need the cell's interval below 0, "higher" / "more" above 0, "same" / "level"
  an *equivalent* verdict, *established* / *contradicted* / *equivalent* / *inconclusive* that
  verdict; "not" or "no" before the word turns the check around.

`check(text)` lists every verdict word of the prose (outside code, generated blocks and cells)
that is neither: what a test holds docs/findings.md to. Uses of the words that state nothing
about a metric ("the same items", "its Holm level") are the phrases of `NOT_A_VERDICT`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megatron_sdpo.study.findings import Comparison, _f

# The verdict words (the list; "held" / "hold" with "holds").
WORDS = (
    "established",
    "contradicted",
    "equivalent",
    "inconclusive",
    "holds",
    "held",
    "hold",
    "level",
    "same",
    "no faster",
    "less",
    "more",
    "lower",
    "higher",
)
_WORD = re.compile(r"\b(" + "|".join(w.replace(" ", r"\s+") for w in WORDS) + r")\b", re.I)
# Phrases where a verdict word names no verdict about a metric (each checked by hand).
NOT_A_VERDICT = tuple(
    re.compile(p, re.I)
    for p in (
        r"(\b(Holm's|Holm|its|the|a|each|their|this|that|whose|confidence|significance)|%)\s+level\b",
        r"\blevel\s+(it|they)\s+(is|are)\s+judged",
        r"\b(lower|upper)\s+(one-sided\s+)?(bound|end|third)",
        r"\ba\s+test\s+holds\b",
        r"\bthe\s+same\s+(items|exhaustive\s+items|prompts?|way|eval\s+numbers|bytes|seed|`results/|commit|model|"
        r"values\s+within|numbers\s+on\s+every\s+seed|as\s+tiny's|design|preset|checkpoint|runs?\b)",
        r"\"same\s+operation",
        # The verdicts' definitions (docs/findings.md's first paragraph), not verdicts about a metric.
        r"\*established\*\s*/\s*\*contradicted\*:\s*the\s+interval",
        r"\*equivalent\*:\s*two\s+one-sided",
        r"\*inconclusive\*\s+otherwise",
        # The regime rule's definitions (docs/findings.md, the competence probe); its outcomes are generated.
        r"\*(not\s+)?held\*\s+when",
        r"\bor\s+more\b",
        r"\bone\s+or\s+more\b",
        r"\bmore\s+than\s+(one|two|half|\d)",
        r"\bno\s+more\s+than\s+\d",
        r"\bmore\s+(runs|seeds|steps|items|prompts|samples|time|memory)\b",
    )
)
_CELL = re.compile(r"<!-- cell: ([^>]*?) -->(.*?)<!-- /cell -->", re.S)
_BLOCKS = re.compile(r"<!-- ([a-z-]+)-table: [^>]*?-->.*?<!-- /\1-table -->|```.*?```", re.S)
# An end of sentence: . ! ? before white space and a capital, a list item or a paragraph break.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z*(\[`#])|\n\s*\n|\n(?=\s*[-*] )|\n(?=#)")


# -- the generated cell --------------------------------------------------------------------------
def direction_word(c: Comparison) -> str:
    """What the interval at the metric's own level supports: "level" (*equivalent*), "higher" /
    "lower" (it excludes 0), or "not resolved" (it spans 0)."""
    if c.verdict == "equivalent":
        return "level"
    lo, hi = _bounds(c)
    if lo is not None and lo > 0:
        return "higher"
    if hi is not None and hi < 0:
        return "lower"
    return "not resolved"


def _bounds(c: Comparison) -> tuple[float | None, float | None]:
    j, s = c.judgement, c.summary
    if j is not None and j.lo is not None:
        return j.lo, j.hi
    return (s.lo, s.hi) if s is not None else (None, None)


def cell_text(c: Comparison) -> str:
    """A cell's generated text: "lower: -0.093 [-0.144, -0.043] (95%), +0 −6 of 6 seeds, *descriptive*"."""
    s = c.summary
    if s is None:
        return "no paired seeds"
    lo, hi = _bounds(c)
    level = c.judgement.level if c.judgement is not None else 0.95
    interval = "" if lo is None or hi is None else f" [{_f(lo)}, {_f(hi)}]"
    pct = f"{100 * level:.2f}".rstrip("0").rstrip(".")
    return (
        f"{direction_word(c)}: {_f(s.mean)}{interval} ({pct}%), +{s.positive} −{s.negative} of {s.n} seeds, "
        f"*{c.verdict}*"
    )


def render_cells(text: str, comparisons) -> str:
    """`text` with every cell refilled; comparisons(folder, baseline, arm) -> {metric: Comparison}."""
    from megatron_sdpo.errors import UserError

    def fill(m: re.Match) -> str:
        parts = m.group(1).split()
        if len(parts) != 4:
            raise UserError(f"<!-- cell: {m.group(1)} -->: expected <!-- cell: FOLDER BASELINE ARM METRIC -->")
        comps = comparisons(Path(parts[0]), parts[1], parts[2])
        if parts[3] not in comps:
            raise UserError(f"{parts[0]}: no metric {parts[3]} (study/metrics.py names them)")
        return f"<!-- cell: {m.group(1)} -->{cell_text(comps[parts[3]])}<!-- /cell -->"

    return _CELL.sub(fill, text)


# -- the check -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    word: str
    sentence: str
    why: str

    def __str__(self) -> str:
        return f"{self.word!r} {self.why}: {self.sentence}"


def _mask(text: str, pattern: re.Pattern, keep: str = " ") -> str:
    return pattern.sub(lambda m: re.sub(r"[^\n]", keep, m.group(0)), text)


def _cell_claims(cell: str) -> tuple[str, str]:
    """(direction word, verdict) of a generated cell's text."""
    word = cell.split(":", 1)[0].strip()
    verdict = re.findall(r"\*([a-z]+)\*", cell)
    return word, verdict[-1] if verdict else ""


def _agrees(word: str, negated: bool, cell: tuple[str, str]) -> bool:
    direction, verdict = cell
    w = " ".join(word.lower().split())
    if w in ("established", "contradicted", "equivalent", "inconclusive"):
        return verdict == w and not negated
    if w in ("holds", "held", "hold"):
        return (verdict == "established") != negated
    if w == "no faster":
        return direction in ("lower", "level")
    want = {"lower": "lower", "less": "lower", "higher": "higher", "more": "higher", "same": "level", "level": "level"}[
        w
    ]
    if negated:
        return direction != want and direction != "not resolved"
    return direction == want


def check(text: str) -> list[Problem]:
    """Every verdict word of `text`'s prose that is neither generated nor agrees with the nearest
    generated cell of its sentence (module docstring)."""
    prose = _mask(text, _BLOCKS)
    cells = [(m.start(), m.end(), _cell_claims(m.group(2))) for m in _CELL.finditer(prose)]
    # Cells and inline code are opaque to the sentence split and the word search.
    flat = _mask(prose, _CELL, "#")
    flat = _mask(flat, re.compile(r"`[^`]*`|\]\([^)\n]*\)"), "#")  # a code span may wrap a line
    problems = []
    bounds = [0, *(m.end() for m in _SENTENCE_END.finditer(flat)), len(flat)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        sentence = flat[a:b]
        for m in _WORD.finditer(sentence):
            start = a + m.start()
            if any(_covers(p, prose, start) for p in NOT_A_VERDICT):  # prose: the code spans unmasked
                continue
            mine = [c for c in cells if a <= c[0] < b]
            shown = " ".join(text[a:b].split())
            if not mine:
                problems.append(Problem(m.group(1), shown, "is not generated and its sentence has no cell"))
                continue
            nearest = min(mine, key=lambda c: min(abs(c[0] - start), abs(c[1] - start)))
            before = flat[max(a, start - 30) : start].lower()  # "not", "no", or one word between
            negated = bool(re.search(r"\b(not|no)\s+(\w+\s+)?$", before))
            if not _agrees(m.group(1), negated, nearest[2]):
                problems.append(
                    Problem(m.group(1), shown, f"disagrees with its cell ({nearest[2][0]}, *{nearest[2][1]}*)")
                )
    return problems


def _covers(pattern: re.Pattern, text: str, pos: int) -> bool:
    """Whether a match of `pattern` near `pos` contains the character at `pos`."""
    for m in pattern.finditer(text, max(0, pos - 40), min(len(text), pos + 60)):
        if m.start() <= pos < m.end():
            return True
    return False
