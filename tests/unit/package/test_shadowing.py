"""Nothing in the repository root shadows a published package.

`python -m megatron_sdpo ...`, `python tools/...` and the sbatch body run from the checkout, so the
repository root is first on sys.path. transformers imports Hugging Face's `kernels` package
whenever that distribution is installed (>= 5.25 requires it): a root-level `kernels` package of
ours would be imported in its place and every model import would fail.
"""

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# A stand-in for the `kernels` distribution: its metadata (so transformers takes it as installed)
# and a module answering every name transformers imports from it with an inert object.
STAND_IN = """
class _Inert:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __getattr__(self, name):
        return _Inert()


def _unchanged(obj):
    return obj


def use_kernel_forward_from_hub(*args, **kwargs):  # decorator factories: the class or function as it is
    return _unchanged


def use_kernelized_func(*args, **kwargs):
    return _unchanged


def __getattr__(name):
    return _Inert()
"""
PROBE = textwrap.dedent("""
    import sys
    import transformers.activations
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.utils import import_utils
    import kernels
    assert import_utils.is_kernels_available(), "transformers did not take the stand-in as installed"
    print(kernels.__file__)
""")


def _kernels_version() -> str:
    """A version transformers accepts for `kernels` (its own bounds where it states them)."""
    from transformers.utils import import_utils

    return getattr(import_utils, "KERNELS_MIN_VERSION", "0.19.1")


@pytest.fixture
def kernels_installed(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text(STAND_IN)
    info = site / f"kernels-{_kernels_version()}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {_kernels_version()}\n")
    (info / "top_level.txt").write_text("kernels\n")
    return site


def _probe(root: Path, site: Path) -> subprocess.CompletedProcess:
    # `python -c` from `root` puts `root` first on sys.path, as `python -m megatron_sdpo` does.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", PROBE], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_transformers_model_code_imports_from_the_repository_root(kernels_installed):
    proc = _probe(REPO, kernels_installed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(kernels_installed / "kernels" / "__init__.py")


def test_a_root_level_kernels_package_would_break_it(kernels_installed, tmp_path):
    # The check can fail: the layout before the kernels moved one level down.
    old_root = tmp_path / "old_checkout"
    (old_root / "kernels").mkdir(parents=True)
    (old_root / "kernels" / "__init__.py").write_text('"""fused KL kernels"""\n')
    proc = _probe(old_root, kernels_installed)
    assert proc.returncode != 0 and "ImportError" in proc.stderr, proc.stderr[-3000:]


def test_no_root_level_name_shadows_an_installed_distribution():
    provided = importlib.metadata.packages_distributions()
    ours = {"megatron_sdpo", "megatron_sdpo_kernels"}
    importable = {p.stem for p in REPO.glob("*.py")} | {d.name for d in REPO.iterdir() if (d / "__init__.py").is_file()}
    assert importable - ours == {"setup"}, importable  # setup.py; the folders are plain folders
    clashes = {name: provided[name] for name in importable - ours if name in provided}
    assert not clashes, f"these repository-root names shadow installed distributions: {clashes}"
