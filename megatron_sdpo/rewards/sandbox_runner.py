"""The process that runs inside the sandbox: isolates itself, then runs each test case in a fork.

Executed as ``python -I sandbox_runner.py`` by :mod:`megatron_sdpo.rewards.sandbox`, never
imported by the trainer. It reads one JSON job from stdin and writes one JSON report to stdout.
The report carries raw outputs only: expected outputs never enter the sandbox, so a program
cannot forge a pass by writing to the report channel.

Process tree in "namespaces" mode (the runner starts as root):

    runner (root, host pid namespace)  unshare(net, mount, pid, ipc, uts); read-only mounts
      `-- init (pid 1 of a fresh pid namespace, root)   mounts /proc, loops over cases
            `-- case child (sandbox uid, rlimits, audit hook)  executes the program

A fork per case keeps cases independent (a test script, too, runs in the fork of its case, after
the program); ``kill(-1, SIGKILL)`` from init after each case kills
every process left in the namespace (background children, fork-bomb survivors), and when init
dies the kernel kills the whole namespace, so nothing can outlive the sandbox.

"rlimits" mode (no namespaces available) uses the same loop without the isolation steps; each
case child gets its own process group, killed after the case.
"""

import builtins
import ctypes
import io
import json
import linecache
import os
import resource
import select
import shutil
import signal
import sys
import time
import traceback

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
RESULT_FD = 3

_libc = ctypes.CDLL(None, use_errno=True)
# Bound now: a program runs in this interpreter before a test script does, and could replace
# builtins.exec / compile (then the script would not run and the case would pass).
_EXEC, _COMPILE = exec, compile


class SetupError(Exception):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _mount_points() -> list:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # Mount points escape spaces as \040; octal-decode them.
            point = line.split()[4].encode().decode("unicode_escape")
            if point not in points:
                points.append(point)
    return points


