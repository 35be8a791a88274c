"""The study's metrics: one table of metric name -> function over a run directory, each with the
finding it serves and the sign of (arm - GRPO) the paper reports.

Directions come from the paper's numbers (study/paper.py), not from this table. A metric reads a
`RunView` (a run directory; its eval matrix, per-step metrics.jsonl and
drift/stage_<k>.json). Metrics marked `items=True` read only the eval matrix, so the
hierarchical bootstrap can recompute them on a matrix rebuilt from resampled eval items
(eval_samples/<label>.json keeps every answer with its score); the others are fixed per run and
are bootstrapped over seeds only. A new metric is one `Metric` row in `METRICS` (or
`register`): the study's CSV, tables and statistics pick it up.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, cached_property, partial
from pathlib import Path

import numpy as np

from megatron_sdpo.diagnostics.forgetting import EvalMatrix, forgetting_metrics, read_eval_matrix
from megatron_sdpo.interfaces.domains import DOMAINS
from megatron_sdpo.outputs.run_dir import RunDir
from megatron_sdpo.study import paper
from megatron_sdpo.study.inference import ACCURACY_MARGIN

# The paper's claims (Qwen3-4B; docs: method.md "Findings"), one per finding key.
FINDINGS: dict[str, str] = {
    "specialization": "SDPO specializes in-domain faster than GRPO (after MATH ≈ +73% vs ≈ +38% over the base)",
    "forgetting": "Over MATH → SCIENCE → TOOLUSE → CODING SDPO forgets more than GRPO, which improves earlier "
    "domains (final MATH 34.4 vs 57.3, TOOLUSE 9.9 vs 57.7)",
    "final_average": "SDPO ends with a lower in-domain average than GRPO; the 5% EMA teacher collapses "
    "(AIME: frozen 56.42, StableSDPO 55.00, EMA 5% 34.38, base 32.71)",
    "ood_distance": "Forgetting concentrates on intermediate-distance tasks; near and far tasks are kept "
    "(`ood_change/*`: the eval splits' ood_near / ood_mid / ood_far labels; `ood_mmd/*`: terciles of the RBF-MMD "
    "between each stage's training prompts and each OOD set, ood_distance.json)",
    "drift": "SDPO drifts more than GRPO, even with a frozen teacher (spectral shift ≈ 4×, max principal angle "
    "≈ 2.5° vs 0–0.5°, response cosine to the base ≈ 91–94% vs 96–97%)",
    "artifacts": "The collapse mode is repeated format tokens (`\\boxed`) amplified by the teacher-student loop",
}


# -- one run ------------------------------------------------------------------------------------
class RunView:
    """What the metrics read from one run directory (loaded lazily, once)."""

    def __init__(self, root: str | Path, matrix: EvalMatrix | None = None):
        self.root = Path(root)
        self.run_dir = RunDir(self.root)
        if matrix is not None:
            self.__dict__["matrix"] = matrix

    def with_matrix(self, matrix: EvalMatrix) -> RunView:
        """This run with another eval matrix (a bootstrap replicate); the rest is shared."""
        view = RunView(self.root, matrix)
        for key in ("item_counts", "metrics", "drift", "ood_distances"):
            if key in self.__dict__:
                view.__dict__[key] = self.__dict__[key]
        return view

    @cached_property
    def matrix(self) -> EvalMatrix:
        return read_eval_matrix(self.run_dir.eval_matrix)

    @cached_property
    def forgetting(self) -> dict:
        return forgetting_metrics(self.matrix)

    @cached_property
    def ood_by_distance(self) -> dict | None:
        """ood_change_by_distance on this view's matrix (None without ood_distance.json): the
        three ood_mmd metrics read one analysis, computed once per bootstrap replicate."""
        from megatron_sdpo.diagnostics.ood_distance import ood_change_by_distance

        return None if self.ood_distances is None else ood_change_by_distance(self.matrix, self.ood_distances)

    @cached_property
    def metrics(self) -> list[dict]:
        return self.run_dir.read_metrics()

    @cached_property
    def ood_distances(self) -> dict | None:
        """ood_distance.json (None when the run measured none)."""
        from megatron_sdpo.diagnostics.ood_distance import read_distance_table

        return read_distance_table(self.root)

    @cached_property
    def drift(self) -> list[dict]:
        files = sorted(self.run_dir.drift.glob("stage_*.json"), key=lambda p: int(p.stem.split("_")[1]))
        return [json.loads(p.read_text()) for p in files]

    @cached_property
    def item_scores(self) -> dict[str, dict[str, np.ndarray]]:
        """{eval-matrix row: {column: per-item accuracy}} from eval_samples (empty if absent)."""
        return load_item_scores(self.run_dir, self.matrix.rows)

    @cached_property
    def algorithm(self) -> str | None:
        """`algorithm.name` of the run's resolved config (None without one)."""
        if not self.run_dir.config.exists():
            return None
        from megatron_sdpo.config.presets import parse_yaml

        cfg = parse_yaml(self.run_dir.config.read_text()) or {}
        return (cfg.get("algorithm") or {}).get("name")

    @cached_property
    def item_counts(self) -> dict[str, int]:
        """Items per eval column: counted in the saved answers, else the configured `n`."""
        counts: dict[str, int] = {}
        for row in self.item_scores.values():
            for col, items in row.items():
                counts.setdefault(col, len(items))
        if len(counts) < len(self.matrix.columns) and self.run_dir.config.exists():
            from megatron_sdpo.config.presets import parse_yaml

            cfg = parse_yaml(self.run_dir.config.read_text()) or {}
            for col in self.matrix.columns:
                domain, split = col.split("/", 1)
                n = ((cfg.get("domains") or {}).get(domain) or {}).get("eval", {}).get(split, {}).get("n")
                if col not in counts and isinstance(n, int) and n > 0:
                    counts[col] = n
        return counts


