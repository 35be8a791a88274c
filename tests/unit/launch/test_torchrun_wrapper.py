"""launchers/torchrun.sh: real torchrun ranks running `python -m megatron_sdpo`, and one-line errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
WRAPPER = REPO / "launchers" / "torchrun.sh"


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "NNODES")}
    # torchrun and the ranks' `python` come from the interpreter running the tests.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["TMPDIR"] = str(tmp_path)
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_run_the_cli_through_a_c10d_rendezvous(tmp_path):
    from megatron_sdpo.config import list_presets

    env = _env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RDZV_ID="launch-test")
    proc = subprocess.run(
        ["bash", str(WRAPPER), "--nproc-per-node", "2", "presets"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nnodes=1 nproc-per-node=2 (set)" in proc.stderr
    assert "--rdzv-endpoint=127.0.0.1:" in proc.stderr
    # Every rank printed the full list. Ranks share the pipe, so the newline ending one rank's
    # block may land after the other's block: count whole blocks, not lines.
    block = "\n".join(list_presets())
    assert proc.stdout.count(block) == 2, (repr(proc.stdout), proc.stderr[-2000:])


def test_cli_errors_propagate_with_their_exit_status(tmp_path):
    proc = subprocess.run(
        ["bash", str(WRAPPER), "--nproc-per-node=1", "run", "no_such_preset"],
        env=_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "unknown preset 'no_such_preset'" in proc.stderr


def test_bad_options_are_one_line_errors(tmp_path):
    cases = [
        (["--nproc-per-node", "two", "presets"], {}, "--nproc-per-node must be a positive integer"),
        (["--nnodes=0", "presets"], {}, "--nnodes must be a positive integer"),
        (["--nnodes", "2", "presets"], {}, "needs MASTER_ADDR"),
        (["--nproc-per-node"], {}, "needs a value"),
        (["--bogus", "presets"], {}, "unknown option --bogus"),
        ([], {}, "no megatron_sdpo subcommand"),
        (["presets"], {"PYTHON": "no-such-python-here"}, "no-such-python-here is not on PATH"),
    ]
    for args, extra, message in cases:
        proc = subprocess.run(
            ["bash", str(WRAPPER), *args],
            env=_env(tmp_path, **extra),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
