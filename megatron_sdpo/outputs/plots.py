"""PNG figures of a run and of a comparison (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path

from megatron_sdpo.outputs.run_dir import RunDir


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def eval_heatmap(rows: list[tuple[str, dict]], path: Path, title: str) -> Path:
    """Heat map of the eval matrix: rows = after stage, columns = domain/split, cells annotated."""
    plt = _plt()
    cols: list[str] = []
    for _, accs in rows:
        cols += [c for c in accs if c not in cols]
    data = [[accs.get(c, float("nan")) for c in cols] for _, accs in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(cols) + 2), 0.5 * len(rows) + 2))
    im = ax.imshow(data, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), [n if n == "base" else f"after {n}" for n, _ in rows])
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black")
    fig.colorbar(im, ax=ax, label="accuracy")
    ax.set_title(title)
    return _save(plt, fig, path)


def reward_curves(metrics: list[dict], path: Path, title: str) -> Path:
    """Mean training reward per step, one panel per stage."""
    plt = _plt()
    stages = sorted({(m["stage"], m["stage_domain"]) for m in metrics})
    fig, axes = plt.subplots(1, max(len(stages), 1), figsize=(3.2 * max(len(stages), 1), 3), sharey=True, squeeze=False)
    for ax, (stage, domain) in zip(axes[0], stages, strict=False):
        ms = [m for m in metrics if m["stage"] == stage]
        ax.plot([m["step"] for m in ms], [m["reward_mean"] for m in ms], marker=".", lw=1)
        ax.set_title(f"stage {stage + 1}: {domain}")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("mean reward")
    fig.suptitle(title)
    return _save(plt, fig, path)


def drift_per_layer(drift: list[dict], path: Path, title: str) -> Path | None:
    """Relative change and mean principal angle vs base per layer, one line per stage."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.4))
    any_line = False
    for d in drift:
        layers = d.get("param_vs_base", {}).get("by_layer", {})
        if not layers:
            continue
        idx = sorted(layers, key=int)
        a1.plot(
            [int(i) for i in idx],
            [layers[i]["all"]["rel_frob_pooled"] for i in idx],
            marker="o",
            label=f"after {d['domain']}",
        )
        a2.plot(
            [int(i) for i in idx],
            [layers[i]["all"]["mean_angle_mean_deg"] for i in idx],
            marker="o",
            label=f"after {d['domain']}",
        )
        any_line = True
    if not any_line:
        plt.close(fig)
        return None
    from matplotlib.ticker import MaxNLocator

    a1.set_title("relative weight change vs base")
    a2.set_title("mean principal angle vs base (°)")
    for ax in (a1, a2):
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return _save(plt, fig, path)


def artifact_curves(metrics: list[dict], path: Path, title: str) -> Path:
    """Artifact rates over all training steps (stage boundaries marked)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3))
    xs = list(range(1, len(metrics) + 1))
    for key, label in (
        ("artifacts/repeated_ngram_rate", "repeated 4-grams"),
        ("artifacts/fmt_boxed_repeat_rate", "repeated \\boxed"),
        ("artifacts/fmt_answer_close_repeat_rate", "repeated </answer>"),
        ("artifacts/empty_rate", "empty"),
        ("artifacts/truncated_rate", "truncated"),
    ):
        ys = [m.get(key, float("nan")) for m in metrics]
        ax.plot(xs, ys, lw=1, label=label)
    for i in range(1, len(metrics)):
        if metrics[i]["stage"] != metrics[i - 1]["stage"]:
            ax.axvline(i + 0.5, color="grey", ls=":", lw=1)
    ax.set_xlabel("training step (all stages)")
    ax.set_ylabel("rate")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(title)
    return _save(plt, fig, path)


def run_plots(run_dir: RunDir, s: dict) -> list[Path]:
    out = run_dir.plots
    out.mkdir(exist_ok=True)
    pngs = [eval_heatmap(run_dir.read_eval_matrix(), out / "eval_matrix.png", "Accuracy after each stage")]
    if s["metrics"]:
        pngs.append(reward_curves(s["metrics"], out / "reward_curves.png", "Training reward per stage"))
        pngs.append(artifact_curves(s["metrics"], out / "artifacts.png", "Artifact rates during training"))
    if s["drift"]:
        p = drift_per_layer(s["drift"], out / "drift_per_layer.png", "Parameter drift per layer")
        if p is not None:
            pngs.append(p)
    return pngs


def compare_plots(out: Path, summaries: dict[str, dict], runs: dict[str, Path]) -> list[Path]:
    """Per-algorithm final ID accuracy per domain and forgetting vs drift, side by side."""
    plt = _plt()
    out = Path(out) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    algos = list(summaries)
    domains: list[str] = []
    for s in summaries.values():
        domains += [d for d in s["forgetting"]["domains"] if d not in domains]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    width = 0.8 / max(len(algos), 1)
    for i, algo in enumerate(algos):
        doms = summaries[algo]["forgetting"]["domains"]
        ys = [doms.get(d, {}).get("final") or 0.0 for d in domains]
        a1.bar([j + i * width for j in range(len(domains))], ys, width=width, label=algo)
        drift = summaries[algo]["drift"]
        xs = [d.get("param_vs_base", {}).get("summary", {}).get("mean_angle_mean_deg") for d in drift]
        fg = summaries[algo]["forgetting"]["columns"]
        stage_domains = [d["domain"] for d in drift]
        forget = [(fg.get(f"{d}/id") or {}).get("forgetting") for d in stage_domains]
        pts = [(x, y) for x, y in zip(xs, forget, strict=True) if x is not None and y is not None]
        if pts:
            a2.scatter([p[0] for p in pts], [p[1] for p in pts], label=algo)
    a1.set_xticks([j + 0.4 - width / 2 for j in range(len(domains))], domains)
    a1.set_ylabel("final ID accuracy")
    a1.set_ylim(0, 1)
    a1.set_title("Accuracy after the last stage")
    a1.legend(fontsize=8)
    a2.set_xlabel("mean principal angle vs base after the stage (°)")
    a2.set_ylabel("forgetting of that stage's domain")
    a2.set_title("Rotation vs forgetting")
    a2.legend(fontsize=8)
    pngs = [_save(plt, fig, out / "compare.png")]
    for algo, path in runs.items():
        rows = RunDir(path).read_eval_matrix()
        if rows:
            pngs.append(eval_heatmap(rows, out / f"eval_matrix_{algo}.png", f"{algo}: accuracy after each stage"))
    return pngs
