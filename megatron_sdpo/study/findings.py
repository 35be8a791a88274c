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

import numpy as np

from megatron_sdpo.interfaces.domains import DOMAINS
from megatron_sdpo.study import inference, item_noise, paper, stats
from megatron_sdpo.study.metrics import FINDINGS, METRICS, Metric, RunView, resampled_matrix, run_metrics


@dataclass
class StudyRun:
    arm: str
    seed: int | None
    view: RunView
    values: dict[str, float | None]
    wall_s: float | None = None


@dataclass
class Comparison:
    metric: Metric
    arm: str
    arm_mean: float | None
    base_mean: float | None
    summary: stats.PairedSummary | None
    boot: tuple[float, float] | None
    verdict: str
    direction: int | None = None  # the paper's, against this baseline (study/paper.py)
    judgement: inference.Judgement | None = None  # primary / Holm level, its interval, adjusted p


def load_runs(entries: list[tuple[str, int | None, Path]], wall: dict[str, float]) -> list[StudyRun]:
    """The finished runs among (arm, seed, run directory), with every metric computed."""
    runs = []
    for arm, seed, root in entries:
        view = RunView(root)
        if not view.run_dir.report.exists():
            continue
        label = arm if seed is None else f"{arm}/seed{seed}"
        runs.append(StudyRun(arm, seed, view, run_metrics(view), wall.get(label)))
    return runs


def write_csv(path: Path, runs: list[StudyRun], *, relative_to: Path | None = None) -> Path:
    """study.csv; run directories relative to `relative_to` when given (an exported study)."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "run_dir", "wall_s", *(m.name for m in METRICS)])
        for r in runs:
            cells = ["" if r.values[m.name] is None else f"{r.values[m.name]:.6g}" for m in METRICS]
            wall = "" if r.wall_s is None else f"{r.wall_s:.0f}"
            root = r.view.root.relative_to(relative_to) if relative_to is not None else r.view.root
            w.writerow([r.arm, "" if r.seed is None else r.seed, str(root), wall, *cells])
    return path


def _mean(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return math.fsum(got) / len(got) if got else None


def shared_items(by_seed: dict[int, dict[str, StudyRun]], seeds: list[int]) -> bool:
    """Whether every seed answered the same eval items (every column the same item count in every
    run: the exhaustive splits, `n: 0`). Then the bootstrap is crossed: one item draw per
    replicate shared by all seeds; else each seed's items are drawn on their own."""
    counts = {tuple(sorted(r.view.item_counts.items())) for s in seeds for r in by_seed[s].values()}
    return len(counts) == 1


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

    def point(run: StudyRun | None) -> np.ndarray:
        if run is None:
            return np.full(len(METRICS), np.nan)
        return np.array([np.nan if run.values[m.name] is None else run.values[m.name] for m in METRICS])

    def replicate(seed: int, draws: inference.ItemDraws | None) -> np.ndarray:
        runs = by_seed[seed]
        rows = []
        for arm in [baseline, *arms]:
            run = runs.get(arm)
            vec = point(run)
            if run is not None and draws is not None and run.view.item_scores:
                first = next(iter(run.view.item_scores.values()))
                picks = {col: draws.get((col, len(items)), len(items)) for col, items in first.items()}
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
        lo, hi = inference.bootstrap(seeds, replicate, crossed=shared_items(by_seed, seeds), n_boot=n_boot)
    out = {}
    for i, arm in enumerate(arms):
        for m in METRICS:
            a, b = lo[i, index[m.name]], hi[i, index[m.name]]
            if np.isfinite(a) and np.isfinite(b):
                out[(arm, m.name)] = (float(a), float(b))
    return out


