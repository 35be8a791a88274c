"""slurm/continual_*.sh (thin sbatch wrappers) and slurm/_continual_body.sh (their shared body):
syntax, no training logic, and their launch lines under fake `srun` / `scontrol` / `scancel`, run
the way sbatch runs them: a copy of the wrapper in a spool directory, the submit directory holding
the repository. What a fake can show and a CPU cluster cannot: the GPU-sized launch (8 ranks a
node, 96 CPUs, 16 ranks in the preflight), the overrides and --resume on requeue, the refusals.
What only a real Slurm shows (how srun, scancel and preemption deliver a stop, the save, the
requeue) is tested on one in tests/cluster/."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = {"qwen3_4b": REPO / "slurm" / "continual_4b.sh", "olmo3_7b": REPO / "slurm" / "continual_7b.sh"}
BODY = REPO / "slurm" / "_continual_body.sh"
ALL_SH = sorted([*REPO.joinpath("slurm").glob("*.sh"), *REPO.joinpath("launchers").glob("*.sh")])
JOB_ID = 4242

FAKE_SRUN = """#!/bin/bash
# Records its argv (one per line, then a separator) and, if asked, runs until signalled. The
# preflight (--dry-run) returns at once with FAKE_PREFLIGHT_RC, or with FAKE_PREFLIGHT_REAL runs
# its command (the real dry run).
{ printf '%s\\n' "$@"; echo '--END--'; } >> "$FAKE_LOG"
for a in "$@"; do
  if [[ "$a" == --dry-run ]]; then
    if [[ -n "${FAKE_PREFLIGHT_REAL:-}" ]]; then
      while [[ "$1" != python ]]; do shift; done
      exec "$@"
    fi
    exit "${FAKE_PREFLIGHT_RC:-0}"
  fi
done
SLEEP_PID=""
echo $$ > "$FAKE_LOG.srun_pid"
trap 'echo "srun got TERM" >> "$FAKE_LOG"; [[ -n "$SLEEP_PID" ]] && kill "$SLEEP_PID"; exit 143' TERM
if [[ -n "${FAKE_SRUN_SLEEP:-}" ]]; then
  sleep "$FAKE_SRUN_SLEEP" & SLEEP_PID=$!
  wait "$SLEEP_PID"
fi
exit "${FAKE_SRUN_RC:-0}"
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1" in
  show) printf 'gpu-node-017\\ngpu-node-018\\n' ;;
  requeue) echo "scontrol requeue $2" >> "$FAKE_LOG" ;;
  *) echo "unexpected scontrol $*" >&2; exit 1 ;;
esac
"""
# Slurm signals the processes of the job's steps: here the fake srun, whose pid it wrote.
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE_LOG"
[[ "$1" == --signal=TERM ]] && kill -TERM "$(cat "$FAKE_LOG.srun_pid")"
exit 0
"""


def test_every_shell_script_parses():
    assert len(ALL_SH) >= 3, ALL_SH
    for path in ALL_SH:
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"{path.name}: {proc.stderr}"


def _code(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


@pytest.mark.parametrize("preset", sorted(SCRIPTS))
def test_wrapper_is_an_sbatch_header_that_execs_the_body_with_its_preset(preset):
    text = SCRIPTS[preset].read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, flags=re.M))
    for key in ("nodes", "gpus-per-node", "time", "exclusive", "output", "requeue", "signal"):
        assert key in directives, f"{preset}: no #SBATCH --{key}"
    assert directives["output"].startswith("logs/")
    assert int(directives["nodes"]) == (2 if preset == "olmo3_7b" else 1)
    # Thin: no Python, and its last command hands the whole job (same process) to the body.
    code = _code(text)
    assert not any(re.search(r"(?<![-\w])python3?\b", ln) for ln in code), code
    assert re.fullmatch(rf'exec bash "\$\{{BODY\}}" {preset} "\$@"', code[-1]), code[-1]
    assert 'BODY="${SLURM_SUBMIT_DIR' in text and "slurm/_continual_body.sh" in text


