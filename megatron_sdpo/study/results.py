"""A study's data in the repository (`results/<study>/`) and the tables generated from it.

`study export STUDY_DIR --to results/<name>` keeps, per run, what the study's metrics read and
nothing else (kilobytes a run, no checkpoints, no answer texts):

    study.json                   command, commit, machine, date, wall time, arms, seeds; `parts`:
                                 each export's own (a study run in parts joins with --add)
    study.csv                    run x metric, as the study wrote it
    timings.jsonl                wall seconds per run
    runs/<arm>/seed<k>/          eval_matrix.csv, report.md (a stub: the run finished),
                                 resolved_config.yaml, ood_distance.json,
                                 metrics.jsonl (the keys the metrics read), drift/stage_<k>.json
                                 (the drift summaries), eval_samples/<label>.json (item id and score),
                                 operations.json (right-operation shares, synthetic math only)

`study tabulate results/<name> --baseline grpo --baseline sdpo_frozen` recomputes every metric
from those files and writes one table per baseline (`study_vs_<baseline>.md`) in one pass; a
study's published tables are these files.
"""

from __future__ import annotations

import gzip
import json
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from megatron_sdpo.errors import UserError
from megatron_sdpo.outputs.run_dir import RunDir
from megatron_sdpo.study import operations, secondary
from megatron_sdpo.study.findings import compare_arms, load_runs, write_csv, write_markdown
from megatron_sdpo.study.runner import read_timings

STUDY_JSON = "study.json"
# metrics.jsonl keys the study's metrics read (study/metrics.py), by name or prefix.
_METRIC_KEYS = (
    "stage",
    "step",
    "stage_domain",
    "reward_mean",
    "artifacts/fmt_boxed_repeat_rate",
    "artifacts/repeated_ngram_rate",
    "teacher/artifact_endorsement",
    *secondary.STEP_KEYS,
)
_METRIC_PREFIXES = ("eval/",)
# drift/stage_<k>.json: the summaries the drift metrics read.
_DRIFT_KEYS = ("param_vs_base", "response_cosine_mean", "excess_kl_mean_k3")


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _prune_metrics(src: Path, dst: Path) -> None:
    kept = []
    for rec in RunDir(src.parent).read_metrics():
        kept.append({k: v for k, v in rec.items() if k in _METRIC_KEYS or k.startswith(_METRIC_PREFIXES)})
    dst.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))


def _prune_drift(src: Path, dst: Path) -> None:
    data = json.loads(src.read_text())
    out: dict[str, Any] = {k: data[k] for k in _DRIFT_KEYS if k in data}
    if isinstance(out.get("param_vs_base"), dict):
        out["param_vs_base"] = {"summary": out["param_vs_base"].get("summary", {})}
    dst.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


def _prune_samples(src: Path, dst: Path) -> None:
    """Item ids and scores only, gzipped (study/metrics.load_item_scores reads <label>.json.gz)."""
    cols = json.loads(src.read_text())
    out = {col: [{"id": s.get("id"), "score": s["score"]} for s in samples] for col, samples in cols.items()}
    data = (json.dumps(out, separators=(",", ":")) + "\n").encode("utf-8")
    # mtime 0 and no file name in the header: the same bytes on every export of the same run.
    with (
        dst.with_name(dst.name + ".gz").open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f,
    ):
        f.write(data)


def _write_operations(src: Path, dst: Path) -> None:
    """The run's right-operation shares per eval row and synthetic math split (study/operations.py:
    it reads the answers, which the export drops); no file for a run without such answers."""
    if not RunDir(src).config.is_file():
        return
    found = operations.operations(src, operations.SPLITS)
    if found:
        rows = [
            {"row": i, "label": label, "split": split, "right": right, "plus": plus, "accuracy": acc, "n": n}
            for (i, label, split), (right, plus, acc, n) in sorted(found.items())
        ]
        dst.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


