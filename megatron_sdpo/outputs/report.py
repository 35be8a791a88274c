"""The run report: eval matrix, forgetting, drift and artifact tables, and plots.

Reads and writes files only: the stage diagnostics computed after every stage
(diagnostics/stage.py) are written to drift/stage_<k>.json here; `write_report` turns a run
directory into report.md + plots; `write_compare` puts several runs side by side.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from megatron_sdpo.config.algorithm_spec import algorithm_spec
from megatron_sdpo.outputs.run_dir import RunDir


def _fmt(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- after each stage -------------------------------------------------------------------------
def read_eval_samples(rd: RunDir, label: str) -> dict[str, list[dict]]:
    """The eval answers saved under `label` ("base", "stage_<k+1>_<domain>"): {eval set: samples}."""
    return json.loads((rd.eval_samples / f"{label}.json").read_text())


def write_stage_drift(rd: RunDir, record: dict) -> Path:
    """drift/stage_<k+1>.json: one stage's diagnostics (diagnostics/stage.py)."""
    path = rd.drift / f"stage_{record['stage']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=float))
    os.replace(tmp, path)  # written by a detached job (drift_jobs.py): never half a record
    return path


STEP_DRIFT_FILE = "steps.jsonl"


def write_step_drift(rd: RunDir, record: dict) -> Path:
    """drift/steps.jsonl: the in-stage parameter drift (diagnostics.drift_every), one line per
    measurement; lines at or after this (stage, step) are dropped first, so a resumed run that
    redoes steps leaves one line per step."""
    path = rd.drift / STEP_DRIFT_FILE
    key = (record["stage"], record["step"])
    kept = [r for r in read_step_drift(rd) if (r["stage"], r["step"]) < key] + [record]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    os.replace(tmp, path)
    return path


def read_step_drift(rd: RunDir) -> list[dict]:
    """The records of drift/steps.jsonl ([] when there is none; unreadable lines are skipped)."""
    path = rd.drift / STEP_DRIFT_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill mid-write is not fatal
        if isinstance(rec, dict) and "stage" in rec and "step" in rec:
            out.append(rec)
    return out