def test_body_holds_no_header_and_no_training_logic():
    text = BODY.read_text()
    assert not re.search(r"^#SBATCH", text, flags=re.M) and not any(p in text for p in SCRIPTS)
    # No training logic: the only Python this script starts is the megatron_sdpo CLI, first its
    # dry run (preflight), then the run.
    code = _code(text)
    python_lines = [ln for ln in code if re.search(r"(?<![-\w])python3?\b", ln)]
    assert len(python_lines) == 2 and all('-m megatron_sdpo run "${PRESET}" "$@"' in ln for ln in python_lines), (
        python_lines
    )
    assert "--dry-run" in python_lines[0] and "--dry-run" not in python_lines[1]
    assert not any(re.search(r"<<|python3? -c|\bimport\b", ln) for ln in code)


@pytest.fixture()
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "fake.log"
    # Submitted from the repository root: the submit directory holds slurm/ (runs/ go there too).
    (tmp_path / "slurm").symlink_to(REPO / "slurm", target_is_directory=True)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "FAKE_LOG": str(log),
        "SLURM_JOB_ID": str(JOB_ID),
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "gpu-node-[017-018]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_CPUS_ON_NODE": "96",
        "SLURM_GPUS_ON_NODE": "8",
    }
    return tmp_path, env, log


def _srun_calls(log: Path, preflight: bool = False) -> list[list[str]]:
    """The fake srun's argv lists: the training launches, or (preflight=True) the dry runs."""
    return [c for c in _all_srun_calls(log) if ("--dry-run" in c) == preflight]


