"""docs/findings.md's generated blocks equal what the committed study data give: each block names
its results folder, baseline and arm (and, for a metrics table, its metrics; a probe table only
its folder), and is regenerated here from those files alone (`results render docs/findings.md`
rewrites them)."""

from pathlib import Path

import pytest

from megatron_sdpo.errors import UserError
from megatron_sdpo.study import results

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "findings.md"


def _blocks():
    return results.blocks(DOC.read_text())


def test_findings_md_cites_its_data():
    kinds = {kind for kind, _, _ in _blocks()}
    assert kinds == {
        "findings",
        "metrics",
        "probe",
        "regime",
        "safeguard-tuning",
        "safeguard",
        "safeguard-secondary",
        "safeguard-collapse",
        "safeguard-post-hoc",
    }, kinds
    for kind, args, _ in _blocks():
        for folder in args.split()[: 2 if kind == "safeguard-post-hoc" else 1]:
            assert (ROOT / folder / ("probes.json" if kind in ("probe", "regime") else "study.json")).is_file(), args


@pytest.mark.parametrize("kind, args, text", _blocks())
def test_findings_tables_are_generated_from_the_committed_data(kind, args, text, monkeypatch):
    monkeypatch.chdir(ROOT)
    doc = f"<!-- {kind}-table: {args} -->\nstale\n<!-- /{kind}-table -->"
    rendered = results.render_blocks(doc).splitlines()[1:-1]
    assert text.splitlines() == rendered


def test_render_rewrites_a_stale_block_and_names_a_bad_one(monkeypatch):
    monkeypatch.chdir(ROOT)
    folder = _blocks()[0][1].split()[0]
    stale = f"a\n<!-- metrics-table: {folder} grpo sdpo_frozen final_avg_id -->\nold\n<!-- /metrics-table -->\nb"
    new = results.render_blocks(stale)
    assert "old" not in new and new.startswith("a\n") and new.endswith("\nb")
    assert "| `final_avg_id` |" in new
    with pytest.raises(UserError, match="no metric final_avg"):
        results.render_blocks(stale.replace("final_avg_id", "final_avg"))
    with pytest.raises(UserError, match="expected <!-- metrics-table: FOLDER BASELINE ARM METRIC"):
        results.render_blocks(stale.replace(" final_avg_id", ""))
