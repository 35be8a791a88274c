"""The study's outputs: study.csv (one row per run, one column per metric) and study.md (for each
finding, its metrics per arm against the baseline arm: the paired-by-seed mean difference with
its 95% t-interval and hierarchical bootstrap, the sign count and the verdict; with `--pilot`
the seeds needed for a detectable difference)."""
from __future__ import annotations

import csv
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from megatron_sdpo.data.records import DOMAINS
from megatron_sdpo.study import item_noise, stats
from megatron_sdpo.study.metrics import FINDINGS, METRICS, Metric, RunView, resampled_matrix, run_metrics


@dataclass
class StudyRun:
    arm: str
    seed: Optional[int]
    view: RunView
    values: dict[str, Optional[float]]
    wall_s: Optional[float] = None


@dataclass
class Comparison:
    metric: Metric
    arm: str
    arm_mean: Optional[float]
    base_mean: Optional[float]
    summary: Optional[stats.PairedSummary]
    boot: Optional[tuple[float, float]]
    verdict: str


def load_runs(entries: list[tuple[str, Optional[int], Path]], wall: dict[str, float]) -> list[StudyRun]:
    """The finished runs among (arm, seed, run directory), with every metric computed."""
    runs = []
    for arm, seed, root in entries:
        view = RunView(root)
        if not view.run_dir.report.exists():
            continue
        label = arm if seed is None else f"{arm}/seed{seed}"
        runs.append(StudyRun(arm, seed, view, run_metrics(view), wall.get(label)))
    return runs


def write_csv(path: Path, runs: list[StudyRun]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "run_dir", "wall_s", *(m.name for m in METRICS)])
        for r in runs:
            cells = ["" if r.values[m.name] is None else f"{r.values[m.name]:.6g}" for m in METRICS]
            wall = "" if r.wall_s is None else f"{r.wall_s:.0f}"
            w.writerow([r.arm, "" if r.seed is None else r.seed, str(r.view.root), wall, *cells])
    return path


def _mean(vals: list[Optional[float]]) -> Optional[float]:
    got = [v for v in vals if v is not None]
    return math.fsum(got) / len(got) if got else None


def _bootstrap(
    by_seed: dict[int, dict[str, StudyRun]], baseline: str, arms: list[str], n_boot: int
) -> dict[tuple[str, str], tuple[float, float]]:
    """Percentile intervals of the mean paired difference of every (arm, metric), one
    hierarchical bootstrap for all: each replicate draws seeds, and in each drawn seed one set
    of eval items per column shared by every arm (the pairing); item-level metrics are
    recomputed on the drawn items, the others keep their run's value."""
    seeds = sorted(s for s, runs in by_seed.items() if baseline in runs)
    item_metrics = [m for m in METRICS if m.items]
    index = {m.name: j for j, m in enumerate(METRICS)}

    def point(run: Optional[StudyRun]) -> np.ndarray:
        if run is None:
            return np.full(len(METRICS), np.nan)
        return np.array([np.nan if run.values[m.name] is None else run.values[m.name] for m in METRICS])

    def replicate(seed: int, rng: Optional[np.random.Generator]) -> np.ndarray:
        runs = by_seed[seed]
        draws: dict[tuple[str, int], np.ndarray] = {}
        rows = []
        for arm in [baseline, *arms]:
            run = runs.get(arm)
            vec = point(run)
            if run is not None and rng is not None and run.view.item_scores:
                first = next(iter(run.view.item_scores.values()))
                picks = {}
                for col, items in first.items():
                    key = (col, len(items))
                    if key not in draws:
                        draws[key] = rng.integers(0, len(items), len(items))
                    picks[col] = draws[key]
                view = run.view.with_matrix(resampled_matrix(run.view, picks))
                for m in item_metrics:
                    value = m.fn(view)
                    vec[index[m.name]] = np.nan if value is None else value
            rows.append(vec)
        return np.stack(rows[1:]) - rows[0]  # [arm, metric]

    if not seeds or not arms:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices: metrics a run lacks
        lo, hi = stats.hierarchical_bootstrap(seeds, replicate, n_boot=n_boot)
    out = {}
    for i, arm in enumerate(arms):
        for m in METRICS:
            a, b = lo[i, index[m.name]], hi[i, index[m.name]]
            if np.isfinite(a) and np.isfinite(b):
                out[(arm, m.name)] = (float(a), float(b))
    return out


def compare_arms(runs: list[StudyRun], baseline: str, arms: list[str], *, n_boot: int = 1000) -> list[Comparison]:
    """Every metric of every arm against `baseline`, paired by seed."""
    by_seed: dict[int, dict[str, StudyRun]] = {}
    for r in runs:
        by_seed.setdefault(r.seed if r.seed is not None else 0, {})[r.arm] = r
    others = [a for a in arms if a != baseline]
    boot = _bootstrap(by_seed, baseline, others, n_boot) if n_boot > 0 else {}
    out = []
    for m in METRICS:
        base_vals = [r.values[m.name] for r in runs if r.arm == baseline]
        for arm in others:
            diffs = []
            for group in by_seed.values():
                a, b = group.get(arm), group.get(baseline)
                if a is not None and b is not None and None not in (a.values[m.name], b.values[m.name]):
                    diffs.append(a.values[m.name] - b.values[m.name])  # type: ignore[operator]
            summary = stats.paired_summary(diffs) if diffs else None
            verdict = stats.verdict(summary, m.direction) if summary else (
                stats.DESCRIPTIVE if m.direction is None else stats.INCONCLUSIVE
            )
            out.append(Comparison(
                m, arm, _mean([r.values[m.name] for r in runs if r.arm == arm]), _mean(base_vals),
                summary, boot.get((arm, m.name)), verdict,
            ))
    return out