def _all_srun_calls(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    calls, cur = [], []
    for line in log.read_text().splitlines():
        if line == "--END--":
            calls.append(cur)
            cur = []
        elif not line.startswith(("srun got", "scontrol", "scancel")):
            cur.append(line)
    return calls


def _spooled(script: Path, env: dict) -> Path:
    """A copy of `script` outside the repository, as sbatch leaves it for the job (slurm_script
    in slurmd's spool directory): the wrapper must not rely on its own location."""
    spool = Path(env["TMPDIR"]) / "spool" / f"job{JOB_ID}-{script.stem}"
    spool.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(script, spool / "slurm_script")
    return spool / "slurm_script"


def _run(script: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(_spooled(script, env)), *args],
        env=env,
        cwd=env["SLURM_SUBMIT_DIR"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_first_launch_then_requeued_launch_resumes(fake_slurm):
    tmp, env, log = fake_slurm
    overrides = ["algorithm.sdpo.alpha=0.25", "logging.wandb_mode=offline"]
    proc = _run(SCRIPTS["olmo3_7b"], env, *overrides)
    assert proc.returncode == 0, proc.stderr
    (argv,) = _srun_calls(log)
    run_dir = tmp / "runs" / f"olmo3_7b-{JOB_ID}"
    port = 20000 + JOB_ID % 20000
    torchrun = argv[argv.index("torchrun") : argv.index("python")]
    assert argv[: argv.index("torchrun")][:2] == ["--nodes=2", "--ntasks-per-node=1"]
    assert "--cpus-per-task=96" in argv
    assert {
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        f"--rdzv-id={JOB_ID}",
        f"--rdzv-endpoint=gpu-node-017:{port}",
        "--no-python",
    } <= set(torchrun)
    # The run and its preflight: the same command line with the same overrides.
    command = ["python", "-m", "megatron_sdpo", "run", "olmo3_7b", *overrides]
    assert argv[argv.index("python") :] == [*command, "--out", str(run_dir), "--quiet"]
    # The preflight ran first: one task, the same overrides, the allocation's world size.
    (pre,) = _srun_calls(log, preflight=True)
    assert _all_srun_calls(log)[0] == pre
    assert pre[:2] == ["--nodes=1", "--ntasks=1"]
    assert pre[pre.index("python") :] == [
        *command,
        "--dry-run",
        "--strict",
        "--world-size",
        "16",
        "--job-script",
        str(tmp / "logs" / f"job-{JOB_ID}.sh"),
        "--launch-env",
        str(tmp / "logs" / f"launch-{JOB_ID}.env"),
    ]
    # A copy of the spooled script the preflight reads, in the submit directory a container mounts.
    assert (tmp / "logs" / f"job-{JOB_ID}.sh").read_text() == SCRIPTS["olmo3_7b"].read_text()
    # The requeued job (same id) finds the run the first attempt started and resumes it.
    run_dir.mkdir(parents=True)
    (run_dir / "resolved_config.yaml").write_text("name: olmo3_7b\n")
    assert _run(SCRIPTS["olmo3_7b"], env).returncode == 0
    second = _srun_calls(log)[1]
    assert second[second.index("python") :][-3:] == [str(run_dir), "--resume", "--quiet"]


def test_finished_run_is_not_restarted_and_run_dir_env_wins(fake_slurm):
    tmp, env, log = fake_slurm
    run_dir = tmp / "elsewhere" / "q4b"
    run_dir.mkdir(parents=True)
    (run_dir / "report.md").write_text("# done\n")
    proc = _run(SCRIPTS["qwen3_4b"], {**env, "RUN_DIR": str(run_dir)})
    assert proc.returncode == 0 and "already finished" in proc.stdout
    assert _all_srun_calls(log) == []


@pytest.mark.parametrize("bad", ["--out=/x", "--resume"])
def test_out_and_resume_arguments_are_refused(fake_slurm, bad):
    _, env, log = fake_slurm
    proc = _run(SCRIPTS["qwen3_4b"], env, "seed=1", bad)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "RUN_DIR" in proc.stderr
    assert _all_srun_calls(log) == []


def _start_and_wait_for_srun(script: Path, env: dict, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["bash", str(_spooled(script, env))],
        env={**env, "FAKE_SRUN_SLEEP": "60"},
        cwd=env["SLURM_SUBMIT_DIR"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not _srun_calls(log):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "srun was never started"
        time.sleep(0.05)
    time.sleep(0.2)  # let the fake srun install its TERM trap
    return proc


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("bash") is None, reason="needs bash signals")
def test_time_limit_signal_reaches_the_steps_through_slurm_then_requeues(fake_slurm):
    _, env, log = fake_slurm
    proc = _start_and_wait_for_srun(SCRIPTS["qwen3_4b"], env, log)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    text = log.read_text()
    # Not `kill srun` (a real srun kills its tasks at once): the steps' TERM comes from Slurm.
    assert f"scancel --signal=TERM {JOB_ID}" in text and f"scontrol requeue {JOB_ID}" in text, (text, out, err)
    assert text.index("srun got TERM") < text.index("scontrol requeue"), text
    assert proc.returncode == 143, (out, err)


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("bash") is None, reason="needs bash signals")
def test_a_term_to_the_shell_is_not_passed_on(fake_slurm):
    # Slurm sends the same TERM to every step: the shell passing it on would signal the ranks twice.
    _, env, log = fake_slurm
    proc = _start_and_wait_for_srun(SCRIPTS["qwen3_4b"], env, log)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None and "srun got TERM" not in log.read_text() and "scancel" not in log.read_text()
    os.kill(int(Path(f"{log}.srun_pid").read_text()), signal.SIGTERM)  # Slurm's TERM to the step
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and "requeue" not in log.read_text(), (out, err)


def test_srun_failure_is_the_job_status(fake_slurm):
    _, env, _ = fake_slurm
    proc = _run(SCRIPTS["qwen3_4b"], {**env, "FAKE_SRUN_RC": "3"})
    assert proc.returncode == 3 and "status 3" in proc.stdout


def test_a_failed_preflight_launches_nothing(fake_slurm):
    _, env, log = fake_slurm
    proc = _run(SCRIPTS["olmo3_7b"], {**env, "FAKE_PREFLIGHT_RC": "2"}, "backend.megatron.tensor_parallel=3")
    assert proc.returncode == 2 and "preflight (--dry-run) failed with status 2" in proc.stdout, proc.stdout
    assert len(_srun_calls(log, preflight=True)) == 1 and _srun_calls(log) == []


def test_outside_slurm_the_script_refuses_to_start(fake_slurm):
    _, env, log = fake_slurm
    env = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    proc = _run(SCRIPTS["olmo3_7b"], env)
    assert proc.returncode != 0 and "submit this script with sbatch" in proc.stderr
    assert _all_srun_calls(log) == []


@pytest.mark.parametrize("preset", sorted(SCRIPTS))
def test_each_wrapper_launches_its_own_preset(fake_slurm, preset):
    _, env, log = fake_slurm
    assert _run(SCRIPTS[preset], env, "seed=3").returncode == 0
    (pre,) = _srun_calls(log, preflight=True)
    (argv,) = _srun_calls(log)
    assert pre[pre.index("python") :][:6] == ["python", "-m", "megatron_sdpo", "run", preset, "seed=3"]
    assert argv[argv.index("python") :][:6] == ["python", "-m", "megatron_sdpo", "run", preset, "seed=3"]
    assert f"{preset}-{JOB_ID}" in argv[argv.index("--out") + 1]


def test_submitted_from_outside_the_repository_is_a_one_line_error(fake_slurm):
    tmp, env, log = fake_slurm
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    proc = _run(SCRIPTS["qwen3_4b"], {**env, "SLURM_SUBMIT_DIR": str(elsewhere)})
    assert proc.returncode == 2 and "submit from the repository root" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert _all_srun_calls(log) == []


def _with_lead(script: Path, lead: int, tmp: Path) -> Path:
    variant = tmp / f"{script.stem}-{lead}.sh"
    variant.write_text(
        re.sub(r"^#SBATCH --signal=\S+$", f"#SBATCH --signal=B:USR1@{lead}", script.read_text(), flags=re.M)
    )
    return variant


def test_the_preflight_prints_the_grace_and_interfaces_and_fails_a_short_lead(fake_slurm):
    tmp, env, log = fake_slurm
    shim = tmp / "bin" / "python"  # this interpreter (its environment), as `python` on PATH
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    env = {**env, "FAKE_PREFLIGHT_REAL": "1", "PYTHONPATH": str(REPO)}
    proc = _run(SCRIPTS["olmo3_7b"], env)
    # The job's model and data are not on this machine: the preflight fails on them, not on the lead.
    assert (
        "stop grace: " in proc.stdout
        and f"stop signal: 720 s before the kill (job-{JOB_ID}.sh: #SBATCH --signal USR1@720)" in proc.stdout
    ), proc.stdout[-3000:]
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("network: NCCL_SOCKET_IFNAME")], proc.stdout[-2000:]
    assert "network: NCCL_NVLS_ENABLE=0" in proc.stdout
    assert "stop signal lead" not in proc.stderr and _srun_calls(log) == []
    short = _run(_with_lead(SCRIPTS["olmo3_7b"], 300, tmp), env)
    lines = [ln for ln in short.stderr.splitlines() if "stop signal lead" in ln]
    assert len(lines) == 1 and lines[0].startswith("error: stop signal lead 300 s"), short.stderr[-3000:]
    assert re.search(r"--signal=B:USR1@\d+", lines[0]) and short.returncode == 2 and _srun_calls(log) == []


def test_the_launch_env_reaches_torchrun_and_the_ranks(fake_slurm):
    tmp, env, log = fake_slurm
    # The preflight (faked here) writes the launch environment; the body sources it.
    (tmp / "logs").mkdir()
    fake_pre = tmp / "bin" / "srun"
    text = fake_pre.read_text().replace(
        'exit "${FAKE_PREFLIGHT_RC:-0}"',
        'printf "export SDPO_STOP_LEAD_S=720\\nexport SDPO_STOP_RESERVE_S=170\\n" > "${@: -1}"; exit 0',
    )
    fake_pre.write_text(text)
    assert _run(SCRIPTS["olmo3_7b"], env).returncode == 0
    (argv,) = _srun_calls(log)
    assert "--shutdown-timeout=720" in argv
