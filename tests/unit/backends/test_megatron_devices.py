"""Every tensor the megatron backend, the weights transport and the vocab-parallel losses create
names its device.

A torch factory without `device=` makes a CPU tensor, which on a GPU run is either an error at
the first op that mixes it with CUDA tensors or a silent host round trip. The scan is static
(AST), so it holds for code paths the CPU tests never reach. Tensors meant to live on the host
carry a `# host: <why>` comment on the call's line(s).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# cpu.py is the CPU shim itself (it only ever runs on CPU machines).
SCANNED = sorted(p for p in (ROOT / "megatron_sdpo/backends/megatron").glob("*.py") if p.name != "cpu.py") + [
    ROOT / "megatron_sdpo/backends/vocab_parallel.py",
    ROOT / "megatron_sdpo/weights/transport.py",
    ROOT / "megatron_sdpo/weights/convert.py",
]

# Functions that allocate a new tensor and default to the CPU. `*_like`, `Tensor.new_*` and
# ops on existing tensors inherit their input's device and are fine.
FACTORIES = frozenset(
    {
        "tensor",
        "as_tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "range",
        "linspace",
        "logspace",
        "eye",
        "rand",
        "randn",
        "randint",
        "randperm",
        "empty_strided",
        "tril_indices",
        "triu_indices",
        "scalar_tensor",
        "from_numpy",
    }
)
HOST_MARK = "# host:"


def violations(source: str, name: str = "<src>") -> list[str]:
    """'file:line torch.f(...)' for each factory call without `device=` and without a host mark."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        span = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
        if any(HOST_MARK in line for line in span):
            continue
        out.append(f"{name}:{node.lineno} torch.{f.attr}(...) has no device=")
    return out


def test_the_scan_catches_a_factory_without_device():
    src = (
        "import torch\n"
        "a = torch.zeros(3)\n"
        "b = torch.zeros(3, device=x.device)\n"
        "c = torch.tensor([1.0],\n    dtype=torch.float32)\n"
        "d = torch.arange(4)  # host: an index list for a Python loop\n"
        "e = torch.zeros_like(b)\n"
        "f = x.new_full((2,), 0.0)\n"
    )
    got = violations(src)
    assert [g.split()[0] for g in got] == ["<src>:2", "<src>:4"], got


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_tensor_factory_names_its_device(path):
    assert path.exists(), path
    bad = violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not bad, "tensor factories without an explicit device:\n" + "\n".join(bad)


def test_host_marks_say_why():
    for path in SCANNED:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if HOST_MARK in line:
                assert len(line.split(HOST_MARK, 1)[1].strip()) >= 10, f"{path}:{i}: a host mark needs a reason"


def test_vocab_parallel_losses_are_in_the_scan():
    assert ROOT / "megatron_sdpo/backends/vocab_parallel.py" in SCANNED