def stage_label(rows: list[str], i: int) -> str:
    """The eval_samples label of eval-matrix row i ("base", then "stage_<i>_<domain>")."""
    return "base" if i == 0 else f"stage_{i}_{rows[i]}"


def load_item_scores(rd: RunDir, rows: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """Per-item accuracy (the share of an item's answers scoring 1; one answer under greedy
    eval) per row and column, items in the order first answered. Rows without saved answers are
    left out."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for i, row in enumerate(rows):
        path = rd.eval_samples / f"{stage_label(rows, i)}.json"
        packed = path.with_name(path.name + ".gz")  # an exported study (study/results.py)
        if path.is_file():
            text = path.read_text()
        elif packed.is_file():
            with gzip.open(packed, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            continue
        cols: dict[str, np.ndarray] = {}
        for col, samples in json.loads(text).items():
            ids = [s.get("id") for s in samples]
            keys = ids if all(x is not None for x in ids) else list(range(len(samples)))
            sums: dict = {}
            counts: dict = {}
            for key, s in zip(keys, samples, strict=True):
                sums[key] = sums.get(key, 0.0) + float(float(s["score"]) >= 1.0)
                counts[key] = counts.get(key, 0) + 1
            cols[col] = np.array([sums[k] / counts[k] for k in sums], dtype=np.float64)
        out[row] = cols
    return out


def resampled_matrix(view: RunView, draws: dict[str, np.ndarray]) -> EvalMatrix:
    """The run's eval matrix with every cell recomputed on the drawn items (`draws[column]`:
    indices into the column's items, the same for every row). Cells without saved items keep
    their value."""
    items = view.item_scores
    top = {col: int(idx.max(initial=-1)) for col, idx in draws.items()}  # per column, not per cell
    values: dict[str, dict[str, float | None]] = {}
    for row in view.matrix.rows:
        cells = dict(view.matrix.values[row])
        for col, scores in items.get(row, {}).items():
            idx = draws.get(col)
            if col in cells and idx is not None and len(scores) and top[col] < len(scores):
                # np.mean's own sum and division without its per-call bookkeeping (the bootstrap
                # calls this millions of times): the same float.
                cells[col] = float(np.add.reduce(scores[idx]) / len(idx))
        values[row] = cells
    return EvalMatrix(list(view.matrix.rows), list(view.matrix.columns), values)


# -- the metrics ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Metric:
    name: str
    finding: str  # a key of FINDINGS
    fn: Callable[[RunView], float | None]
    items: bool  # reads only the eval matrix: the bootstrap resamples its eval items
    description: str

    @property
    def direction(self) -> int | None:
        """The sign of (arm - GRPO) the paper's numbers give (study/paper.py); None: the paper
        states none (shown, not judged)."""
        return paper.direction(self.name, paper.PAPER_BASELINE)

    @property
    def margin(self) -> float | None:
        """The equivalence margin: accuracy-type metrics (read from the eval matrix) only."""
        return ACCURACY_MARGIN if self.items and self.name != "forgetting_noise_floor" else None


def _mean(vals: Sequence[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return math.fsum(got) / len(got) if got else None


def _stage_rows(view: RunView) -> list[tuple[int, str]]:
    return [(i, name) for i, name in enumerate(view.matrix.rows) if i > 0]


def in_stage_gain(view: RunView, domain: str | None = None) -> float | None:
    """ID accuracy of a stage's domain after its stage minus before it (mean over stages)."""
    m = view.matrix
    gains = []
    for i, name in _stage_rows(view):
        if domain not in (None, name):
            continue
        col = f"{name}/id"
        a, b = m.values[name].get(col), m.values[m.rows[i - 1]].get(col)
        gains.append(None if a is None or b is None else a - b)
    return _mean(gains)


def mid_stage_gain(view: RunView, domain: str | None = None) -> float | None:
    """ID accuracy of a stage's domain at its first mid-stage eval (`eval.at_steps`, in the
    step's metrics record) minus before the stage (mean over stages that have one)."""
    m = view.matrix
    gains = []
    for i, name in _stage_rows(view):
        if domain not in (None, name):
            continue
        key, before = f"eval/{name}/id", m.values[m.rows[i - 1]].get(f"{name}/id")
        mids = sorted(
            (int(r["step"]), float(r[key]))
            for r in view.metrics
            if r.get("stage") == i - 1 and isinstance(r.get(key), (int, float))
        )
        gains.append(mids[0][1] - before if mids and before is not None else None)
    return _mean(gains)


def reward_auc(view: RunView, domain: str | None = None) -> float | None:
    """Area under a stage's training-reward curve per step: the mean `reward_mean` over the
    stage's steps (mean over stages when no domain is named)."""
    by_stage: dict[int, list[float]] = {}
    for rec in view.metrics:
        if domain is not None and rec.get("stage_domain") != domain:
            continue
        r = rec.get("reward_mean")
        if isinstance(r, (int, float)) and math.isfinite(r):
            by_stage.setdefault(int(rec["stage"]), []).append(float(r))
    return _mean([math.fsum(v) / len(v) for v in by_stage.values()])


# The collapse monitor's windows (diagnostics/artifacts.py, CollapseConfig.length_reference_updates).
REWARD_WINDOW = 3


def reward_change(view: RunView) -> float | None:
    """Per stage, the mean training reward over its last 3 steps minus its first 3 (the windows
    the collapse monitor compares: a stage whose reward rises and then falls ends below where it
    started), mean over the stages with at least 6 steps (the windows must not overlap)."""
    by_stage: dict[int, list[float]] = {}
    for rec in view.metrics:
        r = rec.get("reward_mean")
        if isinstance(r, (int, float)) and math.isfinite(r):
            by_stage.setdefault(int(rec["stage"]), []).append(float(r))
    w = REWARD_WINDOW
    return _mean([math.fsum(v[-w:]) / w - math.fsum(v[:w]) / w for v in by_stage.values() if len(v) >= 2 * w])


@cache
def expected_max_normal(m: int) -> float:
    """E[max of m independent standard normals] (0 for m = 1; 1/sqrt(pi) for m = 2)."""
    if m < 1:
        raise ValueError(f"need at least one draw, got {m}")
    if m == 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 48001)
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    return float(np.trapezoid(x * m * pdf * cdf ** (m - 1), x))


