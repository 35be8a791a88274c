"""One list of domains, one way to import it: the config, the data records and the verifiers
read `interfaces.domains.DOMAINS`, and no module re-exports it under another path."""

import ast
from pathlib import Path

from megatron_sdpo.interfaces.domains import DOMAINS

ROOT = Path(__file__).resolve().parents[3]


def test_the_domains():
    assert DOMAINS == ("math", "science", "tooluse", "code")


def test_every_import_of_the_domains_names_their_one_module():
    wrong = []
    for path in (
        sorted((ROOT / "megatron_sdpo").rglob("*.py"))
        + sorted((ROOT / "tools").glob("*.py"))
        + sorted((ROOT / "tests").rglob("*.py"))
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(a.name == "DOMAINS" for a in node.names):
                if node.module != "megatron_sdpo.interfaces.domains":
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module}")
    assert wrong == []


def test_no_package_lists_the_domains_among_its_exports():
    for path in (ROOT / "megatron_sdpo").rglob("__init__.py"):
        assert '"DOMAINS"' not in path.read_text(), path
