"""Sandbox for model-generated programs: one isolated process tree per program (or per batch).

Isolation ("namespaces" mode, used when the trainer runs as root and the kernel allows it):
- fresh network namespace (no interfaces but a down loopback: every connect fails),
  plus an audit hook in the program that refuses socket creation as a second layer;
- fresh pid namespace: a program sees only its own processes, and every process it started is
  killed after each test case and when the sandbox exits (background children included);
- read-only view of the whole file system except an empty per-run working directory, and private
  size-capped tmpfs on /tmp, /var/tmp, /dev/shm (removed with the sandbox);
- the program runs as a fresh unprivileged uid (never the trainer's), so RLIMIT_NPROC is enforced
  by the kernel even though the trainer is root and a fork bomb stays contained;
- rlimits: CPU, address space, processes, file size, open files, no core dumps;
- a time limit per test case judged on the case's CPU time (user + system, from wait4), so
  that the verdict does not depend on what else the machine runs; RLIMIT_CPU kills a case that
  keeps computing, and a wall-clock backstop per case (`wall_factor` times the limit: it kills
  the namespace) and per run (kills the process group) stops one that sleeps or blocks;
- scrubbed environment and ``python -I``: no variable of the trainer is visible.

Without namespaces ("rlimits" mode, e.g. an unprivileged trainer) only the rlimits, process-group
kill, scrubbed environment and audit hook apply; programs that mention networking or process
spawning APIs are refused up front with a clear message, since nothing else would stop them.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field

from megatron_sdpo.errors import ConfigError

__all__ = ["SandboxLimits", "CaseOutcome", "Program", "Sandbox", "SandboxError", "isolation_mode"]

log = logging.getLogger(__name__)

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")
# Fresh uids for sandboxed programs: far above any distribution's range, below the 2**31 limit of
# 16-bit-safe tools. Per-process counter plus pid keeps concurrent sandboxes (threads, ranks)
# on distinct uids so one program's fork bomb cannot eat another's process quota.
_UID_BASE = 1_600_000_000
_UID_SPAN = 1 << 22
_uid_counter = itertools.count()
_uid_lock = threading.Lock()

_NETWORK_PATTERN = re.compile(
    r"\b(socket|urllib|http\.client|httpx|requests|aiohttp|ftplib|smtplib|telnetlib|ctypes|"
    r"subprocess|os\.system|os\.popen|os\.exec\w*|os\.spawn\w*|pty)\b"
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): a setup or protocol error."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits. Times in seconds, sizes in MiB unless named otherwise."""

    # The time limit per test case, on the case's CPU time: a case over it is judged timed out
    # however loaded the machine is (a 2 s wall-clock limit turned correct answers into
    # time-outs beside other work). RLIMIT_CPU (`cpu_s`, whole seconds) kills one that goes on.
    timeout_s: float = 2.0
    cpu_s: int = 2  # RLIMIT_CPU per test case
    # The wall-clock backstop per case is wall_factor * max(timeout_s, cpu_s): generous, for a
    # program that sleeps or blocks (no CPU time); it is not what judges a computing program.
    wall_factor: float = 10.0
    memory_mb: int = 512  # RLIMIT_AS
    nproc: int = 16  # processes + threads of the sandbox uid
    fsize_mb: int = 8  # RLIMIT_FSIZE: caps every file, stdout and stderr included
    nofile: int = 64
    output_chars: int = 65536  # characters kept per stream
    tmpfs_mb: int = 16
    max_timeouts: int = 1  # after this many timed-out cases the remaining ones are skipped
    startup_s: float = 5.0  # allowance for interpreter start-up in the per-run deadline

    def __post_init__(self) -> None:
        for name in (
            "timeout_s",
            "cpu_s",
            "wall_factor",
            "memory_mb",
            "nproc",
            "fsize_mb",
            "nofile",
            "output_chars",
            "tmpfs_mb",
            "max_timeouts",
            "startup_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"sandbox.{name} must be > 0, got {getattr(self, name)!r}")
        if self.wall_factor < 1:
            raise ConfigError(
                f"sandbox.wall_factor must be >= 1 (a backstop above the CPU limit), got {self.wall_factor!r}"
            )

    @property
    def wall_s(self) -> float:
        """The wall-clock backstop per case."""
        return self.wall_factor * max(self.timeout_s, float(self.cpu_s))


@dataclass
class CaseOutcome:
    """What happened to one test case. `status` is one of ok, error, timeout, output_limit,
    signal, skipped (not run after earlier timeouts), refused (not run at all)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    result: str | None = None  # JSON of the function's return value (functional cases)
    returncode: int | None = None
    signal: int | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0  # user + system CPU time of the case's process


@dataclass
class Program:
    """A program and the inputs of its test cases.

    With `fn_name` None each input is the program's stdin; otherwise the program is imported and
    `fn_name` (a method of `class Solution` or a top-level function) is called with the JSON
    values on the input's lines as positional arguments. With `scripts` each input is instead a
    test script (Python source, run verbatim): the program is imported (stdin empty), then the
    script runs in the program's globals; the case is `ok` only when the script ran to its end."""

    source: str
    inputs: list[str] = field(default_factory=list)
    fn_name: str | None = None
    scripts: bool = False

    def __post_init__(self) -> None:
        if self.scripts and self.fn_name is not None:
            raise ValueError("a program's cases are test scripts or function calls, not both")


_mode_cache: dict[str, str] = {}
_mode_lock = threading.Lock()


def isolation_mode() -> str:
    """'namespaces' when a probe program runs fully isolated here, else 'rlimits'. Cached."""
    with _mode_lock:
        if "mode" not in _mode_cache:
            mode, reason = "rlimits", "the trainer is not root"
            if os.geteuid() == 0 and sys.platform.startswith("linux"):
                try:
                    probe = Sandbox(SandboxLimits(timeout_s=5.0), isolation="namespaces")
                    out = probe.run(Program("print('ok')", [""]))
                    if out[0].status == "ok" and out[0].stdout.strip() == "ok":
                        mode = "namespaces"
                    else:
                        reason = f"probe program failed: {out[0]}"
                except SandboxError as exc:
                    reason = str(exc)
            if mode != "namespaces":
                log.warning(
                    "code sandbox: namespaces unavailable (%s); running with rlimits only "
                    "and refusing programs that use network or process APIs",
                    reason,
                )
            _mode_cache["mode"] = mode
        return _mode_cache["mode"]


def _next_uid() -> int:
    with _uid_lock:
        n = next(_uid_counter)
    return _UID_BASE + (os.getpid() * 7919 + n) % _UID_SPAN


def _user_process_count(uid: int) -> int:
    """Processes and threads owned by `uid` now (RLIMIT_NPROC counts threads too)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields.get("Threads", "1"))
        except (OSError, KeyError, ValueError):
            continue
    return count


class Sandbox:
    """Runs untrusted Python programs on test inputs.

    `run(program)` uses one fresh sandbox process tree per program. `run_batch(programs,
    batched=True)` runs a whole batch in one sandbox, forking a fresh child per test case from a
    pre-warmed parent; programs stay isolated from each other (sequential, every process killed,
    working and scratch directories wiped between programs), but they share one uid and one
    per-run deadline, so one slow program delays the rest of its batch.
    """

    def __init__(
        self, limits: SandboxLimits = SandboxLimits(), isolation: str = "auto", python: str | None = None
    ) -> None:
        if isolation not in ("auto", "namespaces", "rlimits"):
            raise ConfigError(f"sandbox isolation must be auto, namespaces or rlimits, got {isolation!r}")
        self.limits = limits
        self._isolation = isolation
        self.python = python or sys.executable

    @property
    def mode(self) -> str:
        return isolation_mode() if self._isolation == "auto" else self._isolation

    def run(self, program: Program) -> list[CaseOutcome]:
        """Run one program on all its inputs; returns one outcome per input, in order."""
        return self._run([program])[0]

    def run_batch(self, programs: list[Program], batched: bool = False) -> list[list[CaseOutcome]]:
        """Run many programs: one sandbox each, or all in one sandbox with `batched`."""
        if batched:
            return self._run(programs)
        return [self._run([p])[0] for p in programs]

    def _refusal(self, program: Program) -> str | None:
        if self.mode == "namespaces":
            return None
        hit = _NETWORK_PATTERN.search(program.source)
        if hit:
            return (
                f"Refused: the program uses `{hit.group(0)}`, but this sandbox has no network "
                f"isolation, so network and process-spawning APIs are not allowed."
            )
        return None

    def _run(self, programs: list[Program]) -> list[list[CaseOutcome]]:
        mode = self.mode
        results: list[list[CaseOutcome] | None] = [None] * len(programs)
        todo = []
        for i, program in enumerate(programs):
            reason = self._refusal(program)
            if reason is not None:
                results[i] = [CaseOutcome("refused", stderr=reason) for _ in program.inputs]
            elif not program.inputs:
                results[i] = []
            else:
                todo.append(i)
        if todo:
            report = self._launch([programs[i] for i in todo], mode)
            for i, outcomes in zip(todo, report, strict=True):
                results[i] = outcomes
        return results  # type: ignore[return-value]

    def _launch(self, programs: list[Program], mode: str) -> list[list[CaseOutcome]]:
        limits = self.limits
        workdir = tempfile.mkdtemp(prefix="sdpo-sandbox-")
        os.chmod(workdir, 0o711)  # the sandbox uid may traverse it, not list it
        uid = gid = None
        if mode == "namespaces":
            uid = gid = _next_uid()
            nproc_abs = limits.nproc
        else:
            # RLIMIT_NPROC counts every process of the real uid: leave room for the ones running.
            nproc_abs = _user_process_count(os.getuid()) + limits.nproc
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": "/nonexistent",
            "PYTHONHASHSEED": "0",
        }
        job = {
            "mode": mode,
            "uid": uid,
            "gid": gid,
            "env": env,
            "limits": {**asdict(limits), "nproc_abs": nproc_abs, "wall_s": limits.wall_s},
            "max_timeouts": limits.max_timeouts,
            "programs": [
                {"source": p.source, "inputs": list(p.inputs), "fn_name": p.fn_name, "scripts": p.scripts}
                for p in programs
            ],
        }
        n_cases = sum(len(p.inputs) for p in programs)
        deadline = limits.startup_s + n_cases * (limits.wall_s + 0.25)
        proc = None
        try:
            proc = subprocess.Popen(
                [self.python, "-I", _RUNNER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
            try:
                out, err = proc.communicate(json.dumps(job).encode(), timeout=deadline)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                out, err = proc.communicate()
                timed_out = True
        finally:
            if proc is not None:
                _kill_group(proc.pid)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)
        if timed_out:
            # Only a runaway batch gets here (per-case limits fire first): every case counts
            # as timed out rather than guessing which one hung.
            return [
                [CaseOutcome("timeout", stderr=f"sandbox deadline of {deadline:.1f}s exceeded") for _ in p.inputs]
                for p in programs
            ]
        try:
            report = json.loads(out.decode("utf-8", errors="replace"))
        except ValueError:
            tail = err.decode("utf-8", errors="replace")[-2000:]
            raise SandboxError(f"sandbox runner failed (exit {proc.returncode}): {tail}") from None
        if report.get("setup_error"):
            raise SandboxError(f"sandbox setup failed: {report['setup_error']}")
        return [
            [CaseOutcome(**{k: c[k] for k in CaseOutcome.__dataclass_fields__}) for c in cases]
            for cases in report["programs"]
        ]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