# -- study.md -----------------------------------------------------------------------------------
def _f(v: Optional[float], digits: int = 3) -> str:
    if v is None or not math.isfinite(v):
        return "–"
    # Drift measures live far below an accuracy's 1e-3: three significant digits there.
    return f"{v:.{digits}g}" if 0 < abs(v) < 10 ** -(digits - 1) else f"{v:.{digits}f}"


def _interval(lo: Optional[float], hi: Optional[float]) -> str:
    return "–" if lo is None or hi is None else f"[{_f(lo)}, {_f(hi)}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _signs(c: Comparison) -> str:
    s = c.summary
    if s is None:
        return "–"
    if c.metric.direction is None:
        return f"+{s.positive} −{s.negative} of {s.n}"
    agree = s.positive if c.metric.direction > 0 else s.negative
    return f"{agree}/{s.n}"


def pilot_rows(comparisons: list[Comparison], detect: float) -> list[list[str]]:
    rows = []
    for c in comparisons:
        s = c.summary
        if c.metric.direction is None or s is None or s.sd is None:
            continue
        rows.append([c.metric.name, c.arm, _f(s.mean), _f(s.sd), str(stats.seeds_needed(s.sd, detect))])
    return rows


PILOT_HEADER = ["metric", "arm", "Δ mean", "paired SD", "seeds needed"]


def write_markdown(
    path: Path,
    *,
    title: str,
    arms: dict[str, str],
    runs: list[StudyRun],
    planned: int,
    baseline: str,
    comparisons: list[Comparison],
    n_boot: int,
    pilot_detect: Optional[float] = None,
) -> Path:
    """study.md; `arms`: name -> its overrides as text."""
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    lines = [f"# {title}", ""]
    lines.append(
        f"{len(runs)} of {planned} runs finished; seeds {', '.join(map(str, seeds)) or 'the config’s own'}; "
        f"every arm against `{baseline}`, paired by seed (each seed has its own eval items, except on exhaustive "
        f"splits (`n: 0`), which are the same for every seed; both arms of a seed answer the same ones)."
    )
    lines += [
        "",
        "Δ = arm − baseline per seed, averaged. 95% t-interval: mean ± t(0.975, n−1)·sd/√n. Bootstrap: "
        f"{n_boot} replicates drawing seeds, then each seed's eval items (one draw per seed shared by the arms); "
        "metrics not read from the eval matrix keep their run's value (seeds only). Verdict: *established* when "
        "the t-interval excludes 0 in the paper's direction and at least 5/6 of the seeds agree in sign; "
        "*contradicted* when the same holds in the opposite direction; *inconclusive* otherwise; "
        "*descriptive* where the paper states no direction.",
        "",
        "## Arms",
        "",
    ]
    arm_rows = []
    for name, overrides in arms.items():
        arm_runs = [r for r in runs if r.arm == name]
        walls = [r.wall_s for r in arm_runs if r.wall_s is not None]
        wall = f"{math.fsum(walls) / len(walls):.0f}" if walls else "–"
        arm_rows.append([name, str(len(arm_runs)), wall, overrides or "–"])
    lines += _table(["arm", "runs finished", "wall s per run", "overrides"], arm_rows)
    lines.append("")
    if len(arms) < 2 or baseline not in arms:
        lines += ["No baseline arm to compare with; per-run metrics are in study.csv.", ""]
    else:
        lines += ["## Findings", ""]
        for key, claim in FINDINGS.items():
            mine = [c for c in comparisons if c.metric.finding == key and (c.arm_mean, c.base_mean) != (None, None)]
            if not mine:
                continue
            lines += [f"### {key}", "", f"Paper: {claim}.", ""]
            rows = []
            for c in mine:
                paper = {1: f"> {baseline}", -1: f"< {baseline}", None: "–"}[c.metric.direction]
                s = c.summary
                rows.append([
                    f"`{c.metric.name}`", c.arm, _f(c.arm_mean), _f(c.base_mean),
                    _f(s.mean) if s else "–", _interval(s.lo, s.hi) if s else "–",
                    _interval(*c.boot) if c.boot else "–", _signs(c), paper, f"*{c.verdict}*",
                ])
            lines += _table(
                ["metric", "arm", "arm mean", f"{baseline} mean", "Δ mean", "95% t-interval",
                 "95% bootstrap", "sign agrees", "paper", "verdict"],
                rows,
            )
            lines.append("")
        lines += ["## Metrics", ""]
        lines += _table(["metric", "finding", "what"], [[f"`{m.name}`", m.finding, m.description] for m in METRICS])
        lines.append("")
    lines += item_noise.markdown(item_noise.check_gains(runs, DOMAINS))
    if pilot_detect is not None:
        lines += [
            f"## Pilot: seeds for a detectable difference of {pilot_detect:g}",
            "",
            "The smallest n with (t(0.975, n−1) + t(0.8, n−1))·sd/√n ≤ Δ: a paired two-sided t-test at 5% "
            "with 80% power, sd the pilot's paired SD.",
            "",
            *_table(PILOT_HEADER, pilot_rows(comparisons, pilot_detect)),
            "",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path