# -- report.md ----------------------------------------------------------------------------------
def _load_drift(rd: RunDir) -> list[dict]:
    files = sorted(rd.drift.glob("stage_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(p.read_text()) for p in files]


def drift_rows(drift: list[dict]) -> list[list]:
    rows = []
    for d in drift:
        pb, pp = d.get("param_vs_base", {}).get("summary", {}), d.get("param_vs_prev", {}).get("summary", {})
        mo = d.get("mask_overlap_vs_prev_update", {}).get("summary", {})
        po = d.get("principal_overlap", {}).get("summary", {})
        rows.append(
            [
                f"{d['stage']} {d['domain']}",
                pp.get("rel_frob_pooled"),
                pb.get("rel_frob_pooled"),
                pb.get("mean_spectral_shift"),
                pb.get("mean_angle_mean_deg"),
                pb.get("mean_angle_max_deg"),
                mo.get("jaccard_pooled"),
                po.get("share_over_chance"),
                d.get("response_cosine_mean"),
                d.get("response_mmd_mean"),
                d.get("excess_kl_mean_k3"),
            ]
        )
    return rows


DRIFT_HEADER = [
    "stage",
    "Δ vs prev (rel. Frobenius)",
    "Δ vs base (rel. Frobenius)",
    "spectral shift vs base",
    "mean angle vs base (°)",
    "mean max angle vs base (°)",
    "update-mask Jaccard vs prev update",
    "update on principal weights (÷ chance)",
    "response cosine vs base",
    "response MMD vs base",
    "excess KL to base (k3)",
]


def artifact_rows(metrics: list[dict]) -> list[list]:
    rows = []
    stages = sorted({(m["stage"], m["stage_domain"]) for m in metrics})
    for stage, domain in stages:
        ms = [m for m in metrics if m["stage"] == stage]
        if not ms:
            continue
        first, last = ms[: max(len(ms) // 5, 1)], ms[-max(len(ms) // 5, 1) :]

        def mean(key, part):
            vals = [m[key] for m in part if key in m and m[key] == m[key]]
            return sum(vals) / len(vals) if vals else None

        rows.append(
            [
                f"{stage + 1} {domain}",
                mean("reward_mean", first),
                mean("reward_mean", last),
                mean("response_len", last),
                mean("artifacts/repeated_ngram_rate", last),
                max((m.get("artifacts/fmt_boxed_repeat_rate", 0.0) for m in ms), default=None),
                mean("artifacts/empty_rate", last),
                mean("artifacts/truncated_rate", last),
                mean("teacher_context_frac", last),
                mean("teacher/gain_gap", first),
                mean("teacher/gain_gap", last),
                sum(1 for m in ms if m.get("collapse_alarm")),
                mean("time/step", ms),
            ]
        )
    return rows


ARTIFACT_HEADER = [
    "stage",
    "reward (first 20%)",
    "reward (last 20%)",
    "response tokens",
    "repeated 4-gram rate",
    "max repeated \\boxed rate",
    "empty rate",
    "truncated rate",
    "teacher-context share",
    # Teacher log-prob gain over the student on rewarded minus unrewarded answers (per token).
    "teacher gain gap (first 20%)",
    "teacher gain gap (last 20%)",
    "collapse alarms",
    "s/step",
]


def _matrix_table(rows: list[tuple[str, dict]]) -> str:
    cols: list[str] = []
    for _, accs in rows:
        cols += [c for c in accs if c not in cols]
    return _table(["after stage", *cols], [[name, *(accs.get(c) for c in cols)] for name, accs in rows])


def summary(rd: RunDir) -> dict:
    """Headline numbers of one run (used by report.md and compare.md)."""
    from megatron_sdpo.diagnostics.forgetting import forgetting_metrics, read_eval_matrix

    fm = forgetting_metrics(read_eval_matrix(rd.eval_matrix))
    rows = rd.read_eval_matrix()
    gains = {}
    for i, (name, accs) in enumerate(rows[1:], start=1):
        key = f"{name}/id"
        if key in accs:
            gains[name] = (rows[i - 1][1].get(key), accs[key])
    from megatron_sdpo.diagnostics.ood_distance import ood_change_by_distance, read_distance_table

    table = read_distance_table(rd.root)
    ood = ood_change_by_distance(read_eval_matrix(rd.eval_matrix), table) if table is not None else None
    return {
        "forgetting": fm,
        "id_gains": gains,
        "drift": _load_drift(rd),
        "metrics": rd.read_metrics(),
        "ood_by_distance": ood,
    }


def timings_table(timings: dict) -> str:
    """Where a run's wall time went (timings.json): each phase, its seconds and share, `steps`
    the training steps themselves, `other` what no phase covered."""
    wall = timings["wall_s"]
    rows = [[name, s, s / wall if wall else None] for name, s in timings["phases"].items()]
    rows.append(["other", timings["other_s"], timings["other_s"] / wall if wall else None])
    rows.append(["run", wall, 1.0 if wall else None])
    return _table(["phase", "seconds", "share"], rows)


def write_report(run_dir: RunDir, cfg, *, wall_seconds: float | None = None, timings: dict | None = None) -> Path:
    """report.md (+ plots/) for one run directory; `timings` defaults to its timings.json."""
    s = summary(run_dir)
    fm = s["forgetting"]
    lines = [f"# {cfg.name}: {cfg.algorithm.name} over {' → '.join(st.domain for st in cfg.stages)}", ""]
    lines.append(
        f"Model `{cfg.model.path}`, backend `{cfg.backend.name}`, rollout `{cfg.rollout.engine}`, "
        f"{cfg.algorithm.prompts_per_step} prompts × {cfg.algorithm.group_size} samples per step, "
        f"lr {cfg.backend.lr:g}, "
        + (f"teacher `{cfg.teacher.mode}`, " if algorithm_spec(cfg.algorithm.name).uses_teacher else "")
        + f"seed {cfg.seed}."
        + (f" Wall time {wall_seconds:.0f} s." if wall_seconds else "")
    )
    lines += ["", "## Eval matrix (accuracy after each stage)", "", _matrix_table(run_dir.read_eval_matrix()), ""]
    timings = timings if timings is not None else run_dir.read_timings()
    if timings:
        lines += ["## Where the wall time went", "", timings_table(timings), ""]
    lines += ["## In-domain accuracy of each stage's domain, before → after its stage", ""]
    lines.append(
        _table(
            ["stage", "before", "after", "gain"],
            [[d, b, a, (a - b) if None not in (a, b) else None] for d, (b, a) in s["id_gains"].items()],
        )
    )
    lines += ["", "## Forgetting (in-distribution split)", ""]
    lines.append(
        _table(
            ["domain", "base", "final", "backward transfer", "forgetting", "forward transfer"],
            [[d, e["base"], e["final"], e["bwt"], e["forgetting"], e["fwt"]] for d, e in fm["domains"].items()],
        )
    )
    avg = fm["average"]
    lines += [
        "",
        f"Average backward transfer {_fmt(avg['bwt'])}, forgetting {_fmt(avg['forgetting'])}, "
        f"forward transfer {_fmt(avg['fwt'])}; final average accuracy {_fmt(fm['final_avg_id'])} (ID), "
        f"{_fmt(fm['final_avg_all'])} (all splits).",
        "",
    ]
    if fm["ood"]:
        lines += ["## Out-of-distribution accuracy by distance", ""]
        names = [r for r, _ in run_dir.read_eval_matrix()]
        lines.append(
            _table(
                ["distance", *names, "final − base"],
                [[d, *(e["by_row"].get(n) for n in names), e["final_minus_base"]] for d, e in fm["ood"].items()],
            )
        )
        lines.append("")
    if s["ood_by_distance"] and s["ood_by_distance"]["pairs"]:
        g = s["ood_by_distance"]["groups"]
        lines += [
            "## OOD change by measured distance (RBF-MMD of prompt embeddings, terciles of the pairs)",
            "",
            _table(
                ["distance", "pairs", "mean MMD", "change in its stage", "change from base"],
                [[n, e["n"], e["distance_mean"], e["in_stage_mean"], e["from_base_mean"]] for n, e in g.items()],
            ),
            "",
        ]
    if s["drift"]:
        lines += ["## Drift after each stage", "", _table(DRIFT_HEADER, drift_rows(s["drift"])), ""]
    if s["metrics"]:
        lines += ["## Training and artifacts per stage", "", _table(ARTIFACT_HEADER, artifact_rows(s["metrics"])), ""]
    if cfg.logging.plots:
        from megatron_sdpo.outputs.plots import run_plots

        pngs = run_plots(run_dir, s)
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in pngs] + [""]
    run_dir.report.write_text("\n".join(lines))
    return run_dir.report


def write_compare(out: Path, runs: dict[str, Path]) -> Path:
    """compare.md: one row per algorithm, side by side, and a comparison plot."""
    out = Path(out)
    summaries = {a: summary(RunDir(p)) for a, p in runs.items()}
    lines = ["# Algorithms side by side", ""]
    rows = []
    for algo, s in summaries.items():
        fm = s["forgetting"]
        gains = [a - b for b, a in s["id_gains"].values() if None not in (a, b)]
        last = s["drift"][-1] if s["drift"] else {}
        pb = last.get("param_vs_base", {}).get("summary", {})
        rows.append(
            [
                algo,
                fm["final_avg_id"],
                fm["final_avg_all"],
                sum(gains) / len(gains) if gains else None,
                fm["average"]["bwt"],
                fm["average"]["forgetting"],
                pb.get("rel_frob_pooled"),
                pb.get("mean_spectral_shift"),
                pb.get("mean_angle_mean_deg"),
                last.get("response_cosine_mean"),
                last.get("excess_kl_mean_k3"),
            ]
        )
    lines.append(
        _table(
            [
                "algorithm",
                "final avg acc (ID)",
                "final avg acc (all)",
                "mean in-stage ID gain",
                "backward transfer",
                "forgetting",
                "Δ vs base (rel. Frobenius)",
                "spectral shift vs base",
                "mean angle vs base (°)",
                "response cosine vs base",
                "excess KL (k3)",
            ],
            rows,
        )
    )
    for algo, s in summaries.items():
        lines += ["", f"## {algo}", "", _matrix_table(RunDir(runs[algo]).read_eval_matrix())]
        if s["drift"]:
            lines += ["", "Drift:", "", _table(DRIFT_HEADER, drift_rows(s["drift"]))]
        if s["metrics"]:
            lines += ["", "Training and artifacts:", "", _table(ARTIFACT_HEADER, artifact_rows(s["metrics"]))]
    from megatron_sdpo.outputs.plots import compare_plots

    pngs = compare_plots(out, summaries, runs)
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.relative_to(out)})" for p in pngs]
    path = out / "compare.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def regenerate(run_dirs: list[Path], out: Path | None = None) -> None:
    """`megatron-sdpo report`: rebuild report.md of each run; with several, also a compare.md."""
    from megatron_sdpo.config.loader import load_config
    from megatron_sdpo.errors import UserError

    for p in run_dirs:
        rd = RunDir(p)
        if not rd.config.exists() or not rd.eval_matrix.exists():
            raise UserError(f"{p} is not a run directory (no resolved_config.yaml / eval_matrix.csv)")
        write_report(rd, load_config(str(rd.config)))
        print(f"wrote {rd.report}")
    if len(run_dirs) > 1:
        target = out or run_dirs[0]
        target.mkdir(parents=True, exist_ok=True)
        names = {}
        for p in run_dirs:
            name = p.name
            while name in names:
                name += "_"
            names[name] = p
        print(f"wrote {write_compare(target, names)}")
