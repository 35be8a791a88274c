"""Verdict words in docs/findings.md's prose: generated in a cell, or held to the nearest cell of
their sentence (study/prose.py). The check on hand-written sentences (among them sentences the
document carried before the cells: each fails), the cell's text on a hand-built comparison, and
the document itself: every cell regenerated from the committed data, no unbacked verdict word."""

from pathlib import Path

import pytest

from megatron_sdpo.study import prose, results, stats
from megatron_sdpo.study.findings import Comparison
from megatron_sdpo.study.inference import Judgement
from megatron_sdpo.study.metrics import METRICS

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "findings.md"


def cell(text: str) -> str:
    return f"<!-- cell: results/x grpo sdpo m -->{text}<!-- /cell -->"


LOWER = cell("lower: -0.093 [-0.144, -0.043] (95%), +0 −6 of 6 seeds, *descriptive*")
SPAN = cell("not resolved: -0.022 [-0.110, 0.067] (95%), +3 −3 of 6 seeds, *inconclusive*")
LEVEL = cell("level: -0.0051 [-0.035, 0.025] (95%), +4 −2 of 6 seeds, *equivalent*")
ESTABLISHED = cell("higher: 0.004 [0.001, 0.007] (97.5%), +4 −0 of 4 seeds, *established*")


@pytest.mark.parametrize(
    "sentence",
    [
        # Sentences of docs/findings.md before this check (each states more than its interval).
        "It learns the MATH stage no faster (−0.022 [−0.110, 0.067], inconclusive).",
        "It moves its weights less than GRPO, the opposite of the paper's drift claim (*contradicted*).",
        "Repeated `\\boxed` grows more (0.031 against 0.009, 5 of 6 seeds; the interval [−0.005, 0.049] crosses 0).",
        "Drift (spectral shift, largest principal angle) is about the same for every arm at this length (8 steps).",
        "In-domain, SDPO₀ ends level on the average (−0.014 [−0.097, 0.070], inconclusive).",
        # A word next to a cell that does not say it.
        f"Its math gain is lower: {SPAN}.",
        f"It learns math no faster ({SPAN}).",
        f"The final average is *established* ({LEVEL}).",
        f"The final average is the same ({LOWER}).",
        f"It is not lower ({SPAN}).",
        f"It is not distinguishably lower ({SPAN}).",
    ],
)
def test_an_unbacked_verdict_word_fails(sentence):
    assert prose.check(sentence), sentence


@pytest.mark.parametrize(
    "sentence",
    [
        f"Its math gain is {LOWER}.",  # the word is generated
        f"Its math gain is lower ({LOWER}), as is its code gain.",  # held to the nearest cell
        f"The final average is the same ({LEVEL}), *equivalent* by the rule.",
        f"The largest angle is {ESTABLISHED}, established in sign only.",
        f"It is not lower ({ESTABLISHED}).",
        "Every seed answers the same items at its Holm level; a difference of 0.03 or more.",  # no verdict
        "```\nlower and higher inside code\n```",
        "<!-- findings-table: results/x grpo sdpo -->\n| lower | *established* |\n<!-- /findings-table -->",
    ],
)
def test_a_generated_or_backed_verdict_word_passes(sentence):
    assert prose.check(sentence) == [], prose.check(sentence)


def test_the_nearest_cell_of_the_sentence_decides():
    # "lower" sits next to the unresolved cell; the resolved one is farther away.
    assert prose.check(f"Math {SPAN} is lower, unlike code, which after a long aside is {LOWER}.")
    # A sentence boundary separates the word from the other sentence's cell.
    assert prose.check(f"Code is {LOWER}. Math is lower.")


def _comparison(diffs, verdict, level=0.95, lo=None, hi=None):
    s = stats.paired_summary(diffs)
    j = Judgement(True, level, s.lo if lo is None else lo, s.hi if hi is None else hi, None, verdict)
    return Comparison(METRICS[0], "arm", None, None, s, None, verdict, None, j)


def test_the_cell_text_says_what_its_interval_supports():
    low = _comparison([-0.1, -0.12, -0.08], "descriptive")
    assert prose.cell_text(low).startswith("lower: -0.100 [") and low.verdict in prose.cell_text(low)
    assert "+0 −3 of 3 seeds, *descriptive*" in prose.cell_text(low)
    assert prose.direction_word(_comparison([0.1, -0.12, 0.05], "inconclusive")) == "not resolved"
    assert prose.direction_word(_comparison([0.01, 0.0, 0.02], "equivalent")) == "level"
    # The judged level's interval decides, not the 95% one: at 98.3% it spans 0.
    wide = _comparison([0.05, 0.06, 0.04], "inconclusive", level=0.983, lo=-0.01, hi=0.11)
    assert prose.cell_text(wide).startswith("not resolved: 0.050 [-0.010, 0.110] (98.3%)")


def test_a_cell_names_a_comparison_the_data_have(monkeypatch):
    from megatron_sdpo.errors import UserError

    monkeypatch.chdir(ROOT)
    good = "<!-- cell: results/tiny_study6 grpo sdpo_frozen final_avg_id -->old<!-- /cell -->"
    assert "*equivalent*<!-- /cell -->" in results.render_blocks(good) and "old" not in results.render_blocks(good)
    with pytest.raises(UserError, match="no metric final_avg"):
        results.render_blocks(good.replace("final_avg_id", "final_avg"))
    with pytest.raises(UserError, match="expected <!-- cell: FOLDER BASELINE ARM METRIC -->"):
        results.render_blocks(good.replace(" final_avg_id", ""))


def test_findings_md_states_no_verdict_its_cells_do_not_carry():
    problems = prose.check(DOC.read_text())
    assert not problems, "\n".join(map(str, problems))


def test_findings_md_cells_are_generated_from_the_committed_data(monkeypatch):
    monkeypatch.chdir(ROOT)
    text = DOC.read_text()
    assert text.count("<!-- cell: ") >= 40
    assert results.render_blocks(text) == text, (
        "a cell or block differs from its data: run `results render docs/findings.md`"
    )
