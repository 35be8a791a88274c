"""Hostile programs in the code sandbox: each scores 0 with feedback, within its time limit plus
one second (plus what starting and tearing down a trivial sandboxed program costs on this machine
right now), and leaves no process and no file behind."""

import os
import socket
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import megatron_sdpo
from megatron_sdpo.rewards import sandbox as sb
from megatron_sdpo.rewards.code import score_code
from megatron_sdpo.rewards.sandbox import Program, Sandbox, SandboxLimits

LIMITS = SandboxLimits(timeout_s=1.0, cpu_s=1, memory_mb=256, nproc=12)
REPO = Path(megatron_sdpo.__file__).resolve().parent.parent

needs_namespaces = pytest.mark.skipif(
    sb.isolation_mode() != "namespaces",
    reason="namespace isolation needs root and unshare(2) (the sandbox falls back to rlimits)",
)


def _own_sandbox_uids() -> set[int]:
    """The uids this test process's sandboxes have used so far (other runs on the same machine
    allocate from the same range with another pid, and must not fail these tests)."""
    upto = int(repr(sb._uid_counter)[len("count(") : -1])  # peek without consuming
    return {sb._UID_BASE + (os.getpid() * 7919 + n) % sb._UID_SPAN for n in range(upto)}


def _sandbox_uid_processes() -> list[str]:
    """Live processes owned by one of this process's sandbox uids (zombies included: they must
    be reaped too)."""
    own = _own_sandbox_uids()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        uid = int(status.split("Uid:")[1].split()[0])
        if uid in own:
            found.append(f"{entry}:{status.splitlines()[0]}")
    return found


@pytest.fixture
def workroot(tmp_path, monkeypatch):
    """Sandbox working directories go under tmp_path so the test can see they are removed."""
    root = tmp_path / "sandbox-tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _score(source: str, expected: str = "ok", stdin: str = "", limits=LIMITS):
    record = {"id": "t", "tests": [{"input": stdin, "output": expected}]}
    start = time.monotonic()
    result = score_code(f"```python\n{textwrap.dedent(source)}\n```", record, sandbox=Sandbox(limits))
    return result, time.monotonic() - start


def _start_and_teardown_seconds() -> float:
    """Wall time of a trivial sandboxed program now: the fixed cost (namespaces, interpreter
    start, teardown) every program pays on top of its run time, which grows with the machine's
    load. The kill guarantee is about the run time, so the bound adds it."""
    start = time.monotonic()
    score_code(
        "```python\nprint('ok')\n```", {"id": "t", "tests": [{"input": "", "output": "ok"}]}, sandbox=Sandbox(LIMITS)
    )
    return time.monotonic() - start


def _assert_clean(workroot: Path, elapsed: float, limits=LIMITS) -> None:
    # Killed programs pay the fixed cost twice at most (start, then the kill and teardown).
    bound = limits.timeout_s + 1.0 + 2 * _start_and_teardown_seconds()
    assert elapsed < bound, f"took {elapsed:.2f}s (bound {bound:.2f}s)"
    assert list(workroot.iterdir()) == [], "sandbox working directory left behind"
    deadline = time.monotonic() + 2.0
    while _sandbox_uid_processes() and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel tears a dead pid namespace down asynchronously
    assert _sandbox_uid_processes() == []


@needs_namespaces
def test_good_program_passes(workroot):
    result, elapsed = _score("print(int(input()) * 2)", expected="42", stdin="21")
    assert result.score == 1.0, result.feedback
    _assert_clean(workroot, elapsed)


@needs_namespaces
def test_infinite_loop_times_out(workroot):
    result, elapsed = _score("while True:\n    pass")
    assert result.score == 0.0 and "Time limit exceeded" in result.feedback
    assert result.details["statuses"] == ["timeout"]
    _assert_clean(workroot, elapsed)