def export_run(src: Path, dst: Path) -> None:
    """The files of run `src` the study's metrics read, pruned, into `dst`."""
    rd = RunDir(src)
    dst.mkdir(parents=True, exist_ok=True)
    for path in (rd.eval_matrix, rd.config, src / "ood_distance.json"):
        if path.is_file():
            shutil.copyfile(path, dst / path.name)
    # The marker of a finished run; the report itself (plots, checkpoints) stays with the run.
    RunDir(dst).report.write_text(
        "# Exported run\n\nWhat the study's metrics read of a finished run "
        "(megatron_sdpo/study/results.py); its report, plots and checkpoints stay with "
        "the original run directory.\n"
    )
    if rd.metrics.is_file():
        _prune_metrics(rd.metrics, dst / rd.metrics.name)
    _write_operations(src, dst / secondary.OPERATIONS_JSON)
    for sub, prune in ((rd.drift, _prune_drift), (rd.eval_samples, _prune_samples)):
        files = sorted(sub.glob("*.json")) if sub.is_dir() else []
        if files:
            (dst / sub.name).mkdir(exist_ok=True)
        for f in files:
            prune(f, dst / sub.name / f.name)


def _study_runs(root: Path) -> list[tuple[str, int | None, Path]]:
    """(arm, seed, run directory) of a study laid out as runs/<arm>/seed<k>."""
    out: list[tuple[str, int | None, Path]] = []
    for seed_dir in sorted(root.glob("runs/*/seed*")):
        try:
            seed = int(seed_dir.name.removeprefix("seed"))
        except ValueError:
            continue
        out.append((seed_dir.parent.name, seed, seed_dir))
    return out


def _base_row(run: Path) -> dict[str, float] | None:
    rows = RunDir(run).read_eval_matrix()
    return rows[0][1] if rows and rows[0][0] == "base" else None


