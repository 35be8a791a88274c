"""Importing the package (and its CPU-side modules) pulls in no GPU-only or heavy optional package."""

import subprocess
import sys

HEAVY = ("vllm", "megatron", "triton", "transformer_engine", "nemo_run", "wandb", "liger_kernel")


def _loaded_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_import_megatron_sdpo_is_light():
    loaded = _loaded_after("import megatron_sdpo")
    assert not loaded & set(HEAVY), loaded & set(HEAVY)
    assert "torch" not in loaded  # the bare package import does not even need torch


def test_cpu_modules_import_no_gpu_package():
    stmt = (
        "import megatron_sdpo.config, megatron_sdpo.algorithms.losses, megatron_sdpo.rewards, "
        "megatron_sdpo.data.loaders, megatron_sdpo.data.synthetic, megatron_sdpo.cli, megatron_sdpo_kernels"
    )
    loaded = _loaded_after(stmt)
    assert not loaded & {"vllm", "megatron", "transformer_engine", "nemo_run"}, loaded
