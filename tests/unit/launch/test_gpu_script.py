"""tests/gpu/run_gpu_checks.sh's CPU path, in a bare environment holding only the GPU machine
image's packages (torch, transformers, pytest, numpy, safetensors, pyyaml; `make gpu-image-venv`,
which `make test` builds) with the project not installed: each part installs the project and the
wheel folder offline, imports it, collects every GPU test, reports every check as skipped with
its reason and exits 0; a collection error fails the part."""

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
IMAGE = REPO / ".venv-gpu-image"
SCRIPT = "tests/gpu/run_gpu_checks.sh"
# The checks each part reports, and the GPU tests it collects.
CHECKS = {"kernels": 4, "megatron": 5}
COLLECTED = {"kernels": 8, "megatron": 5}

needs_image = pytest.mark.skipif(
    not (IMAGE / ".installed").is_file(), reason="the bare GPU-image environment is missing: make gpu-image-venv"
)
no_gpu = pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="this machine has a CUDA GPU: the checks would run"
)


@pytest.fixture
def checkout(tmp_path):
    """A copy of the working tree, as the GPU machine gets it (the build writes into it)."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    dest = tmp_path / "checkout"
    for f in files:
        src = REPO / f
        if src.is_file() and not f.startswith(".venv"):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            (dest / f).write_bytes(src.read_bytes())
    return dest


def _run(checkout: Path, out: Path, *parts: str, **extra: str) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(out)),
        "PYTHON": str(IMAGE / "bin" / "python"),
        "GPU_WHEELS": str(IMAGE / "wheels"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INDEX": "1",
        **extra,
    }
    return subprocess.run(
        ["bash", SCRIPT, *parts, "--out", str(out)], cwd=checkout, env=env, capture_output=True, text=True, timeout=600
    )


@needs_image
@no_gpu
def test_every_part_installs_collects_and_skips_with_its_reason(checkout, tmp_path):
    bare = subprocess.run(
        [str(IMAGE / "bin" / "python"), "-c", "import megatron_sdpo"], cwd=tmp_path, capture_output=True, text=True
    )
    assert bare.returncode != 0, "the project must not be installed in the bare environment beforehand"
    proc = _run(checkout, tmp_path / "out", "all")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for part, n_checks in CHECKS.items():
        summary = (tmp_path / "out" / part / "summary.txt").read_text().splitlines()
        assert f"collected {COLLECTED[part]} tests" in "\n".join(summary), summary
        (expected,) = re.findall(r"expected on the GPU: .* = (\d+) s;", "\n".join(summary))
        assert int(expected) < 300  # each part fits in 5 minutes of the device
        skipped = [line for line in summary if line.startswith("SKIPPED ")]
        assert len(skipped) == n_checks and all(line.endswith(": no CUDA GPU visible") for line in skipped), summary
        assert summary[-1].startswith(f"part {part} finished with status 0")
        assert not any(line.startswith("FAILED") for line in summary)
    # The tests ran against the installed copy, which carries the kernels and the package data.
    site = tmp_path / "out" / "site"
    assert (site / "megatron_sdpo_kernels" / "fused.py").is_file()
    assert (site / "megatron_sdpo" / "config" / "presets" / "base.yaml").is_file()
    assert (site / "megatron" / "core").is_dir()  # the wheel folder's megatron-core


@needs_image
@no_gpu
def test_a_collection_error_fails_the_part(checkout, tmp_path):
    test = checkout / "tests" / "kernels" / "test_kl_gpu.py"
    test.write_text("import no_such_module_anywhere\n" + test.read_text())
    proc = _run(checkout, tmp_path / "out", "kernels")
    assert proc.returncode != 0
    summary = (tmp_path / "out" / "kernels" / "summary.txt").read_text()
    assert "FAILED collection" in summary, summary


# A CUDA machine, simulated: the bare image's torch reports a GPU (sitecustomize, imported by every
# interpreter the script starts).
FAKE_CUDA = """
import torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda *a: (9, 0)
torch.cuda.get_device_name = lambda *a: "simulated H100"
"""


def _simulated_gpu(tmp_path: Path) -> str:
    shim = tmp_path / "fake_cuda"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(FAKE_CUDA)
    return str(shim)


@needs_image
@no_gpu
def test_on_a_gpu_without_the_wheel_folder_the_checks_fail_in_one_line(checkout, tmp_path):
    empty = tmp_path / "no_wheels"
    empty.mkdir()
    proc = _run(checkout, tmp_path / "out", "all", GPU_WHEELS=str(empty), PYTHONPATH=_simulated_gpu(tmp_path))
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: a CUDA GPU is here but") and proc.stderr.count("\n") == 1, proc.stderr


@needs_image
@no_gpu
def test_on_a_gpu_a_part_missing_megatron_core_or_triton_fails_unrun(checkout, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for whl in (IMAGE / "wheels").glob("setuptools-*.whl"):  # the build backend only
        (wheels / whl.name).write_bytes(whl.read_bytes())
    proc = _run(checkout, tmp_path / "out", "all", GPU_WHEELS=str(wheels), PYTHONPATH=_simulated_gpu(tmp_path))
    assert proc.returncode != 0
    megatron = (tmp_path / "out" / "megatron" / "summary.txt").read_text()
    kernels = (tmp_path / "out" / "kernels" / "summary.txt").read_text()
    assert "FAILED megatron BF16 GRPO/SDPO steps" in megatron and "megatron.core is not installed" in megatron
    assert "FAILED Liger's fused linear JSD" in kernels and "not run, what it checks is missing" in kernels
    assert "pytest:" not in megatron + kernels  # nothing ran on the simulated GPU
    assert "FP8 step" not in megatron  # Transformer Engine stays optional (no failure for it)


def test_a_part_must_be_named_and_known(tmp_path):
    for args, message in ([], "name a part"), (["kernel"], "unknown part or option 'kernel'"):
        proc = subprocess.run(["bash", SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