def compare_arms(runs: list[StudyRun], baseline: str, arms: list[str], *, n_boot: int = 1000) -> list[Comparison]:
    """Every metric of every arm against `baseline`, paired by seed; per finding and arm, the
    primary metric judged at 95% and the secondaries at Holm's levels (study/inference.py),
    with the paper's directions where `baseline` is the paper's and the arm is not GRPO
    (study/paper.py)."""
    by_seed: dict[int, dict[str, StudyRun]] = {}
    for r in runs:
        by_seed.setdefault(r.seed if r.seed is not None else 0, {})[r.arm] = r
    others = [a for a in arms if a != baseline]
    boot = _bootstrap(by_seed, baseline, others, n_boot) if n_boot > 0 else {}
    # The paper's directions are SDPO's against GRPO: a GRPO arm against the GRPO baseline (the
    # paper's 4-step recipe against one step) is described, not judged.
    grpo_arms = {r.arm for r in runs if r.view.algorithm == "grpo"}
    out = []
    for m in METRICS:
        base_vals = [r.values[m.name] for r in runs if r.arm == baseline]
        for arm in others:
            direction = None if arm in grpo_arms else paper.direction(m.name, baseline)
            diffs = []
            for group in by_seed.values():
                a, b = group.get(arm), group.get(baseline)
                if a is not None and b is not None and None not in (a.values[m.name], b.values[m.name]):
                    diffs.append(a.values[m.name] - b.values[m.name])  # type: ignore[operator]
            summary = stats.paired_summary(diffs) if diffs else None
            out.append(
                Comparison(
                    m,
                    arm,
                    _mean([r.values[m.name] for r in runs if r.arm == arm]),
                    _mean(base_vals),
                    summary,
                    boot.get((arm, m.name)),
                    stats.DESCRIPTIVE if direction is None else stats.INCONCLUSIVE,
                    direction,
                )
            )
    for key in FINDINGS:
        for arm in others:
            mine = [c for c in out if c.metric.finding == key and c.arm == arm]
            names = [c.metric.name for c in mine]
            primary = names.index(paper.PRIMARY[key]) if paper.PRIMARY.get(key) in names else 0
            judged = inference.judge_finding(
                [c.summary for c in mine], [c.direction for c in mine], [c.metric.margin for c in mine], primary
            )
            for c, j in zip(mine, judged, strict=True):
                c.judgement, c.verdict = j, j.verdict
    return out


# -- study.md -----------------------------------------------------------------------------------
def _f(v: float | None, digits: int = 3) -> str:
    if v is None or not math.isfinite(v):
        return "–"
    # Drift measures live far below an accuracy's 1e-3: three significant digits there.
    return f"{v:.{digits}g}" if 0 < abs(v) < 10 ** -(digits - 1) else f"{v:.{digits}f}"


def _interval(lo: float | None, hi: float | None) -> str:
    return "–" if lo is None or hi is None else f"[{_f(lo)}, {_f(hi)}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _signs(c: Comparison) -> str:
    s = c.summary
    if s is None:
        return "–"
    if c.direction is None:
        return f"+{s.positive} −{s.negative} of {s.n}"
    agree = s.positive if c.direction > 0 else s.negative
    return f"{agree}/{s.n}"


def pilot_rows(comparisons: list[Comparison], detect: float) -> list[list[str]]:
    rows = []
    for c in comparisons:
        s = c.summary
        if c.direction is None or s is None or s.sd is None:
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
    pilot_detect: float | None = None,
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
        "Δ = arm − baseline per seed, averaged. t-interval: mean ± t((1+L)/2, n−1)·sd/√n at the level L a metric "
        "is judged at: 95% for each finding's primary metric (study/paper.py), Holm's step-down level over the "
        "finding's other metrics that have a paper direction (p (Holm): the adjusted two-sided p). Bootstrap: "
        f"{n_boot} replicates drawing seeds and eval items (one item draw per replicate shared by every seed when "
        "the seeds answer the same items, crossed; else one per seed; both arms of a seed on the same items); "
        "metrics not read from the eval matrix keep their run's value (seeds only). Verdict: *established* when "
        "the interval excludes 0 in the paper's direction and at least 5/6 of the seeds agree in sign; "
        "*contradicted* when the same holds in the opposite direction; *equivalent* (accuracy-type metrics) when "
        f"two one-sided tests reject a difference of {inference.ACCURACY_MARGIN:g} or more; *inconclusive* "
        "otherwise; *descriptive* where the paper states no number (or the baseline is not GRPO, the paper's).",
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
                direction = {1: f"> {baseline}", -1: f"< {baseline}", None: "–"}[c.direction]
                s, j = c.summary, c.judgement
                role = "primary" if j is not None and j.primary else "secondary"
                level = f"{100 * j.level:.2f}%".replace(".00%", "%") if j is not None else "–"
                rows.append(
                    [
                        f"`{c.metric.name}`",
                        role,
                        c.arm,
                        _f(c.arm_mean),
                        _f(c.base_mean),
                        _f(s.mean) if s else "–",
                        f"{_interval(j.lo, j.hi) if j else '–'} ({level})",
                        _interval(*c.boot) if c.boot else "–",
                        _signs(c),
                        _f(j.p_adjusted) if j is not None and j.p_adjusted is not None else "–",
                        direction,
                        f"*{c.verdict}*",
                    ]
                )
            lines += _table(
                [
                    "metric",
                    "role",
                    "arm",
                    "arm mean",
                    f"{baseline} mean",
                    "Δ mean",
                    "t-interval (level)",
                    "95% bootstrap",
                    "sign agrees",
                    "p (Holm)",
                    "paper",
                    "verdict",
                ],
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