@needs_namespaces
def test_fork_bomb_is_contained(workroot):
    src = """
    import os
    while True:
        try:
            os.fork()
        except OSError:
            pass
    """
    result, elapsed = _score(src)
    assert result.score == 0.0 and "Time limit exceeded" in result.feedback
    _assert_clean(workroot, elapsed)


@needs_namespaces
def test_fork_bomb_hits_process_limit(workroot):
    # RLIMIT_NPROC must hold although the trainer is root: count the forks that succeed.
    src = """
    import os, time
    n = 0
    for _ in range(200):
        try:
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            n += 1
        except OSError:
            break
    print(n)
    """
    result, elapsed = _score(src, expected="ok")
    assert result.score == 0.0
    got = int(result.feedback.split("Got:\n")[1].strip())
    assert 0 < got < LIMITS.nproc
    _assert_clean(workroot, elapsed)


@needs_namespaces
def test_memory_bomb_fails(workroot):
    src = """
    chunks = []
    while True:
        chunks.append(bytearray(50 * 1024 * 1024))
    """
    result, elapsed = _score(src)
    assert result.score == 0.0 and "MemoryError" in result.feedback
    _assert_clean(workroot, elapsed)


@needs_namespaces
def test_writes_outside_workdir_fail(workroot, tmp_path):
    name = f"sdpo-escape-{uuid.uuid4().hex}"
    targets = [tmp_path / name, REPO / name, Path("/tmp") / name, Path("/var/tmp") / name]
    src = f"""
    ok = 0
    for path in {[str(t) for t in targets]!r}:
        try:
            with open(path, "w") as f:
                f.write("escaped")
            ok += 1
        except OSError:
            pass
    print("ok" if ok == {len(targets)} else "no")
    """
    try:
        result, elapsed = _score(src)
        assert result.score == 0.0
        for target in targets:
            assert not target.exists(), f"sandbox wrote {target}"
        _assert_clean(workroot, elapsed)
    finally:
        for target in targets:
            if target.exists():
                target.unlink()


@needs_namespaces
def test_output_bomb_is_capped(workroot):
    result, elapsed = _score("while True:\n    print('x' * 4096)")
    assert result.score == 0.0 and "Output limit exceeded" in result.feedback
    _assert_clean(workroot, elapsed)


