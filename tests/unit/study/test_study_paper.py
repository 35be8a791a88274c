"""The paper's directions: each sign from the paper's own two numbers, none for a metric the paper
gives no number for or against another baseline, and docs/studies.md's table equal to the code's."""

from pathlib import Path

import pytest

from megatron_sdpo.study import paper
from megatron_sdpo.study.metrics import FINDINGS, METRICS

DOCS = Path(__file__).resolve().parents[3] / "docs" / "studies.md"


@pytest.mark.parametrize(
    "name, want",
    [
        # SDPO specializes faster in MATH (+73% vs +38%) but learns tool use less (-25% vs +24%) in its
        # own stage (plot readings to ±5 points); code, +17% vs +21%, is 4 points apart: no direction.
        ("in_stage_gain/math", +1),
        ("in_stage_gain/tooluse", -1),
        ("in_stage_gain/code", None),
        # Final MATH 34.4 vs 57.3, TOOLUSE 9.9 vs 57.7: SDPO ends lower, keeps less, forgets more.
        ("final_id/math", -1),
        ("final_id/tooluse", -1),
        ("final_avg_id", -1),
        ("backward_transfer", -1),
        ("forgetting", +1),
        # Drift: spectral shift ~4x, angle 2.5 vs 0-0.5 degrees, response cosine 91-94% vs 96-97%.
        ("spectral_shift", +1),
        ("max_angle_deg", +1),
        ("response_cosine", -1),
    ],
)
def test_directions_follow_the_papers_numbers(name, want):
    n = paper.PAPER[name]
    assert n.direction == want
    assert paper.direction(name, "grpo") == want
    assert n.provenance in (paper.TRANSCRIBED, paper.PLOT)
    assert paper.direction(name, "sdpo_frozen") is None  # not the paper's baseline


def test_metrics_without_a_paper_number_are_descriptive():
    directed = {m.name for m in METRICS if m.direction is not None}
    assert directed == {name for name, n in paper.PAPER.items() if n.resolved}
    assert "in_stage_gain/code" in paper.PAPER and "in_stage_gain/code" not in directed
    for name in ("in_stage_gain", "in_stage_gain/science", "reward_auc", "ood_change/mid", "boxed_repeat_gain"):
        assert paper.direction(name, "grpo") is None, name


def test_a_plot_reading_states_its_resolution_and_decides_its_direction():
    """Two readings within twice the resolution give no direction; a transcription has none."""
    close = paper.PaperNumber(17.0, 21.0, 1, "17 vs 21", "a figure", paper.PLOT, 2.5)
    assert close.direction is None and "unresolved" in close.provenance_text
    far = paper.PaperNumber(17.0, 21.0, 1, "17 vs 21", "a figure", paper.PLOT, 1.5)
    assert far.direction == -1 and far.provenance_text == "plot reading, ±1.5"
    assert paper.PaperNumber(34.4, 57.3, -1, "x", "a table", paper.TRANSCRIBED).direction == +1
    with pytest.raises(ValueError, match="states its resolution"):
        paper.PaperNumber(1.0, 2.0, 1, "x", "a figure", paper.PLOT)
    with pytest.raises(ValueError, match="states its resolution"):
        paper.PaperNumber(1.0, 2.0, 1, "x", "a table", paper.TRANSCRIBED, 0.5)
    with pytest.raises(ValueError, match="provenance must be"):
        paper.PaperNumber(1.0, 2.0, 1, "x", "the text", "text")


def test_every_finding_has_a_registered_primary():
    names = {m.name for m in METRICS}
    assert set(paper.PRIMARY) == set(FINDINGS) and set(paper.PRIMARY.values()) <= names


def test_docs_table_is_the_codes():
    text = DOCS.read_text()
    block = text.split("<!-- directions:begin -->\n", 1)[1].split("\n<!-- directions:end -->", 1)[0]
    assert block.splitlines() == paper.direction_table()
