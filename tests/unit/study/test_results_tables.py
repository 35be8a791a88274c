"""Every committed study table (results/<study>/study_vs_<baseline>.md) is what `results
tabulate` writes from the committed data, byte for byte: a table edited by hand, or data changed
without regenerating it, fails here."""

import shutil
from pathlib import Path

import pytest

from megatron_sdpo.study import results

ROOT = Path(__file__).resolve().parents[3]
TABLES = sorted(ROOT.glob("results/*/study_vs_*.md"))
# The README's `results tabulate` example regenerates this one byte for byte in the document test
# (tests/e2e/test_readme_examples.py): half a minute of bootstrap not spent twice.
README_TABLE = ROOT / "results" / "tiny_study6" / "study_vs_grpo.md"


def test_every_exported_study_has_its_tables():
    studies = sorted(p.parent for p in ROOT.glob("results/*/study.json"))
    assert studies and all(any(t.parent == s for t in TABLES) for s in studies), studies
    # The table left to the document test is still the one the README's example regenerates.
    assert "results tabulate results/tiny_study6 --baseline grpo" in (ROOT / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("table", [t for t in TABLES if t != README_TABLE], ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_the_committed_table_is_the_tabulated_one(table, tmp_path):
    study = tmp_path / table.parent.name
    shutil.copytree(table.parent, study)
    baseline = table.stem.removeprefix("study_vs_")
    (written,) = results.tabulate(study, [baseline])
    assert written.read_bytes() == table.read_bytes(), f"{table.relative_to(ROOT)} differs from what its data give"
    assert (study / "study.csv").read_bytes() == (table.parent / "study.csv").read_bytes()