class _Listener:
    """A TCP server on 127.0.0.1 in the trainer's network namespace; counts accepted clients."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()
            except OSError:
                continue

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


@needs_namespaces
@pytest.mark.parametrize("via_subprocess", [False, True], ids=["audit-hook", "netns"])
def test_socket_to_localhost_fails(workroot, via_subprocess):
    listener = _Listener()
    connect = f"import socket; socket.create_connection(('127.0.0.1', {listener.port}), 0.5)"
    if via_subprocess:
        # A fresh interpreter has no audit hook: only the network namespace stops it.
        src = f"""
        import subprocess, sys
        r = subprocess.run([sys.executable, "-I", "-c", {connect!r}], capture_output=True)
        print("ok" if r.returncode == 0 else r.stderr.decode()[-300:])
        """
    else:
        src = connect + "\nprint('ok')"
    try:
        result, elapsed = _score(src)
    finally:
        listener.close()
    assert result.score == 0.0, result.feedback
    assert listener.accepted == 0
    if via_subprocess:
        assert "unreachable" in result.feedback or "refused" in result.feedback.lower()
    else:
        assert "not allowed in the sandbox" in result.feedback
    _assert_clean(workroot, elapsed)


@needs_namespaces
def test_trainer_environment_is_invisible(workroot, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("SDPO_TEST_SECRET", secret)
    src = """
    import os
    found = os.environ.get("SDPO_TEST_SECRET", "")
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    found += f.read().decode(errors="replace")
            except OSError:
                pass
    print(found)
    """
    result, elapsed = _score(src, expected=secret)
    assert result.score == 0.0
    assert secret not in result.feedback.split("Got:")[1]
    _assert_clean(workroot, elapsed)


@needs_namespaces
def test_background_child_does_not_outlive_the_sandbox(workroot, tmp_path):
    marker = tmp_path / "outlived"
    src = f"""
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(3)
            open({str(marker)!r}, "w").write("alive")
        os._exit(0)
    print("parent done")
    """
    result, elapsed = _score(src)
    assert result.score == 0.0 and "Wrong answer" in result.feedback
    _assert_clean(workroot, elapsed)
    # The namespace's processes are SIGKILLed when the sandbox returns; reaping them can lag a
    # moment on a loaded machine, so poll briefly (well below the child's 3 s sleep).
    deadline = time.time() + 2.0
    while _sandbox_uid_processes() and time.time() < deadline:
        time.sleep(0.05)
    assert _sandbox_uid_processes() == []
    time.sleep(max(0.0, 3.5 - elapsed))
    assert not marker.exists()


@needs_namespaces
def test_batched_mode_isolates_programs(workroot):
    sandbox = Sandbox(LIMITS)
    writer = Program("open('/tmp/shared', 'w').write('leak')\nopen('here', 'w').write('leak')\nprint('written')", [""])
    reader = Program(
        "import os\nprint(os.path.exists('/tmp/shared'), os.path.exists('../p0/here'), os.listdir('.'))", [""]
    )
    out = sandbox.run_batch([writer, reader], batched=True)
    assert out[0][0].stdout.strip() == "written"
    assert out[1][0].stdout.strip() == "False False []"
    assert list(workroot.iterdir()) == []


def test_rlimits_mode_refuses_network_programs(workroot):
    sandbox = Sandbox(LIMITS, isolation="rlimits")
    out = sandbox.run(Program("import socket\nprint(1)", ["", ""]))
    assert [o.status for o in out] == ["refused", "refused"]
    assert "socket" in out[0].stderr and "not allowed" in out[0].stderr


def test_rlimits_mode_runs_good_program_and_kills_loops(workroot, monkeypatch):
    monkeypatch.setenv("SDPO_TEST_SECRET", "visible?")
    sandbox = Sandbox(LIMITS, isolation="rlimits")
    out = sandbox.run(Program("import os\nprint(os.environ.get('SDPO_TEST_SECRET'))", [""]))
    assert out[0].status == "ok" and out[0].stdout.strip() == "None"
    start = time.monotonic()
    loop = sandbox.run(Program("while True: pass", ["", ""]))
    assert [o.status for o in loop] == ["timeout", "skipped"]  # the second case never ran
    # Killed at its limit rather than left to run; the margin is the fixed start and teardown cost
    # measured now, as in _assert_clean (a fixed 1 s failed at 9 s beside two training runs).
    assert time.monotonic() - start < LIMITS.timeout_s + 1.0 + 2 * _start_and_teardown_seconds()
    assert list(workroot.iterdir()) == []


def test_limits_are_validated():
    from megatron_sdpo.errors import ConfigError

    with pytest.raises(ConfigError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ConfigError, match="isolation"):
        Sandbox(isolation="docker")


def test_a_stop_signal_to_the_job_does_not_fail_the_programs_being_scored(workroot):
    """Slurm's TERM (a stop) reaches every process of the job, the sandbox's runner included: the
    rank finishes its step, so the runner must score on, not die and fail the programs left."""
    import signal
    import subprocess

    def term_the_runner():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pids = subprocess.run(["pgrep", "-f", "sandbox_runner.py"], capture_output=True, text=True).stdout.split()
            if pids:
                time.sleep(0.3)  # in the middle of the program
                for pid in pids:
                    os.kill(int(pid), signal.SIGTERM)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=term_the_runner)
    killer.start()
    result, _ = _score(
        "import time\ntime.sleep(1.0)\nprint(int(input()) * 2)",
        expected="42",
        stdin="21",
        limits=SandboxLimits(timeout_s=2.0, cpu_s=2, memory_mb=256, nproc=12),
    )
    killer.join()
    assert result.score == 1.0, result.feedback