def _closed_ancestor(path: str):
    """The top-most ancestor of `path` (itself included) that others may not traverse."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        candidate = "/" + "/".join(parts[:i])
        if not os.stat(candidate).st_mode & 0o001:
            return candidate
    return None


def _expose_interpreter() -> None:
    """Let the sandbox uid import the stdlib even when it lives under a closed directory (e.g.
    a pyenv under /root): mask the closed directory with an empty tmpfs (hiding everything else
    in it) and bind only the interpreter's own directories back in."""
    wanted = {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path)
        if p
    }
    wanted = {p for p in wanted if os.path.isdir(p)}
    # Binding a directory covers its subdirectories.
    outermost = sorted(p for p in wanted if not any(p.startswith(q + "/") for q in wanted))
    masks: dict = {}
    for path in outermost:
        closed = _closed_ancestor(path)
        if closed is not None and closed != path:
            masks.setdefault(closed, []).append(path)
    for closed, paths in masks.items():
        handles = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in paths]
        _mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for path, fd in handles:
            target = path
            os.makedirs(target, 0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
            os.close(fd)


def isolate(limits: dict) -> None:
    """Enter fresh namespaces and make the whole file system read-only except the cwd."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    workdir = os.getcwd()
    _mount(workdir, workdir, None, MS_BIND | MS_REC)
    _expose_interpreter()
    exe = os.path.realpath(sys.executable)
    # The launcher may be a virtualenv's python under a directory masked below (e.g. /tmp):
    # programs that start an interpreter must find the real one.
    sys.executable = exe
    for point in _mount_points():
        if point == workdir:
            continue
        ret = _libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
        if ret != 0 and point == "/":
            raise SetupError(f"cannot make / read-only: {os.strerror(ctypes.get_errno())}")
    os.chdir(workdir)  # re-enter through the writable bind mount
    for scratch in SCRATCH_DIRS:
        if not os.path.isdir(scratch) or exe.startswith(scratch + "/"):
            continue
        # A private, size-capped tmpfs: writes to /tmp vanish with the sandbox.
        _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(limits['tmpfs_mb'])}m,mode=1777")


def _clear_scratch() -> None:
    for scratch in SCRATCH_DIRS:
        if not os.path.isdir(scratch):
            continue
        for name in os.listdir(scratch):
            path = os.path.join(scratch, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def _block_network(mode: str):
    blocked = (
        ("socket.",)
        if mode == "namespaces"
        else ("socket.", "ctypes.", "subprocess.", "os.exec", "os.posix_spawn", "os.system", "pty.")
    )

    def hook(event: str, args) -> None:
        if event.startswith(blocked):
            raise PermissionError(f"{event} is not allowed in the sandbox (no network access)")

    return hook


def _set_limits(limits: dict) -> None:
    mb = 1 << 20
    cpu = max(1, int(limits["cpu_s"]))
    for res, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2),
        (resource.RLIMIT_FSIZE, (limits["fsize_mb"] * mb,) * 2),
        (resource.RLIMIT_NOFILE, (limits["nofile"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_NPROC, (limits["nproc_abs"],) * 2),
    ):
        resource.setrlimit(res, value)


def _run_program(source: str, fn_name, stdin_text: str, script=None, token: bytes = b"") -> int:
    """Execute the program in this (child) process; returns the exit status. With `script` (a
    test script) the script runs after the program in its globals, and `token` is written to the
    result channel only once it has run to its end: a program that exits early (os._exit(0))
    never runs the test, and exit status 0 alone does not pass it."""
    try:
        code = _COMPILE(source, "solution.py", "exec")
        main = fn_name is None and script is None
        glb = {"__name__": "__main__" if main else "solution", "__builtins__": builtins}
        _EXEC(code, glb)
        if script is not None:
            # The traceback of a failing script then shows its failing line (the feedback's).
            linecache.cache["test.py"] = (len(script), None, script.splitlines(True), "test.py")
            _EXEC(_COMPILE(script, "test.py", "exec"), glb)
            os.write(RESULT_FD, token)
        elif fn_name is not None:
            if "Solution" in glb and isinstance(glb["Solution"], type):
                fn = getattr(glb["Solution"](), fn_name, None)
            else:
                fn = glb.get(fn_name)
            if not callable(fn):
                print(f"NameError: function {fn_name!r} is not defined", file=sys.stderr)
                return 1
            args = [json.loads(line) for line in stdin_text.split("\n") if line.strip()]
            value = fn(*args)
            os.write(RESULT_FD, json.dumps(value, default=repr).encode())
        return 0
    except SystemExit as exc:
        status = exc.code
        if status is None or isinstance(status, int):
            return int(status or 0) & 0xFF
        print(status, file=sys.stderr)
        return 1
    except BaseException as exc:  # the program's own error: report its traceback
        # Drop this harness's frame: the program should see only its own frames.
        tb = exc.__traceback__
        traceback.print_exception(type(exc), exc, tb.tb_next if tb is not None else None)
        return 1


def _child(job: dict, program: dict, case_input: str, fds, mode: str, token: bytes) -> None:
    status = 1
    try:
        in_fd, out_fd, err_fd, res_fd = fds
        if mode != "namespaces":
            os.setpgid(0, 0)
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        for src, dst in ((in_fd, 0), (out_fd, 1), (err_fd, 2), (res_fd, RESULT_FD)):
            os.dup2(src, dst)
        os.closerange(RESULT_FD + 1, 1 << 16)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="replace")
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="replace", line_buffering=True
        )
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        _set_limits(job["limits"])
        if job.get("uid") is not None:
            os.setgroups([])
            os.setgid(job["gid"])
            os.setuid(job["uid"])
        os.chdir(program["dir"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.addaudithook(_block_network(mode))
        script = case_input if program.get("scripts") else None
        status = _run_program(
            program["source"], program.get("fn_name"), "" if script is not None else case_input, script, token
        )
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        try:
            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:
            pass
    os._exit(status)


def _read_fd(fd: int, cap: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, cap + 1)
    text = data[:cap].decode("utf-8", errors="replace")
    return text + ("\n...[output truncated]" if len(data) > cap else "")


def _reap_all() -> None:
    """(init only) Kill every other process in the pid namespace and reap it."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


_TICK_S = 0.05  # how often a running case's CPU time is read
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(pid: int, mode: str) -> float:
    """CPU time of every process of a case: its own plus what it reaped from its children
    (utime, stime, cutime, cstime). RLIMIT_CPU is per process, so a program that forks workers
    (or a fork bomb) would pass the limit on to each of them; the sum is what is judged.
    namespaces: every process of the pid namespace but init; rlimits: the case's process group."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (mode == "namespaces" and entry == "1"):
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if mode != "namespaces" and int(fields[2]) != pid:  # fields[2]: the process group
            continue
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / _CLOCK_TICKS


def _wait_case(pid: int, pidfd: int, limits: dict, mode: str) -> tuple[bool, float]:
    """Wait for the case's process to end, reading its tree's CPU time every tick: killed once
    over the CPU limit (timed out) or past the wall backstop. (timed out, CPU seconds seen)."""
    start, cpu = time.monotonic(), 0.0
    while True:
        left = limits["wall_s"] - (time.monotonic() - start)
        ready, _, _ = select.select([pidfd], [], [], max(0.0, min(_TICK_S, left)))
        if ready:
            return False, cpu
        cpu = max(cpu, _tree_cpu_seconds(pid, mode))
        if cpu > limits["timeout_s"] or left <= 0:
            if mode == "namespaces":
                os.kill(-1, signal.SIGKILL)
            else:
                os.killpg(pid, signal.SIGKILL)
            return True, cpu


def _run_case(job: dict, program: dict, case_input: str, mode: str) -> dict:
    """Run one case in a fork. Its verdict on time is its CPU time (its process tree's, and
    wait4's rusage), not the wall clock: a loaded machine slows a case down without adding CPU
    time to it. The wall limit is the backstop for a case that uses no CPU (sleeps, blocks)."""
    limits = job["limits"]
    scripts = bool(program.get("scripts"))
    token = os.urandom(16).hex().encode() if scripts else b""
    fds = [os.memfd_create(name) for name in ("stdin", "stdout", "stderr", "result")]
    try:
        os.write(fds[0], ("" if scripts else case_input).encode())
        os.lseek(fds[0], 0, os.SEEK_SET)
        sys.stdout.flush()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(job, program, case_input, fds, mode, token)
        pidfd = os.pidfd_open(pid)
        killed, tree_cpu = _wait_case(pid, pidfd, limits, mode)
        _, wstatus, usage = os.wait4(pid, 0)
        wall = time.monotonic() - start
        os.close(pidfd)
        if mode == "namespaces":
            _reap_all()
        else:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        cap = int(limits["output_chars"])
        result = _read_fd(fds[3], cap) if program.get("fn_name") or scripts else None
        stderr = _read_fd(fds[2], cap)
        if scripts and result != token.decode() and os.WIFEXITED(wstatus) and os.WEXITSTATUS(wstatus) == 0:
            stderr += "\nThe program ended (exit status 0) before the test ran.\n"
        outcome = {
            "stdout": _read_fd(fds[1], cap),
            "stderr": stderr,
            "result": None if scripts else result,
            "wall_s": round(wall, 4),
            "cpu_s": round(max(tree_cpu, usage.ru_utime + usage.ru_stime), 4),
            "returncode": None,
            "signal": None,
        }
    finally:
        for fd in fds:
            os.close(fd)
    if os.WIFSIGNALED(wstatus):
        outcome["signal"] = os.WTERMSIG(wstatus)
    else:
        outcome["returncode"] = os.WEXITSTATUS(wstatus)
    sig = outcome["signal"]
    if killed or sig == signal.SIGXCPU or outcome["cpu_s"] > limits["timeout_s"]:
        outcome["status"] = "timeout"
    elif sig == signal.SIGXFSZ:
        outcome["status"] = "output_limit"
    elif sig is not None:
        outcome["status"] = "signal"
    elif outcome["returncode"] != 0:
        outcome["status"] = "error"
    elif scripts and result != token.decode():
        outcome["status"] = "error"
    else:
        outcome["status"] = "ok"
    return outcome


def run_jobs(job: dict, mode: str) -> list:
    report = []
    for index, program in enumerate(job["programs"]):
        # Relative on purpose: /tmp may be masked by the scratch tmpfs, the cwd is not.
        program["dir"] = f"p{index}"
        os.mkdir(program["dir"], 0o700)
        if job.get("uid") is not None:
            os.chown(program["dir"], job["uid"], job["gid"])
        outcomes, timeouts = [], 0
        for case_input in program["inputs"]:
            if timeouts >= job["max_timeouts"]:
                outcomes.append(
                    {
                        "status": "skipped",
                        "stdout": "",
                        "stderr": "",
                        "result": None,
                        "wall_s": 0.0,
                        "cpu_s": 0.0,
                        "returncode": None,
                        "signal": None,
                    }
                )
                continue
            outcome = _run_case(job, program, case_input, mode)
            timeouts += outcome["status"] == "timeout"
            outcomes.append(outcome)
        report.append(outcomes)
        # Nothing of one program may be visible to the next one in a batch.
        shutil.rmtree(program["dir"], ignore_errors=True)
        if mode == "namespaces":
            _clear_scratch()
    return report


def main() -> None:
    # A scheduler's stop signal reaches every process of the job: it is the rank's to act on (it
    # finishes its step, scores included), and a runner killed by it would fail every program
    # still to run. The runner ends by its own deadline, or with the rank when the rank dies.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    job = json.loads(sys.stdin.buffer.read())
    mode = job["mode"]
    out = sys.stdout
    try:
        if mode == "namespaces":
            isolate(job["limits"])
            sys.stdout.flush()
            init = os.fork()
            if init != 0:
                _, wstatus = os.waitpid(init, 0)
                os._exit(os.waitstatus_to_exitcode(wstatus) & 0xFF)
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV)
        report: dict = {"setup_error": None, "programs": run_jobs(job, mode)}
    except SetupError as exc:
        report = {"setup_error": str(exc), "programs": []}
    out.write(json.dumps(report))
    out.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
