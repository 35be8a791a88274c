"""tests/gpu/run_gpu_checks.sh on a machine without a CUDA GPU: every check is reported as
skipped with its reason, nothing fails."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA GPU: the checks would run")
def test_the_gpu_script_skips_every_check_with_its_reason_without_a_gpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_WHEELS": str(tmp_path / "none")}
    proc = subprocess.run(["bash", "tests/gpu/run_gpu_checks.sh", str(tmp_path / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (tmp_path / "out" / "checks.txt").read_text().splitlines()
    assert len(lines) == 7 and all(line.startswith("SKIPPED ") and line.endswith(": no CUDA GPU visible") for line in lines)
    assert any("Triton KL kernel" in line for line in lines) and any("vLLM refit" in line for line in lines)
    assert any("memory ledger" in line for line in lines)
    assert proc.stdout.count("SKIPPED") == 7
