"""The import contract (.importlinter, checked by import-linter in `make lint`) places every
package and top-level module of the project, and holds on the tree as it is."""

import configparser
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ROOTS = {"megatron_sdpo": REPO / "megatron_sdpo", "megatron_sdpo_kernels": REPO / "kernels" / "megatron_sdpo_kernels"}


def _contract() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / ".importlinter")
    return cfg


def _layered() -> set[str]:
    layers = _contract()["importlinter:contract:layers"]["layers"]
    return {name.strip() for line in layers.splitlines() for name in line.replace(":", "|").split("|") if name.strip()}


def _children() -> set[str]:
    """The units the contract must place: megatron_sdpo's modules and packages, and the kernels."""
    pkg = ROOTS["megatron_sdpo"]
    found = {f"megatron_sdpo.{p.stem}" for p in pkg.glob("*.py") if p.stem != "__init__"}
    found |= {f"megatron_sdpo.{d.name}" for d in pkg.iterdir() if (d / "__init__.py").is_file()}
    return found | {"megatron_sdpo_kernels"}


def test_every_package_and_top_level_module_has_a_layer():
    assert _children() - _layered() == set(), "add these to .importlinter's layers"
    assert _layered() - _children() == set(), "these layers name nothing in the tree"


def test_the_contract_names_packages_only():
    # Per package, no per-module exception: no layer lifts a module out of its package.
    deep = {n for n in _layered() if n.count(".") > 1 or (n.count(".") == 1 and n not in _children())}
    assert not deep
    assert "ignore_imports" not in "".join(str(dict(s)) for s in _contract().values())


def test_the_roots_are_the_package_folders():
    roots = _contract()["importlinter"]["root_packages"].split()
    assert roots == list(ROOTS) and all((p / "__init__.py").is_file() for p in ROOTS.values())


def test_the_contract_holds():
    pytest.importorskip("importlinter", reason="import-linter comes with the dev extra")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
            "--no-cache",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def _readme_layout() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Layout") :]
    return section[section.index("```\n") + 4 : section.index("\n```", section.index("```\n") + 4)]


def test_the_readme_layout_matches_the_tree():
    block = _readme_layout()
    pkg = ROOTS["megatron_sdpo"]
    units = {f"{d.name}/" for d in pkg.iterdir() if (d / "__init__.py").is_file()}
    units |= {p.name for p in pkg.glob("*.py") if p.stem != "__init__"}
    assert not {u for u in units if u not in block.split()}, "units of megatron_sdpo/ the README's layout omits"
    named = {w for w in block.split() if w.endswith((".py", "/")) and w[0].isalpha()}
    tracked = [
        Path(f).parts
        for f in subprocess.run(
            ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    ]
    present = {part + "/" for parts in tracked for part in parts[:-1]} | {parts[-1] for parts in tracked}
    assert not named - present, f"the README's layout names what the tree does not have: {sorted(named - present)}"