def forgetting_noise_floor(view: RunView) -> float | None:
    """What the max-based forgetting reads when nothing is forgotten: for a domain trained at row
    k and evaluated on n items with mean accuracy p over rows k..F, the m = F - k accuracies
    max'ed over and the final one are then independent with the binomial standard error
    s = sqrt(p (1 - p) / n), and E[max of m - final] = s * E[max of m standard normals].
    Mean over the domains the forgetting averages (all but the last trained)."""
    m, fm = view.matrix, view.forgetting
    rows, counts = m.rows, view.item_counts
    floors: list[float | None] = []
    for domain, entry in fm["domains"].items():
        if entry["forgetting"] is None or domain not in rows:
            continue
        k, col = rows.index(domain), f"{domain}/id"
        accs = [m.values[r].get(col) for r in rows[k:]]
        got = [a for a in accs if a is not None]
        n = counts.get(col)
        if not got or not n:
            floors.append(None)
            continue
        p = math.fsum(got) / len(got)
        floors.append(math.sqrt(p * (1.0 - p) / n) * expected_max_normal(len(rows) - 1 - k))
    return _mean(floors)


def _last_drift(view: RunView, *keys: str) -> float | None:
    if not view.drift:
        return None
    node: object = view.drift[-1]
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return float(node) if isinstance(node, (int, float)) else None


