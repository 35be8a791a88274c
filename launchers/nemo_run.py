#!/usr/bin/env python
"""NeMo-Run launch of `python -m megatron_sdpo run PRESET ...` on this machine or a Slurm cluster.

    python launchers/nemo_run.py PRESET [key=value ...] [--executor local|slurm] [--dryrun]
        [--nodes N] [--gpus-per-node N] [--nproc-per-node N] [--partition P] [--account A]
        [--time HH:MM:SS] [--container-image IMG] [--container-mounts SRC:DST,...]
        [--ssh-host HOST [--ssh-user USER] [--ssh-identity KEY]] [--job-dir DIR]
        [--out RUN_DIR] [--resume] [--data-root DIR] [--packager auto|git|none] [--follow]
        [--python TRAINING_PYTHON]

NeMo-Run lives in its own environment (`make launch-env`: .venv-launch): its Lepton client pins
server libraries older than vLLM's, so one environment cannot hold both (docs/dependencies.md).
This file needs only NeMo-Run and PyYAML (the config loader); the training environment's
interpreter (`--python`, default this one) runs the preflight and a local job:

    .venv-launch/bin/python launchers/nemo_run.py tiny --executor local --python .venv/bin/python

Resources come from the preset's `launch:` section (`launch.nodes=4` style overrides work as for
`megatron_sdpo run`); the flags above override them. The launcher holds no training logic: it
validates the config (a bad preset or key fails here, before anything is queued), runs the CLI's
own preflight `python -m megatron_sdpo run PRESET [overrides] --dry-run --world-size N` (layout,
rollout plan, data schemas, memory estimate for the job's N ranks), then hands NeMo-Run one task,
`python -m megatron_sdpo run PRESET [overrides] --out RUN_DIR [--resume]`,
started through torchrun when the job has more than one process.

`--executor local` runs the job here with the training interpreter (its bin directory first on
PATH) and this checkout on PYTHONPATH, and waits for it. `--executor slurm` renders an sbatch script and
submits it through a LocalTunnel (on a login node) or an SSHTunnel (`--ssh-host`); with
`--dryrun` it only renders the script (no cluster needed) and prints where it is. The Slurm job
runs in its packaged code directory, so relative data paths of the config are made absolute
against `--data-root` (default: the current directory).

A Slurm job started here runs one attempt. To continue it after a failure, preemption or time
limit, submit again with the same `--out` and `--resume`; slurm/continual_*.sh requeue and
resume on their own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

_HERE = Path(__file__).resolve().parent
# Run as a script, this file's directory heads sys.path and `import nemo_run` would import this
# file instead of NeMo-Run.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]
REPO_ROOT = _HERE.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout that is not installed
    sys.path.insert(0, str(REPO_ROOT))

from megatron_sdpo.config.backend_spec import backend_spec  # noqa: E402
from megatron_sdpo.errors import ConfigError, DataError, MissingDependencyError, UserError  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    import nemo_run as run

    from megatron_sdpo.config import RunConfig


def read_cluster_env(path: Path) -> dict[str, str]:
    """KEY=value lines of slurm/cluster.env (comments and blank lines skipped): the environment
    of every cluster job, which the sbatch body reads too. Values are plain words: NeMo-Run
    renders them as unquoted `export KEY=value` lines."""
    env = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier() or not value or any(c in value for c in " \t'\"$`;"):
            raise ConfigError(f"{path}:{number}: expected KEY=word, got {line!r}")
        env[key] = value
    return env


CLUSTER_ENV: dict[str, str] = read_cluster_env(REPO_ROOT / "slurm" / "cluster.env")
# The node list the ranks choose their socket interface from (megatron_sdpo/network.py), as the
# sbatch body exports it.
NODES_SETUP = 'export SDPO_NODES="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr "\\n" " ")"'
DEFAULT_STOP_LEAD_S = 720  # slurm/continual_7b.sh's lead; the preflight checks it against the plan
RESUME_MARKER = "resolved_config.yaml"  # written when a run starts; `--resume` needs it


def _yaml_str(value: str) -> str:
    """`value` as an override that the config loader reads back as this exact string.

    Quoted only where YAML would read it as something else (24:00:00 is YAML 1.1's integer 86400).
    """
    try:
        plain = yaml.safe_load(value) == value
    except yaml.YAMLError:
        plain = False
    return value if plain else json.dumps(value)


def _nemo_run():
    try:
        import nemo_run
    except ImportError as exc:
        raise MissingDependencyError(
            f"nemo_run is needed for the NeMo-Run launcher but is not installed ({exc}); run this file with the "
            "launch environment: make launch-env, then .venv-launch/bin/python launchers/nemo_run.py ..."
        ) from None
    return nemo_run


def training_python(path: str | None) -> str:
    """The interpreter of the training environment (`--python`; default: this one). It runs the
    preflight and a local job, so it must import torch: the launch environment does not."""
    python = path or sys.executable
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ConfigError(f"--python {python}: not an executable file")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
    if subprocess.run([python, "-c", probe], capture_output=True).returncode != 0:
        raise ConfigError(
            f"{python} has no torch: the preflight and a local job need the training environment; "
            "pass its interpreter with --python (e.g. --python .venv/bin/python)"
        )
    return python


def processes_per_node(cfg: RunConfig, requested: int | None = None) -> int:
    """Training processes per node for `cfg`: `requested`, else launch.gpus_per_node for the
    megatron backend and 1 for the `hf` backend (which runs torch DDP when given more: every
    rank generates the same seeded batch, trains on its slice, and rank 0 writes the run)."""
    if requested is not None and requested < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {requested}")
    if cfg.launch.nodes < 1:
        raise ConfigError(f"launch.nodes must be >= 1, got {cfg.launch.nodes}")
    default = cfg.launch.gpus_per_node if backend_spec(cfg.backend.name).model_parallel else 1
    nproc = requested if requested is not None else default
    if nproc < 1:
        raise ConfigError(f"launch.gpus_per_node must be >= 1, got {nproc}")
    return nproc


def megatron_sdpo_task(cli_args: Sequence[str], env: Mapping[str, str] | None = None) -> run.Script:
    """The task every rank runs: `python -m megatron_sdpo <cli_args...>`.

    cli_args: the megatron_sdpo command line, e.g. ["run", "qwen3_4b", "backend.lr=1.0e-5",
    "--out", "/runs/q4b"]. NeMo-Run shell-quotes each argument in the rendered script.
    """
    run = _nemo_run()
    if not cli_args:
        raise UserError("megatron_sdpo_task needs a subcommand (e.g. ['run', 'tiny'])")
    return run.Script(path="megatron_sdpo", args=list(cli_args), entrypoint="python", m=True, env=dict(env or {}))


def local_executor(
    nproc_per_node: int = 1, env_vars: Mapping[str, str] | None = None, *, python: str | None = None
) -> run.LocalExecutor:
    """A LocalExecutor running `nproc_per_node` ranks (through torchrun when more than one).

    LocalExecutor starts `python` (and torchrun) from PATH, so the training interpreter's bin
    directory (`python`, default this one) goes first on PATH, and this checkout on PYTHONPATH:
    the job runs the code that launched it.
    """
    run = _nemo_run()
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        "PATH": os.pathsep.join((str(Path(python or sys.executable).parent), os.environ.get("PATH", ""))),
        "PYTHONPATH": pythonpath,
        "PYTHONUNBUFFERED": "1",
    }
    env.update(env_vars or {})
    return run.LocalExecutor(
        ntasks_per_node=nproc_per_node,
        launcher="torchrun" if nproc_per_node > 1 else None,
        env_vars=env,
        packager=run.Packager(),  # runs in place: nothing to package
    )


def slurm_executor(
    cfg: RunConfig,
    nproc_per_node: int,
    *,
    tunnel: Any,
    packager: Any,
    container_mounts: Sequence[str] = (),
    env_vars: Mapping[str, str] | None = None,
    stop_lead_s: int = DEFAULT_STOP_LEAD_S,
) -> run.SlurmExecutor:
    """A SlurmExecutor for `cfg.launch` (account, partition, nodes, gpus_per_node, time, image).

    One task per node starts torchrun with `nproc_per_node` ranks (NeMo-Run turns
    ntasks_per_node into torchrun's nproc-per-node when the launcher is torchrun). The stop:
    Slurm sends TERM to the job's steps `stop_lead_s` before the time limit (NeMo-Run's batch
    script has no handler, so not B:USR1 as slurm/continual_*.sh); torchrun passes it on and
    waits that long for the ranks' save (PET_SHUTDOWN_TIMEOUT is torchrun's --shutdown-timeout).
    A job stopped so ends; `--resume` continues it.
    """
    run = _nemo_run()
    launch = cfg.launch
    world = launch.nodes * nproc_per_node
    return run.SlurmExecutor(
        account=launch.account,
        partition=launch.partition or None,
        job_name_prefix="sdpo-",
        nodes=launch.nodes,
        ntasks_per_node=nproc_per_node,
        gpus_per_node=launch.gpus_per_node or None,
        time=launch.time,
        exclusive=True,
        mem="0",  # all of each node's memory: vLLM and the trainer share it
        container_image=launch.container_image or None,
        container_mounts=list(container_mounts),
        launcher="torchrun" if world > 1 else None,
        env_vars={
            **CLUSTER_ENV,
            "SDPO_STOP_LEAD_S": str(stop_lead_s),
            "PET_SHUTDOWN_TIMEOUT": str(stop_lead_s),
            **(env_vars or {}),
        },
        signal=f"TERM@{stop_lead_s}",
        setup_lines=NODES_SETUP,
        tunnel=tunnel,
        packager=packager,
    )


def packager_choice(choice: str) -> str:
    """Resolve --packager to "git" or "none" (no nemo-run needed, so it is checked up front).

    git: archive the committed HEAD of this checkout into the job (uncommitted edits are not
    shipped); none: the job imports an installed megatron_sdpo (cluster env or container).
    """
    if choice == "auto":
        choice = "git" if (REPO_ROOT / ".git").exists() else "none"
        print(f"[nemo_run] packager: {choice} (--packager auto)", file=sys.stderr)
    if choice == "git":
        cwd = Path.cwd().resolve()
        if cwd != REPO_ROOT and REPO_ROOT not in cwd.parents:
            # NeMo-Run's Slurm packaging asks git for the repository of the current directory.
            raise ConfigError(
                f"--packager git archives the checkout at {REPO_ROOT}: launch from inside it, "
                "or use --packager none with megatron_sdpo installed on the cluster"
            )
    return choice


def _packager(choice: str):
    run = _nemo_run()
    return run.GitArchivePackager(basepath=str(REPO_ROOT)) if choice == "git" else run.Packager()


def _tunnel(args: argparse.Namespace):
    run = _nemo_run()
    if args.ssh_host:
        return run.SSHTunnel(
            host=args.ssh_host,
            user=args.ssh_user or os.environ.get("USER", ""),
            job_dir=args.job_dir,
            identity=args.ssh_identity,
        )
    # A LocalTunnel submits the script where the experiment wrote it, under NEMORUN_HOME: a
    # --job-dir becomes that home (main), since NeMo-Run does not copy the script into a
    # LocalTunnel's own job_dir (sbatch found no file there).
    return run.LocalTunnel(job_dir="")


def _run_dir(args: argparse.Namespace, cfg: RunConfig, executor: str) -> str:
    if args.out:
        if executor == "slurm" and args.ssh_host and not os.path.isabs(args.out):
            raise ConfigError(f"--out must be an absolute path on the cluster, got {args.out!r}")
        out = args.out if os.path.isabs(args.out) else os.path.abspath(args.out)
    elif args.resume:
        raise UserError("--resume needs --out RUN_DIR (the run directory to continue)")
    elif executor == "slurm" and args.ssh_host:
        raise ConfigError("--ssh-host needs --out: an absolute run directory on the cluster")
    else:
        out = os.path.abspath(os.path.join("runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"))
    if not args.ssh_host:  # the run directory is on this machine: check it before queueing
        held = os.path.exists(os.path.join(out, RESUME_MARKER))
        if held and not args.resume:
            raise UserError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
        if args.resume and not held:
            raise UserError(f"--resume: {out} holds no run to resume (no {RESUME_MARKER})")
    return out


def data_source_overrides(cfg: RunConfig, data_root: str) -> list[str]:
    """`domains.<d>.<split>.source=<data_root>/<path>` for every relative data file of `cfg`.

    A NeMo-Run Slurm job runs in its packaged code directory, not where it was submitted from,
    so relative data paths (the paper presets use data/...) are anchored here, at launch time.
    """
    out = []
    for domain, dcfg in cfg.domains.items():
        sources = [("train", dcfg.train), *((f"eval.{k}", v) for k, v in dcfg.eval.items())]
        for where, src in sources:
            if src.source != "synthetic" and not os.path.isabs(src.source):
                out.append(f"domains.{domain}.{where}.source={_yaml_str(os.path.join(data_root, src.source))}")
    return out


def _anchor_paths(args: argparse.Namespace, cfg: RunConfig) -> tuple[str, list[str]]:
    """(preset, overrides) for a Slurm job: a YAML preset file and relative data paths made
    absolute, since the job's working directory is its packaged code directory."""
    preset = args.preset
    if preset.endswith((".yaml", ".yml")) and not os.path.isabs(preset):
        if args.ssh_host:
            raise ConfigError(f"with --ssh-host the config file must be an absolute path on the cluster: {preset}")
        preset = os.path.abspath(preset)
    if args.data_root is None and args.ssh_host and data_source_overrides(cfg, ""):
        raise ConfigError("the config has relative data paths: with --ssh-host pass --data-root DIR (on the cluster)")
    root = args.data_root if args.data_root is not None else os.getcwd()
    if args.ssh_host and not os.path.isabs(root):
        raise ConfigError(f"--data-root must be an absolute path on the cluster, got {root!r}")
    # Computed from the config with the user's overrides applied, and placed after them, so a
    # relative path given in an override is anchored too.
    return preset, list(args.overrides) + data_source_overrides(cfg, root if args.ssh_host else os.path.abspath(root))