def export(
    study_dir: Path, dest: Path, *, command: str, note: str = "", commit: str | None = None, add: bool = False
) -> Path:
    """Export a finished study directory into `dest` (which must not hold another study);
    `commit`: the code the runs ran (default: this checkout's HEAD). With `add`, `dest` holds
    an exported study and the study's finished runs join it, each part (its command, commit,
    machine, date, wall time and runs) recorded in study.json's `parts`: a study run in parts
    (sessions, machines). No run may be exported twice, and every run must share the base row
    of the runs already there (the same model on the same items)."""
    runs = _study_runs(study_dir)
    finished = [(a, s, p) for a, s, p in runs if RunDir(p).report.is_file()]
    if not finished:
        raise UserError(f"{study_dir}: no finished run under runs/<arm>/seed<k> (is it a study directory?)")
    meta_path = dest / STUDY_JSON
    before: dict[str, Any] | None = None
    if add:
        if not meta_path.is_file():
            raise UserError(f"{dest}: no exported study to add to (export without --add first)")
        before = json.loads(meta_path.read_text())
        there = _study_runs(dest)
        twice = sorted(f"{a}/seed{s}" for a, s, _ in finished if (dest / "runs" / a / f"seed{s}").exists())
        if twice:
            raise UserError(f"{dest}: {', '.join(twice)} already exported; a study's run is exported once")
        base = _base_row(there[0][2]) if there else None
        for _, _, p in finished:
            if base is not None and _base_row(p) != base:
                raise UserError(f"{p}: its base row differs from the exported runs' ({dest}); not the same study")
    elif meta_path.exists():
        raise UserError(f"{dest} already holds an exported study; choose another --to (or --add to it)")
    for arm, seed, path in finished:
        export_run(path, dest / "runs" / arm / f"seed{seed}")
    wall = read_timings(study_dir / "timings.jsonl")
    part: dict[str, Any] = {
        "command": command,
        "commit": commit or _commit(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {platform.system()}",
        "exported": time.strftime("%Y-%m-%d", time.gmtime()),
        "wall_s_total": round(sum(wall.values())) if wall else None,
        "runs": [f"{a}/seed{s}" for a, s, _ in finished],
        "note": note,
    }
    if before is None:
        for name in ("study.csv", "timings.jsonl"):
            if (study_dir / name).is_file():
                shutil.copyfile(study_dir / name, dest / name)
        meta = {k: v for k, v in part.items() if k != "runs"}
        meta["arms"] = sorted({a for a, _, _ in finished})
        meta["seeds"] = sorted({s for _, s, _ in finished if s is not None})
        meta["parts"] = [part]
    else:
        labels = set(part["runs"])
        if (study_dir / "timings.jsonl").is_file():
            lines = [
                line
                for line in (study_dir / "timings.jsonl").read_text().splitlines()
                if line.strip() and json.loads(line).get("run") in labels
            ]
            with (dest / "timings.jsonl").open("a") as f:
                f.write("".join(line + "\n" for line in lines))
        all_runs = _study_runs(dest)
        write_csv(dest / "study.csv", load_runs(all_runs, read_timings(dest / "timings.jsonl")), relative_to=dest)
        meta = dict(before)
        first = {
            k: v for k, v in before.items() if k in ("command", "commit", "machine", "exported", "wall_s_total", "note")
        }
        meta["parts"] = [
            *before.get("parts", [{**first, "runs": sorted(set(f"{a}/seed{s}" for a, s, _ in all_runs) - labels)}]),
            part,
        ]
        meta["arms"] = sorted({a for a, _, _ in all_runs})
        meta["seeds"] = sorted({s for _, s, _ in all_runs if s is not None})
        walls = [p["wall_s_total"] for p in meta["parts"] if p.get("wall_s_total") is not None]
        meta["wall_s_total"] = sum(walls) if walls else None
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return dest


def tabulate(results: Path, baselines: list[str], *, n_boot: int = 1000, title: str | None = None) -> list[Path]:
    """Every table of an exported study against each of `baselines`, in one pass."""
    meta_path = results / STUDY_JSON
    if not meta_path.is_file():
        raise UserError(f"{results}: no {STUDY_JSON} (export a study there with `study export`)")
    meta = json.loads(meta_path.read_text())
    arms = list(meta["arms"])
    unknown = [b for b in baselines if b not in arms]
    if unknown or not baselines:
        raise UserError(f"--baseline {', '.join(unknown) or '(none)'}: the study's arms are {', '.join(arms)}")
    entries = _study_runs(results)
    runs = load_runs(entries, read_timings(results / "timings.jsonl"))
    write_csv(results / "study.csv", runs, relative_to=results)
    out = []
    for baseline in baselines:
        comparisons = compare_arms(runs, baseline, arms, n_boot=n_boot)
        out.append(
            write_markdown(
                results / f"study_vs_{baseline}.md",
                title=title or f"{results.name}: every arm against {baseline}",
                arms={a: "" for a in arms},
                runs=runs,
                planned=len(entries),
                baseline=baseline,
                comparisons=comparisons,
                n_boot=n_boot,
            )
        )
    return out


# During a render, each study folder is read once (a document cites one folder in many cells and
# tables); outside one, every call reads the files as they are.
_LOADED: dict[Path, list] | None = None


def _comparisons(results: Path, baseline: str, arm: str) -> dict:
    """`arm` against `baseline` in an exported study, every metric by name (t-intervals only)."""
    key = results.resolve()
    if _LOADED is None or key not in _LOADED:
        runs = load_runs(_study_runs(results), {})
        if _LOADED is not None:
            _LOADED[key] = runs
    else:
        runs = _LOADED[key]
    arms = sorted({r.arm for r in runs})
    if baseline not in arms or arm not in arms:
        raise UserError(f"{results}: arms are {', '.join(arms)}; no {baseline if baseline not in arms else arm}")
    return {c.metric.name: c for c in compare_arms(runs, baseline, [baseline, arm], n_boot=0)}


def findings_table(results: Path, baseline: str, arm: str) -> list[str]:
    """docs/findings.md's table for one exported study: per finding, the paper's claim and
    number, the primary metric, `arm` minus `baseline` with its 95% t-interval, the verdict and
    the data folder (t-intervals only: no bootstrap, the same lines on every machine)."""
    from megatron_sdpo.study import paper
    from megatron_sdpo.study.findings import FINDINGS, _f, _interval

    comps = _comparisons(results, baseline, arm)
    lines = [
        "| finding (paper) | paper's number | primary metric | Δ " + f"{arm} − {baseline}, 95% t-interval "
        "| seeds | verdict | data |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, claim in FINDINGS.items():
        name = paper.PRIMARY[key]
        c = comps.get(name)
        s = c.summary if c is not None else None
        number = paper.PAPER[name].stated if name in paper.PAPER else "none stated for this metric"
        ours = f"{_f(s.mean)} {_interval(s.lo, s.hi)}" if s is not None else "–"
        seeds = str(s.n) if s is not None else "–"
        verdict = f"*{c.verdict}*" if c is not None else "–"
        lines.append(
            f"| {claim.split(' (')[0]} | {number} | `{name}` | {ours} | {seeds} | {verdict} | `{results.as_posix()}` |"
        )
    return lines


def metrics_table(results: Path, baseline: str, arm: str, metrics: list[str]) -> list[str]:
    """docs/findings.md's table of chosen metrics for one exported study: both arms' means,
    `arm` minus `baseline` with the interval at the level the metric is judged at (95% for a
    primary or a metric without a paper direction, Holm's level otherwise), the seeds' signs
    and the verdict (t-intervals only, as `findings_table`)."""
    from megatron_sdpo.study.findings import _f, _interval, _signs

    comps = _comparisons(results, baseline, arm)
    unknown = [m for m in metrics if m not in comps]
    if unknown:
        raise UserError(f"{results}: no metric {', '.join(unknown)} (study/metrics.py names them)")
    lines = [f"| metric | {arm} | {baseline} | Δ, interval (level) | seeds | verdict |", "|---|---|---|---|---|---|"]
    for name in metrics:
        c = comps[name]
        j = c.judgement
        if c.summary is None:
            ours = "–"
        elif j is not None:
            ours = f"{_f(c.summary.mean)} {_interval(j.lo, j.hi)} ({100 * j.level:.1f}%)"
        else:
            ours = f"{_f(c.summary.mean)} {_interval(c.summary.lo, c.summary.hi)} (95.0%)"
        lines.append(f"| `{name}` | {_f(c.arm_mean)} | {_f(c.base_mean)} | {ours} | {_signs(c)} | *{c.verdict}* |")
    return lines


# A generated block names its data; `render_blocks` rewrites what lies between its markers.
_BLOCK = re.compile(
    r"(<!-- (findings|metrics|probe|regime|safeguard|safeguard-tuning|safeguard-secondary|safeguard-collapse|"
    r"safeguard-post-hoc)-table: ([^>]*?) -->\n)(.*?)(\n<!-- /\2-table -->)",
    re.S,
)


def _block_lines(kind: str, args: str) -> list[str]:
    parts = args.split()
    if kind == "findings" and len(parts) == 3:
        return findings_table(Path(parts[0]), parts[1], parts[2])
    if kind == "metrics" and len(parts) == 4:
        return metrics_table(Path(parts[0]), parts[1], parts[2], parts[3].split(","))
    if kind == "probe" and len(parts) == 1:
        from megatron_sdpo.study.competence import probe_table

        return probe_table(Path(parts[0]))
    if kind == "regime" and len(parts) == 1:
        from megatron_sdpo.study.competence import regime_table

        return regime_table(Path(parts[0]))
    if kind == "safeguard-post-hoc" and len(parts) == 2:
        from megatron_sdpo.study import post_hoc

        main, tuning = ([(r.arm, r.seed or 0, r.values) for r in load_runs(_study_runs(Path(p)), {})] for p in parts)
        return post_hoc.table(main, tuning)
    if kind.startswith("safeguard") and kind != "safeguard-post-hoc" and len(parts) == 1:
        from megatron_sdpo.study import post_hoc, preregistered

        loaded = load_runs(_study_runs(Path(parts[0])), {})
        if kind == "safeguard-collapse":
            return post_hoc.collapse_table([(r.arm, r.seed or 0, r.values) for r in loaded])
        if kind == "safeguard-secondary":
            return secondary.table(
                [
                    (r.arm, r.seed or 0, {**r.values, **secondary.step_values(r.view.metrics, r.view.root)})
                    for r in loaded
                ]
            )
        runs = [(r.arm, r.seed or 0, r.values) for r in loaded]
        return preregistered.table(runs) if kind == "safeguard" else preregistered.tuning_table(runs)
    want = (
        "FOLDER TUNING_FOLDER"
        if kind == "safeguard-post-hoc"
        else "FOLDER"
        if kind in ("probe", "regime") or kind.startswith("safeguard")
        else "FOLDER BASELINE ARM" + (" METRIC,METRIC,..." if kind == "metrics" else "")
    )
    raise UserError(f"<!-- {kind}-table: {args} -->: expected <!-- {kind}-table: {want} -->")


def blocks(text: str) -> list[tuple[str, str, str]]:
    """The generated blocks of a document: (kind, arguments, current text)."""
    return [(m.group(2), m.group(3), m.group(4)) for m in _BLOCK.finditer(text)]


def render_blocks(text: str) -> str:
    """`text` with every generated block and inline cell (study/prose.py) rewritten from its
    committed data (paths relative to the working directory)."""
    from megatron_sdpo.study import prose

    global _LOADED
    _LOADED = {}
    try:
        text = _BLOCK.sub(lambda m: m.group(1) + "\n".join(_block_lines(m.group(2), m.group(3))) + m.group(5), text)
        return prose.render_cells(text, _comparisons)
    finally:
        _LOADED = None