def _artifact(view: RunView, key: str, how: str) -> float | None:
    """`key` of metrics.jsonl over the run's steps: "max", "mean" (over the steps that log it),
    "tail" (mean over the last 20% of steps) or "gain": per stage, the mean over its last 20% of
    steps minus its first 20% (the
    amplification of an artifact, e.g. the assay base's duplicate boxes), averaged over the
    stages where the artifact occurs at all (a tool-use stage has no box to repeat); 0 for a run
    where it never occurs (nothing was amplified: leaving such a run out would drop exactly the
    clean runs from an arm's mean, missing not at random)."""
    vals = [float(r[key]) for r in view.metrics if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    if not vals:
        return None
    if how == "max":
        return max(vals)
    if how == "tail":
        return _window_mean(view.metrics, key, last=True)
    if how == "mean":
        return _mean(vals)
    gains = []
    occurs = False
    for stage in sorted({r.get("stage") for r in view.metrics}, key=str):
        rows = [r for r in view.metrics if r.get("stage") == stage]
        if not any(isinstance(r.get(key), (int, float)) and r[key] > 0 for r in rows):
            continue
        occurs = True
        head, tail = _window_mean(rows, key, last=False), _window_mean(rows, key, last=True)
        if head is not None and tail is not None:
            gains.append(tail - head)
    return _mean(gains) if occurs else 0.0


def _window_mean(rows: list[dict], key: str, *, last: bool) -> float | None:
    """Mean of `key` over the first or last 20% of `rows` (at least one row)."""
    k = max(len(rows) // 5, 1)
    window = rows[-k:] if last else rows[:k]
    return _mean([float(r[key]) for r in window if isinstance(r.get(key), (int, float))])


def _ood(view: RunView, distance: str) -> float | None:
    entry = view.forgetting["ood"].get(distance)
    return entry["final_minus_base"] if entry else None


def _ood_domain(view: RunView, domain: str, distance: str) -> float | None:
    entry = view.forgetting["columns"].get(f"{domain}/ood_{distance}")
    return None if entry is None or entry["final"] is None or entry["base"] is None else entry["final"] - entry["base"]


def _ood_mmd(view: RunView, group: str) -> float | None:
    analysis = view.ood_by_distance
    return None if analysis is None else analysis["groups"].get(group, {}).get("in_stage_mean")


def _final_id(view: RunView, domain: str) -> float | None:
    entry = view.forgetting["domains"].get(domain)
    return entry["final"] if entry else None


def _bwt(view: RunView, domain: str) -> float | None:
    entry = view.forgetting["domains"].get(domain)
    return entry["bwt"] if entry else None


def _per_domain(
    name: str, finding: str, fn: Callable[..., float | None], items: bool, description: str
) -> list[Metric]:
    """`name`/<domain> for every domain: `fn` of that domain, "{d}" in the description its name."""
    return [Metric(f"{name}/{d}", finding, partial(fn, domain=d), items, description.format(d=d)) for d in DOMAINS]


METRICS: list[Metric] = [
    Metric(
        "in_stage_gain",
        "specialization",
        in_stage_gain,
        True,
        "mean over stages of the stage domain's ID accuracy after its stage minus before",
    ),
    *_per_domain(
        "in_stage_gain", "specialization", in_stage_gain, True, "{d} ID accuracy after its stage minus before"
    ),
    Metric(
        "mid_stage_gain",
        "specialization",
        mid_stage_gain,
        False,
        "mean over stages of the stage domain's ID accuracy at its first eval.at_steps eval minus before the stage",
    ),
    *_per_domain(
        "mid_stage_gain",
        "specialization",
        mid_stage_gain,
        False,
        "{d} ID accuracy at the stage's first eval.at_steps eval minus before",
    ),
    Metric(
        "reward_auc",
        "specialization",
        reward_auc,
        False,
        "mean over stages of the mean training reward over the stage's steps",
    ),
    *_per_domain("reward_auc", "specialization", reward_auc, False, "mean training reward over the {d} stage's steps"),
    Metric(
        "backward_transfer",
        "forgetting",
        lambda v: v.forgetting["average"]["bwt"],
        True,
        "mean over domains but the last of final ID accuracy minus its value just after the domain's stage",
    ),
    *_per_domain(
        "backward_transfer", "forgetting", _bwt, True, "{d} final ID accuracy minus its value just after the {d} stage"
    ),
    Metric(
        "forgetting",
        "forgetting",
        lambda v: v.forgetting["average"]["forgetting"],
        True,
        "mean over domains but the last of (best ID accuracy from its stage on) minus final",
    ),
    Metric(
        "forgetting_noise_floor",
        "forgetting",
        forgetting_noise_floor,
        True,
        "what `forgetting` reads with nothing forgotten: binomial SE of the item count × E[max of m normals]",
    ),
    Metric(
        "final_avg_id",
        "final_average",
        lambda v: v.forgetting["final_avg_id"],
        True,
        "mean ID accuracy over domains after the last stage",
    ),
    *_per_domain("final_id", "final_average", _final_id, True, "{d} ID accuracy after the last stage"),
    *(
        Metric(
            f"ood_change/{dist}",
            "ood_distance",
            partial(_ood, distance=dist),
            True,
            f"mean ood_{dist} accuracy, final minus base",
        )
        for dist in ("near", "mid", "far")
    ),
    # One domain's OOD sets: the average above can hide a drop in one domain behind a gain in another.
    *(
        Metric(
            f"ood_change/{d}/{dist}",
            "ood_distance",
            partial(_ood_domain, domain=d, distance=dist),
            True,
            f"{d} ood_{dist} accuracy, final minus base",
        )
        for d in DOMAINS
        for dist in ("near", "mid", "far")
    ),
    *(
        Metric(
            f"ood_mmd/{group}",
            "ood_distance",
            partial(_ood_mmd, group=group),
            True,
            f"mean in-stage OOD change of the {third} third of (stage, OOD set) pairs by RBF-MMD",
        )
        for group, third in (("near", "nearest"), ("mid", "middle"), ("far", "farthest"))
    ),
    Metric(
        "spectral_shift",
        "drift",
        lambda v: _last_drift(v, "param_vs_base", "summary", "mean_spectral_shift"),
        False,
        "mean spectral shift of the final policy vs the base",
    ),
    Metric(
        "max_angle_deg",
        "drift",
        lambda v: _last_drift(v, "param_vs_base", "summary", "mean_angle_max_deg"),
        False,
        "mean over matrices of the max principal angle, final policy vs base (degrees)",
    ),
    Metric(
        "response_cosine",
        "drift",
        lambda v: _last_drift(v, "response_cosine_mean"),
        False,
        "mean cosine of the final policy's answers' embeddings to the base's",
    ),
    Metric(
        "excess_kl",
        "drift",
        lambda v: _last_drift(v, "excess_kl_mean_k3"),
        False,
        "excess KL (k3) of the final policy to the base on its own answers",
    ),
    Metric(
        "boxed_repeat_max",
        "artifacts",
        lambda v: _artifact(v, "artifacts/fmt_boxed_repeat_rate", "max"),
        False,
        "max over steps of the share of responses repeating \\boxed",
    ),
    Metric(
        "boxed_repeat_gain",
        "artifacts",
        lambda v: _artifact(v, "artifacts/fmt_boxed_repeat_rate", "gain"),
        False,
        "share of responses repeating \\boxed, last 20% of a stage's steps minus its first 20%, mean over "
        "the stages where it occurs, 0 where it never does (the assay's endpoint)",
    ),
    Metric(
        "reward_change",
        "artifacts",
        reward_change,
        False,
        "mean training reward over a stage's last 3 steps minus its first 3 (the collapse monitor's windows), "
        "mean over stages of at least 6 steps",
    ),
    Metric(
        "repeated_ngram_late",
        "artifacts",
        lambda v: _artifact(v, "artifacts/repeated_ngram_rate", "tail"),
        False,
        "repeated 4-gram rate over the run's last 20% of steps",
    ),
    Metric(
        "teacher_artifact_endorsement",
        "artifacts",
        lambda v: _artifact(v, "teacher/artifact_endorsement", "mean"),
        False,
        "the teacher's log-prob gain over the student on repeated-format-marker tokens minus on the other "
        "distilled tokens, mean over the teacher-signal steps that had such tokens (SDPO only)",
    ),
]


def register(metric: Metric) -> None:
    """Add a metric (a diagnostic's own module may call this); its name must be new."""
    if metric.finding not in FINDINGS:
        raise ValueError(f"metric {metric.name}: unknown finding {metric.finding!r}")
    if any(m.name == metric.name for m in METRICS):
        raise ValueError(f"metric {metric.name} is already registered")
    METRICS.append(metric)


def run_metrics(view: RunView) -> dict[str, float | None]:
    """Every metric of one run (None where the run lacks what it reads)."""
    out: dict[str, float | None] = {}
    for metric in METRICS:
        value = metric.fn(view)
        out[metric.name] = None if value is None or not math.isfinite(value) else float(value)
    return out
