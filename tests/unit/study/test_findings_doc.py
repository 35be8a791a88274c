"""docs/findings.md's generated blocks equal what the committed study data give: each block names
its results folder, baseline and arm, and is regenerated here from those files alone."""
import re
from pathlib import Path

import pytest

from megatron_sdpo.study import results

ROOT = Path(__file__).resolve().parents[3]
BLOCK = re.compile(r"<!-- findings-table: (\S+) (\S+) (\S+) -->\n(.*?)\n<!-- /findings-table -->", re.S)


def _blocks():
    return BLOCK.findall((ROOT / "docs" / "findings.md").read_text())


def test_findings_md_cites_its_data():
    assert _blocks(), "docs/findings.md has no generated findings table"
    for folder, _, _, _ in _blocks():
        assert (ROOT / folder / "study.json").is_file(), folder


@pytest.mark.parametrize("folder, baseline, arm, text", _blocks())
def test_findings_tables_are_generated_from_the_committed_data(folder, baseline, arm, text, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert text.splitlines() == results.findings_table(Path(folder), baseline, arm)
