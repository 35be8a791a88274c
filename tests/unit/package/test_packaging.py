"""The package builds without setuptools warnings and its wheel ships the data folders."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DATA_DIRS = ("megatron_sdpo/config/presets", "megatron_sdpo/assets/tiny_base", "megatron_sdpo/assets")


def test_wheel_has_the_data_folders_and_the_build_no_package_warnings(tmp_path):
    src = tmp_path / "src"  # a copy: building in place would leave build/ and egg-info behind
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("megatron_sdpo", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "whl"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "would be ignored" not in log and "is absent from the `packages`" not in log, log[-3000:]
    (wheel,) = (tmp_path / "whl").glob("megatron_sdpo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for d in DATA_DIRS:
        files = [p.relative_to(ROOT).as_posix() for p in (ROOT / d).iterdir() if p.is_file()]
        assert files and set(files) <= names, sorted(set(files) - names)
    assert "megatron_sdpo_kernels/__init__.py" in names and not any(n.startswith("kernels/") for n in names)


def test_the_launch_extra_is_the_launch_environment():
    """setup.py's `launch` extra and launchers/requirements.txt (`make launch-env`) list the same
    packages: one environment for NeMo-Run, however it is installed."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    (extra,) = [
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "LAUNCH" for t in node.targets)
    ]
    lines = (ROOT / "launchers" / "requirements.txt").read_text().splitlines()
    assert extra == [line for line in lines if line and not line.startswith("#")]
