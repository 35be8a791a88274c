"""Hub ids in model.path: read from the HF cache offline, fetched under a per-node lock, and the
cluster preflight (`run --dry-run --strict`) failing with one line per problem."""

import shutil

import pytest

from megatron_sdpo.builders import resolve_model_path
from megatron_sdpo.cli import main
from megatron_sdpo.config import load_config
from megatron_sdpo.errors import UserError
from megatron_sdpo.models import hub
from megatron_sdpo.models.tiny import SHIPPED_DIR, ensure_tiny_base

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An HF hub cache holding acme/tiny-qwen3 (the shipped tiny base), with the hub offline."""
    from huggingface_hub import constants

    ensure_tiny_base()
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-qwen3"
    shutil.copytree(SHIPPED_DIR, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_resolves_from_the_cache_offline(offline_cache):
    assert hub.is_hub_id("acme/tiny-qwen3") and not hub.is_hub_id("./acme/tiny") and not hub.is_hub_id("/a/b")
    cfg = load_config("tiny", ["model.path=acme/tiny-qwen3"])
    path = resolve_model_path(cfg)
    assert path == str(offline_cache / "models--acme--tiny-qwen3" / "snapshots" / REVISION)
    # The fetch took the node's lock in the cache (the other ranks of a node wait on it).
    assert (offline_cache / ".megatron_sdpo.acme--tiny-qwen3.lock").exists()


def test_a_hub_id_not_in_the_cache_offline_is_one_line(offline_cache):
    cfg = load_config("tiny", ["model.path=acme/absent"])
    with pytest.raises(UserError) as exc:
        resolve_model_path(cfg)
    msg = str(exc.value)
    assert "\n" not in msg and "not in the HF cache" in msg and str(offline_cache) in msg
    assert "huggingface-cli download acme/absent" in msg


def test_strict_preflight_names_each_problem_on_its_own_line(offline_cache, capsys):
    # The shipped tiny preset: synthetic data, the shipped model, a plan that fits.
    assert main(["run", "tiny", "--dry-run", "--strict"]) == 0
    capsys.readouterr()
    assert main(["run", "tiny", "model.path=acme/tiny-qwen3", "--dry-run", "--strict"]) == 0
    assert f"snapshots/{REVISION}/config.json" in capsys.readouterr().out  # planned from the cached config
    # The paper preset on this machine: no data, the model not cached and the hub offline.
    assert main(["run", "qwen3_4b", "--dry-run", "--strict", "--world-size", "8", "--gpu-memory-gib", "40"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert all(line.startswith("error: ") for line in err), err
    # 20 sources and AIME 2025, the extra file of math's ID eval.
    assert sum("data file not found: data/" in line for line in err) == 21
    assert sum("model.path 'Qwen/Qwen3-4B': not in the HF cache" in line for line in err) == 1
    assert sum(line.startswith("error: memory plan: phase ") and "40.0 GiB less" in line for line in err) >= 1
    # Without --strict missing data warns and passes (a login node often lacks the job's data);
    # a phase over the device's memory fails any dry run.
    assert main(["run", "qwen3_4b", "--dry-run", "--world-size", "8"]) == 0
    assert main(["run", "qwen3_4b", "--dry-run", "--world-size", "8", "--gpu-memory-gib", "40"]) == 2
    assert all(line.startswith("error: memory plan: phase ") for line in capsys.readouterr().err.splitlines())
    assert main(["run", "tiny", "--strict"]) == 2
    assert "--strict is for --dry-run" in capsys.readouterr().err
