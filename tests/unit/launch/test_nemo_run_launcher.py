"""launchers/nemo_run.py: config checks, the Slurm dry-run rendering, a real LocalExecutor job
through torchrun, and the one-line errors when nemo-run or the training stack is absent.

NeMo-Run lives in its own environment (`make launch-env`, which `make test` builds): the tests that
need it run the launcher with that interpreter and hand it this one (`--python`), as users do."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sdpo.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
LAUNCHER = REPO / "launchers" / "nemo_run.py"
LAUNCH_PY = REPO / ".venv-launch" / "bin" / "python"
needs_launch_env = pytest.mark.skipif(
    not LAUNCH_PY.is_file(), reason="the launch environment is missing: make launch-env"
)


@pytest.fixture(scope="module")
def launcher():
    spec = importlib.util.spec_from_file_location("megatron_sdpo_nemo_launcher", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env["NEMORUN_HOME"] = str(tmp_path / "nemorun_home")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["TMPDIR"] = str(tmp_path)
    env["HOME"] = str(tmp_path)
    return env


def _launch(
    tmp_path: Path, *args: str, timeout: float = 120, python: Path | str = sys.executable
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), str(LAUNCHER), *args],
        env=_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _nemo_launch(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """The launcher in the launch environment, this interpreter as the training one."""
    return _launch(tmp_path, *args, "--python", sys.executable, timeout=timeout, python=LAUNCH_PY)


# -- launch decisions (no nemo-run needed) -------------------------------------------------------
def test_processes_per_node_follows_the_backend(launcher):
    from megatron_sdpo.config import load_config
    from megatron_sdpo.errors import ConfigError

    assert launcher.processes_per_node(load_config("qwen3_4b")) == 8
    assert launcher.processes_per_node(load_config("olmo3_7b", ["launch.gpus_per_node=4"])) == 4
    assert launcher.processes_per_node(load_config("qwen3_4b"), requested=2) == 2
    assert launcher.processes_per_node(load_config("tiny")) == 1  # hf backend: one process unless asked
    assert launcher.processes_per_node(load_config("tiny"), requested=2) == 2  # torch DDP
    with pytest.raises(ConfigError, match=">= 1"):
        launcher.processes_per_node(load_config("qwen3_4b"), requested=0)


def test_launch_flags_become_typed_overrides(launcher):
    from megatron_sdpo.config import load_config

    args = argparse.Namespace(
        nodes=3, gpus_per_node=4, partition="batch", account="proj-17", time="24:00:00", container_image=None
    )
    cfg = load_config("tiny", launcher._launch_overrides(args))
    # 24:00:00 must stay a Slurm time, not YAML 1.1's sexagesimal integer 86400.
    assert (cfg.launch.nodes, cfg.launch.gpus_per_node, cfg.launch.time) == (3, 4, "24:00:00")
    assert (cfg.launch.partition, cfg.launch.account, cfg.launch.container_image) == ("batch", "proj-17", "")


def test_relative_data_paths_are_anchored_for_slurm(launcher):
    from megatron_sdpo.config import load_config

    cfg = load_config("olmo3_7b", ["domains.code.eval.ood_far.source=synthetic"])
    overrides = launcher.data_source_overrides(cfg, "/data/root")
    anchored = load_config("olmo3_7b", ["domains.code.eval.ood_far.source=synthetic", *overrides])
    sources = {
        (d, w): s
        for d, dc in anchored.domains.items()
        for w, s in [("train", dc.train.source), *((k, v.source) for k, v in dc.eval.items())]
    }
    assert sources[("math", "train")] == "/data/root/data/dapo-math-17k.parquet"
    assert sources[("code", "ood_far")] == "synthetic"
    assert all(s == "synthetic" or s.startswith("/data/root/data/") for s in sources.values())
    assert launcher.data_source_overrides(load_config("tiny"), "/data/root") == []


def test_both_launch_paths_read_one_cluster_env(launcher):
    """slurm/cluster.env is the one definition: the launcher exports it as it stands, and the sbatch
    body exports each of its variables that the submitting environment left unset."""
    lines = [ln for ln in (REPO / "slurm" / "cluster.env").read_text().splitlines() if ln and not ln.startswith("#")]
    assert launcher.CLUSTER_ENV == dict(ln.split("=", 1) for ln in lines)
    assert {"NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}.items() <= launcher.CLUSTER_ENV.items()
    assert 'done < "$(dirname "$0")/cluster.env"' in (REPO / "slurm" / "_continual_body.sh").read_text()


def test_a_malformed_cluster_env_line_is_a_one_line_error(launcher, tmp_path):
    bad = tmp_path / "cluster.env"
    bad.write_text("# ok\nNCCL_DEBUG=WARN\nNCCL_DEBUG WARN\n")
    with pytest.raises(ConfigError, match=r"cluster.env:3: expected KEY=word"):
        launcher.read_cluster_env(bad)


# A Slurm launch over SSH, with its job directory on the login node.
REMOTE = ["qwen3_4b", "--executor", "slurm", "--account", "a", "--ssh-host", "login1", "--job-dir", "/j"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["no_such_preset"], "unknown preset 'no_such_preset'"),
        (["tiny", "backend.bogus=1"], "backend.bogus"),
        (["qwen3_4b", "--executor", "local", "--nodes", "2"], "runs on this machine only"),
        (["qwen3_4b", "--executor", "slurm", "--dryrun"], "needs an account"),
        (["tiny", "--executor", "local", "--resume"], "--resume needs --out"),
        # The tests run outside the checkout, where NeMo-Run's git packaging cannot find it.
        (
            ["qwen3_4b", "--executor", "slurm", "--account", "a", "--packager", "git", "--dryrun"],
            "launch from inside it",
        ),
        (["qwen3_4b", "--executor", "slurm", "--account", "a", "--ssh-host", "login1"], "needs --job-dir"),
        ([*REMOTE, "--packager", "none"], "--ssh-host needs --out"),
        ([*REMOTE, "--packager", "none", "--out", "/r"], "pass --data-root"),
        (["qwen3_4b", "--executor", "slurm", "--account", "a", "--packager", "none"], "data file not found"),
    ],
)
def test_user_errors_are_one_line_before_anything_runs(tmp_path, args, message):
    proc = _launch(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "nemorun_home").exists()


def test_existing_run_dir_needs_resume(tmp_path):
    run_dir = tmp_path / "runs" / "old"
    run_dir.mkdir(parents=True)
    (run_dir / "resolved_config.yaml").write_text("name: tiny\n")
    proc = _launch(tmp_path, "tiny", "--executor", "local", "--out", str(run_dir))
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    proc = _launch(tmp_path, "tiny", "--executor", "local", "--out", str(tmp_path / "fresh"), "--resume")
    assert proc.returncode == 2 and "holds no run to resume" in proc.stderr


def test_missing_nemo_run_names_the_launch_environment(tmp_path):
    # `None` in sys.modules makes `import nemo_run` raise ImportError, as if it were not installed.
    code = (
        "import runpy, sys; sys.modules['nemo_run'] = None; "
        f"sys.argv = [{str(LAUNCHER)!r}, 'tiny', '--executor', 'local', '--dryrun']; "
        f"runpy.run_path({str(LAUNCHER)!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: nemo_run is needed"), proc.stderr
    assert "make launch-env" in proc.stderr and ".venv-launch/bin/python launchers/nemo_run.py" in proc.stderr


@needs_launch_env
def test_the_launch_environment_holds_no_training_stack_and_names_the_interpreter_it_needs(tmp_path):
    proc = subprocess.run(
        [str(LAUNCH_PY), "-c", "import nemo_run, importlib.util as u; print(u.find_spec('torch'))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr[-2000:]
    for python, message in [
        (None, "has no torch: the preflight and a local job need the training environment"),
        (str(tmp_path / "missing" / "python"), "not an executable file"),
    ]:
        extra = ["--python", python] if python else []
        proc = _launch(tmp_path, "tiny", "--executor", "local", "--dryrun", *extra, python=LAUNCH_PY)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert message in proc.stderr


# -- NeMo-Run itself ---------------------------------------------------------------------------
@needs_launch_env
def test_slurm_dryrun_renders_the_sbatch_script(tmp_path, launcher):
    out = "/lustre/runs/olmo-continual"
    proc = _nemo_launch(
        tmp_path,
        "olmo3_7b",
        "algorithm.sdpo.alpha=0.25",
        "--executor",
        "slurm",
        "--dryrun",
        "--account",
        "proj-17",
        "--partition",
        "batch",
        "--time",
        "12:00:00",
        "--job-dir",
        str(tmp_path / "jobs"),
        "--packager",
        "none",
        "--out",
        out,
        "--data-root",
        "/lustre/sdpo",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --job-dir without --ssh-host: NeMo-Run's home for the launch (its LocalTunnel submits from there).
    rendered = sorted((tmp_path / "jobs").rglob("*_sbatch.sh"))
    assert len(rendered) == 1 and not list((tmp_path / "nemorun_home").rglob("*_sbatch.sh")), rendered
    assert f"rendered sbatch script: {rendered[0]}" in proc.stdout
    text = rendered[0].read_text()
    NODES_SETUP = launcher.NODES_SETUP
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --partition=batch",
        "#SBATCH --time=12:00:00",
        "#SBATCH --account=proj-17",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --exclusive",
        "#SBATCH --ntasks-per-node=1",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "export NCCL_NVLS_ENABLE=0",
        # The stop: TERM to the steps a lead before the limit, torchrun waiting that long.
        "#SBATCH --signal=TERM@720",
        "export SDPO_STOP_LEAD_S=720",
        "export PET_SHUTDOWN_TIMEOUT=720",
        NODES_SETUP,
    ):
        assert re.search(rf"^{re.escape(line)}$", text, flags=re.M), line
    (srun,) = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    # One torchrun per node with 8 ranks, running the CLI with the anchored data paths.
    assert re.search(
        r"torchrun .*--nnodes 2 --nproc-per-node 8 .*-m megatron_sdpo run olmo3_7b "
        r"algorithm\.sdpo\.alpha=0\.25 ",
        srun,
    ), srun
    assert "domains.math.train.source=/lustre/sdpo/data/dapo-math-17k.parquet" in srun
    assert srun.endswith(f"--out {out} --quiet"), srun
    # The CLI's dry run for the job's 2 x 8 ranks came first (the data paths are on the cluster).
    assert "[nemo_run] preflight: python -m megatron_sdpo run olmo3_7b algorithm.sdpo.alpha=0.25" in proc.stderr
    assert "ranks: 16 (--world-size)" in proc.stdout and "trainer layout: TP=4 PP=1 DP=4" in proc.stdout


@needs_launch_env
def test_a_failed_preflight_queues_nothing(tmp_path):
    proc = _nemo_launch(
        tmp_path,
        "olmo3_7b",
        "backend.megatron.tensor_parallel=3",
        "--executor",
        "slurm",
        "--dryrun",
        "--account",
        "proj-17",
        "--job-dir",
        str(tmp_path / "jobs"),
        "--packager",
        "none",
        "--out",
        "/lustre/runs/x",
        "--data-root",
        "/lustre/sdpo",
        timeout=180,
    )
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "error: world size 16 (--world-size) is not divisible by backend.megatron.tensor_parallel" in proc.stderr
    assert not list(tmp_path.rglob("*_sbatch.sh"))


@needs_launch_env
def test_local_executor_runs_ranks_through_torchrun_and_reports_failure(tmp_path):
    from megatron_sdpo.config import list_presets

    # Experiment() stores the main module's source, so the driver is a file, not `python -c`.
    # One driver runs both jobs: importing nemo_run dominates the cost of each.
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('launcher', {str(LAUNCHER)!r})\n"
        "launcher = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(launcher)\n"
        "if __name__ == '__main__':\n"
        f"    python = {sys.executable!r}\n"
        "    ok = launcher.submit(launcher.megatron_sdpo_task(['presets']), launcher.local_executor(2, "
        "python=python),\n"
        "                         name='presets-check')\n"
        "    bad = launcher.submit(launcher.megatron_sdpo_task(['run', 'no_such_preset']),\n"
        "                          launcher.local_executor(1, python=python), name='failing')\n"
        "    print(f'RESULT ok={ok} bad={bad}')\n"
    )
    proc = subprocess.run(
        [str(LAUNCH_PY), str(driver)], env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "RESULT ok=0 bad=1" in proc.stdout, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "error: job failing did not succeed" in proc.stderr and "FAILED" in proc.stderr, proc.stderr
    assert "presets-check did not succeed" not in proc.stderr
    home = tmp_path / "nemorun_home" / "experiments"
    logs = [p for p in (home / "presets-check").rglob("stdout.log") if "torchelastic" not in p.parts]
    text = "".join(p.read_text() for p in logs)
    for name in list_presets():  # torchrun prefixes each line with its rank
        assert f"[default0]:{name}\n" in text and f"[default1]:{name}\n" in text, (name, text)
    failing = "".join(p.read_text() for p in (home / "failing").rglob("*.log"))
    assert "unknown preset 'no_such_preset'" in failing
