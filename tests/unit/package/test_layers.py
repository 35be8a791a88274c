"""The package's import graph runs one way: no module imports from a higher layer.

Read from the source with `ast` (nothing is imported), so function-local imports count too.
A module's layer is the one of the longest entry in LAYERS that prefixes its dotted name under
megatron_sdpo; imports between modules of the same entry are free, imports between different
entries of one layer are not (a layer holds independent parts).
"""
import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PKG = "megatron_sdpo"
# Source roots of the installed package (setup.py's package_dir maps kernels/ in).
ROOTS = {PKG: REPO / "megatron_sdpo", f"{PKG}.kernels": REPO / "kernels"}

# Lowest first.
LAYERS = [
    ["errors"],
    # The definitions every engine shares: the generalized JSD, what a loss asks a backend to
    # distill, the teacher update as a blend, the LR schedule (torch and errors only;
    # algorithms/__init__ imports nothing).
    ["algorithms.divergence", "algorithms.distillation", "algorithms.blend", "backends.schedule"],
    # Foundations: each imports errors only.
    ["config", "data", "rewards", "weights", "kernels", "ranks", "run_dir", "chat", "engine_logs", "stopwatch", "stop_request",
     "memory_census"],
    # The backend seam's plain types: the batch and loss protocol, token layouts.
    ["backends.base", "backends.layout", "backends.varlen"],
    # Pure maths on tensors and batches; the memory ledger's arithmetic over the weight plan.
    ["algorithms", "memory_ledger", "data.benchmarks", "data.hub_table"],
    # The shipped tiny base (built with the algorithms' teacher prompt).
    ["models"],
    # Engines and measurements.
    ["backends", "rollout", "diagnostics"],
    ["trainer", "evaluation", "monitor", "launch_plan", "plots"],
    # Everything built from the config; files the run wrote, read and written; studies over runs.
    ["builders", "report", "study"],
    # The stage-end diagnostics' detached jobs (report's writers).
    ["drift_jobs"],
    ["continual", "evaluation_cli"],
    ["cli"],
    ["__main__"],
]
_ENTRY_LAYER = {entry: i for i, layer in enumerate(LAYERS) for entry in layer}


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, root in ROOTS.items():
        for f in root.rglob("*.py"):
            rel = f.relative_to(root).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((prefix, *rel))] = f
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Dotted names under megatron_sdpo that `module` imports (modules, or a module's names)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in found if n == PKG or n.startswith(PKG + ".")}


def _entry(name: str) -> str | None:
    """The LAYERS entry a dotted name belongs to (longest prefix), None for the package root."""
    parts = name.split(".")[1:]
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in _ENTRY_LAYER:
            return ".".join(parts[:k])
    return None


@functools.lru_cache(maxsize=1)
def _edges() -> list[tuple[str, str, str, str]]:
    """(importing module, imported name, its entry, the imported entry) across entries."""
    out = []
    for module, path in sorted(_modules().items()):
        src = _entry(module)
        for name in sorted(_imports(module, path)):
            dst = _entry(name)
            if src is not None and dst is not None and dst != src:
                out.append((module, name, src, dst))
    return out


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _modules() if m != PKG and _entry(m) is None)
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_no_import_runs_up_or_sideways():
    bad = [
        f"{module} imports {name} (layer {_ENTRY_LAYER[src]} {src!r} -> layer {_ENTRY_LAYER[dst]} {dst!r})"
        for module, name, src, dst in _edges()
        if _ENTRY_LAYER[dst] >= _ENTRY_LAYER[src]
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("upper", ["backends", "rollout", "trainer", "continual", "builders", "report", "algorithms"])
def test_config_imports_nothing_above_it(upper):
    assert not [e for e in _edges() if e[2] == "config" and e[3].split(".")[0] == upper]


@pytest.mark.parametrize("engine", ["backends", "rollout", "trainer", "chat", "continual", "builders"])
def test_report_only_reads_and_writes(engine):
    # The stage diagnostics are computed in diagnostics/ and handed to report.py to write.
    assert not [e for e in _edges() if e[2] == "report" and e[3].split(".")[0] == engine]


def test_the_check_sees_function_local_imports(tmp_path):
    # The config loader once built the LR schedule with an import inside a function.
    f = tmp_path / "loader.py"
    f.write_text("def lr_schedule(cfg):\n    from megatron_sdpo.backends.schedule import LRSchedule\n")
    assert _imports("megatron_sdpo.config.loader", f) == {"megatron_sdpo.backends.schedule.LRSchedule"}
    f.write_text("from ..backends import schedule\n")
    assert _imports("megatron_sdpo.config.loader", f) == {"megatron_sdpo.backends.schedule"}


def _module_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (an imported name resolves to its module)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        deps = set()
        for name in _imports(module, path):
            target = name if name in modules else name.rpartition(".")[0]
            if target in modules and target != module:
                deps.add(target)
        graph[module] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # Within a layer entry too (config/loader.py and config/stages.py once imported each other
    # through a function-local import).
    assert not _cycles(_module_graph())


def test_the_cycle_check_sees_a_function_local_cycle():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]