def _check_data_files(cfg: RunConfig) -> None:
    for domain, dcfg in cfg.domains.items():
        for where, src in [("train", dcfg.train), *((f"eval.{k}", v) for k, v in dcfg.eval.items())]:
            if src.source != "synthetic" and not os.path.isfile(src.source):
                raise DataError(f"domains.{domain}.{where}.source: data file not found: {src.source}")


def preflight(
    preset: str, overrides: Sequence[str], world_size: int, python: str | None = None, stop_lead_s: int | None = None
) -> tuple[int, dict[str, str]]:
    """`python -m megatron_sdpo run PRESET [overrides] --dry-run --world-size N` with the training
    interpreter (`python`, default this one) and this checkout; its report and any one-line error
    go to this terminal. With `stop_lead_s` it checks that lead against the stop's planned grace
    and returns the launch environment it writes (the lead and the save's reserve, as the sbatch
    body sources it). Returns (its exit status, 0: the plan resolves; that environment)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [
        python or sys.executable,
        "-m",
        "megatron_sdpo",
        "run",
        preset,
        *overrides,
        "--dry-run",
        "--world-size",
        str(world_size),
    ]
    print(f"[nemo_run] preflight: python -m megatron_sdpo {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    if stop_lead_s is None:
        return subprocess.call(cmd, env=env), {}
    with tempfile.TemporaryDirectory() as tmp:
        launch_env = Path(tmp) / "launch.env"
        rc = subprocess.call([*cmd, "--launch-env", str(launch_env)], env={**env, "SDPO_STOP_LEAD_S": str(stop_lead_s)})
        lines = launch_env.read_text().splitlines() if launch_env.exists() else []
    return rc, dict(ln.removeprefix("export ").split("=", 1) for ln in lines if "=" in ln)


def _find_rendered_sbatch(title: str) -> Path | None:
    from nemo_run.config import get_nemorun_home

    scripts = sorted(
        (Path(get_nemorun_home()) / "experiments" / title).glob("*/*_sbatch.sh"),
        key=lambda p: p.stat().st_mtime,
    )
    return scripts[-1] if scripts else None


def submit(task: run.Script, executor: Any, *, name: str, dryrun: bool = False, follow: bool = True) -> int:
    """Run `task` on `executor` as a one-task NeMo-Run experiment named `name`.

    dryrun: render only (the sbatch script stays under NEMORUN_HOME/experiments/<name>/).
    follow: wait for the job and stream its log (always so for a LocalExecutor).
    Returns 0 when the job succeeded or was submitted, 1 when it failed.
    """
    run = _nemo_run()
    local = isinstance(executor, run.LocalExecutor)
    with run.Experiment(name, executor=executor, log_level="WARN") as exp:
        exp.add(task, name=name, tail_logs=follow)
        if dryrun:
            exp.dryrun(delete_exp_dir=False)
        else:
            exp.run(detach=not (follow or local), tail_logs=follow)
    # Leaving the `with` block is what waits for an attached job to finish.
    if dryrun:
        rendered = _find_rendered_sbatch(name) if isinstance(executor, run.SlurmExecutor) else None
        if rendered is not None:
            print(f"[nemo_run] rendered sbatch script: {rendered}")
        return 0
    if not (follow or local):
        return 0
    states = exp.status(return_dict=True) or {}
    failed = {
        task: str(info.get("status"))
        for task, info in states.items()
        if getattr(info.get("status"), "name", None) != "SUCCEEDED"
    }
    if failed or not states:
        print(f"error: job {name} did not succeed: {failed or 'no status'}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launchers/nemo_run.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("preset", help="preset name or YAML file (as for `megatron_sdpo run`)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides")
    p.add_argument("--executor", choices=["local", "slurm"], help="default: the preset's launch.executor")
    p.add_argument("--dryrun", action="store_true", help="render the job (sbatch script) without running it")
    p.add_argument("--nodes", type=int, help="overrides launch.nodes")
    p.add_argument("--gpus-per-node", type=int, help="overrides launch.gpus_per_node")
    p.add_argument("--nproc-per-node", type=int, help="training processes per node (default: gpus per node)")
    p.add_argument("--partition", help="overrides launch.partition")
    p.add_argument("--account", help="overrides launch.account")
    p.add_argument("--time", help="overrides launch.time (HH:MM:SS)")
    p.add_argument("--container-image", help="overrides launch.container_image")
    p.add_argument("--container-mounts", default="", help="comma-separated SRC:DST container mounts")
    p.add_argument("--ssh-host", help="submit over SSH to this login node (default: sbatch here)")
    p.add_argument("--ssh-user")
    p.add_argument("--ssh-identity", help="SSH private key file")
    p.add_argument(
        "--job-dir",
        help="directory for job files and logs (with --ssh-host: on the cluster; "
        "without: NeMo-Run's home for this launch, default NEMORUN_HOME)",
    )
    p.add_argument("--out", help="run directory (default: runs/<name>-<time>)")
    p.add_argument(
        "--data-root",
        help="slurm: directory that relative data paths of the config are under "
        "(default: the current directory; required with --ssh-host)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--quiet", action="store_true", help="plain log lines instead of progress bars")
    p.add_argument(
        "--packager",
        choices=["auto", "git", "none"],
        default="auto",
        help="slurm: ship this checkout's committed HEAD (git) or use an installed package",
    )
    p.add_argument("--follow", action="store_true", help="slurm: wait for the job and stream its log")
    p.add_argument(
        "--stop-lead-s",
        type=int,
        default=DEFAULT_STOP_LEAD_S,
        help="slurm: seconds before the time limit at which the ranks are told to stop and save "
        f"(checked against the plan's grace; default {DEFAULT_STOP_LEAD_S})",
    )
    p.add_argument(
        "--python",
        help="the training environment's interpreter: runs the preflight and a local job (default: this interpreter)",
    )
    return p


def _launch_overrides(args: argparse.Namespace) -> list[str]:
    flags = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "partition": args.partition,
        "account": args.account,
        "time": args.time,
        "container_image": args.container_image,
    }
    return [f"launch.{k}={v if isinstance(v, int) else _yaml_str(v)}" for k, v in flags.items() if v is not None]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from megatron_sdpo.config import load_config

        cfg = load_config(args.preset, list(args.overrides) + _launch_overrides(args))
        executor_kind = args.executor or cfg.launch.executor
        nproc = processes_per_node(cfg, args.nproc_per_node)
        # Every check that needs no cluster comes before anything is rendered or queued.
        if executor_kind == "local" and cfg.launch.nodes > 1:
            raise ConfigError(f"--executor local runs on this machine only; launch.nodes={cfg.launch.nodes}")
        if executor_kind == "slurm" and not cfg.launch.account:
            raise ConfigError("a Slurm job needs an account: set launch.account or pass --account")
        if args.ssh_host and not (args.job_dir and os.path.isabs(args.job_dir)):
            raise ConfigError("--ssh-host needs --job-dir: an absolute directory on the cluster for job files")
        packager = packager_choice(args.packager) if executor_kind == "slurm" else "none"
        out = _run_dir(args, cfg, executor_kind)
        preset, overrides = args.preset, list(args.overrides)
        if executor_kind == "slurm":
            preset, overrides = _anchor_paths(args, cfg)
            if not args.ssh_host:  # the files are on this machine: check them before queueing
                anchored = load_config(preset, overrides)
                if not args.dryrun:
                    _check_data_files(anchored)
        _nemo_run()
        if args.job_dir and not args.ssh_host:  # job files on this machine: see _tunnel
            from nemo_run.config import set_nemorun_home

            set_nemorun_home(os.path.abspath(args.job_dir))
        python = training_python(args.python)
        world = nproc * (cfg.launch.nodes if executor_kind == "slurm" else 1)
        lead = args.stop_lead_s if executor_kind == "slurm" else None
        rc, stop_env = preflight(preset, overrides, world, python, stop_lead_s=lead)
        if rc != 0:
            return rc
        cli = ["run", preset, *overrides, "--out", out]
        cli += ["--resume"] if args.resume else []
        cli += ["--quiet"] if args.quiet or executor_kind == "slurm" else []
        task = megatron_sdpo_task(cli)
        if executor_kind == "local":
            executor = local_executor(nproc, python=python)
        else:
            mounts = [m for m in args.container_mounts.split(",") if m]
            executor = slurm_executor(
                cfg,
                nproc,
                tunnel=_tunnel(args),
                packager=_packager(packager),
                container_mounts=mounts,
                env_vars=stop_env,
                stop_lead_s=args.stop_lead_s,
            )
        print(
            f"[nemo_run] {executor_kind}: {cfg.launch.nodes if executor_kind == 'slurm' else 1} node(s) x "
            f"{nproc} process(es): python -m megatron_sdpo {' '.join(cli)}",
            file=sys.stderr,
        )
        return submit(task, executor, name=cfg.name, dryrun=args.dryrun, follow=args.follow)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
