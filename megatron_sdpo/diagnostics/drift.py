"""Drift report between two checkpoints: drift.json + PNG plots, and its command line.

    megatron-sdpo drift A B --out DIR [--overlap-with C D] [--responses]

Library use (the continual loop calls this after each stage):
    checkpoint_drift(prev_dir, stage_dir, out_dir=run/"drift"/f"stage_{k}")
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from megatron_sdpo.diagnostics.param_drift import parameter_drift, update_mask_overlap
from megatron_sdpo.diagnostics.sources import SourceLike
from megatron_sdpo.errors import UserError

DRIFT_FILE = "drift.json"
_PLOTTED = (  # (metric key in by_layer entries, figure title, y label, file)
    ("mean_rel_frob", "Relative Frobenius change", "||B-A|| / ||A||", "rel_frob_per_layer.png"),
    (
        "mean_spectral_shift",
        "Spectral shift (top-k singular values)",
        "||s_B-s_A|| / ||s_A||",
        "spectral_shift_per_layer.png",
    ),
    ("mean_angle_mean_deg", "Mean principal angle of top-r singular subspaces", "degrees", "angle_per_layer.png"),
)


def to_json_safe(obj):
    """NaN / inf -> None so drift.json is strict JSON; recurses through dicts and lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): to_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json_safe(v) for v in obj]
    return obj


def _short(label: str) -> str:
    p = Path(label)
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(to_json_safe(data), indent=2, allow_nan=False))
    tmp.replace(path)


def plot_drift(result: dict, out_dir: str | Path) -> list[str]:
    """Per-layer line plots (one line per layer type, labelled at its end: no legend) of
    relative change, spectral shift and subspace angle, plus a per-type bar chart.
    Returns the written file names (relative to out_dir)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    title_pair = f"{_short(result['a'])} \u2192 {_short(result['b'])}"
    written = []
    layers = result["by_layer"]
    idx = sorted(int(i) for i in layers)
    kinds = sorted({k for entry in layers.values() for k in entry if k != "all"})
    if idx and kinds:
        # Small multiples, one panel per layer type on a shared y axis: lines that coincide
        # (e.g. all zero) would hide each other in one panel, and no legend is needed.
        ncols = min(4, len(kinds))
        nrows = math.ceil(len(kinds) / ncols)
        for key, title, ylabel, fname in _PLOTTED:
            fig, axes = plt.subplots(
                nrows, ncols, figsize=(3.2 * ncols, 2.6 * nrows + 0.8), dpi=110, sharex=True, sharey=True, squeeze=False
            )
            for ax, kind in zip(axes.flat, kinds, strict=False):
                xs = [i for i in idx if kind in layers[str(i)]]
                ys = [layers[str(i)][kind][key] for i in xs]
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, color="#4c72b0")
                ax.set_title(kind, fontsize=9)
                ax.grid(alpha=0.3)
            for ax in axes.flat[len(kinds) :]:
                ax.set_visible(False)
            for ax in axes[-1]:
                ax.set_xlabel("layer index")
            for ax in axes[:, 0]:
                ax.set_ylabel(ylabel, fontsize=8)
            fig.suptitle(f"{title} per layer and type\n{title_pair}", fontsize=10)
            fig.tight_layout()
            fig.savefig(out_dir / fname)
            plt.close(fig)
            written.append(fname)
    by_type = result["by_type"]
    if by_type:
        names = list(by_type)
        fig, axes = plt.subplots(1, 3, figsize=(12, 0.45 * len(names) + 1.8), dpi=110, sharey=True)
        panels = (
            ("rel_frob_pooled", "relative change (pooled)"),
            ("mean_spectral_shift", "spectral shift (mean)"),
            ("mean_angle_mean_deg", "subspace angle, degrees (mean)"),
        )
        for ax, (key, label) in zip(axes, panels, strict=True):
            vals = [by_type[n][key] if by_type[n][key] is not None else math.nan for n in names]
            bars = ax.barh(names, vals, color="#4c72b0")
            ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=2)
            ax.set_xlabel(label)
            ax.grid(axis="x", alpha=0.3)
            finite = [v for v in vals if math.isfinite(v)]
            ax.set_xlim(0, (max(finite) * 1.3) if finite and max(finite) > 0 else 1.0)
        axes[0].invert_yaxis()
        fig.suptitle(f"Drift per layer type: {title_pair}", fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / "drift_by_type.png")
        plt.close(fig)
        written.append("drift_by_type.png")
    return written


def checkpoint_drift(
    a_dir: SourceLike,
    b_dir: SourceLike,
    *,
    out_dir: str | Path,
    rank: int = 8,
    spectrum_k: int | None = 64,
    exact_max_dim: int = 512,
    overlap_with: tuple[SourceLike, SourceLike] | None = None,
    top_percent: float = 1.0,
    plots: bool = True,
    seed: int = 0,
) -> dict:
    """Parameter drift a -> b written to `out_dir`/drift.json (+ PNGs); returns the dict.

    overlap_with: a second update (c, d); adds "mask_overlap": Jaccard of the top-p% |dW|
    entries of (a -> b) and (c -> d). Raises CheckpointError on a missing/corrupt checkpoint.
    """
    if rank < 1:
        raise UserError(f"rank must be >= 1, got {rank}")
    if spectrum_k is not None and spectrum_k < 1:
        raise UserError(f"spectrum_k must be >= 1, got {spectrum_k}")
    if not 0.0 < top_percent <= 100.0:
        raise UserError(f"top_percent must be in (0, 100], got {top_percent}")
    out = Path(out_dir)
    result = parameter_drift(a_dir, b_dir, rank=rank, spectrum_k=spectrum_k, exact_max_dim=exact_max_dim, seed=seed)
    if overlap_with is not None:
        result["mask_overlap"] = update_mask_overlap((a_dir, b_dir), overlap_with, top_percent=top_percent)
    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot_drift(result, out) if plots else []
    _write_json(out / DRIFT_FILE, result)
    return result


def add_drift_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `megatron-sdpo drift`."""
    parser.add_argument("a", help="first checkpoint (HF dir with *.safetensors, or a .safetensors file)")
    parser.add_argument("b", help="second checkpoint")
    parser.add_argument("--out", required=True, help="output directory for drift.json and PNGs")
    parser.add_argument("--rank", type=int, default=8, help="top-r singular subspaces for angles (default 8)")
    parser.add_argument(
        "--spectrum-k", type=int, default=64, help="leading singular values in the spectral shift; 0 = all (slow)"
    )
    parser.add_argument(
        "--exact-max-dim", type=int, default=512, help="exact SVD up to this min(m, n), randomized above"
    )
    parser.add_argument(
        "--overlap-with", nargs=2, metavar=("C", "D"), help="also report top-p%% |dW| mask overlap of A->B with C->D"
    )
    parser.add_argument("--top-percent", type=float, default=1.0, help="p of the top-p%% update mask (default 1)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--responses", action="store_true", help="also generate on probe prompts: embedding drift and excess KL"
    )
    parser.add_argument("--domains", default="math,science,tooluse,code", help="probe domains (with --responses)")
    parser.add_argument("--probes", type=int, default=8, help="probe prompts per domain (with --responses)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="generation length (with --responses)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run_drift(args: argparse.Namespace) -> dict:
    """Run the drift report for parsed `add_drift_arguments` args; raises UserError."""
    result = checkpoint_drift(
        args.a,
        args.b,
        out_dir=args.out,
        rank=args.rank,
        spectrum_k=None if args.spectrum_k == 0 else args.spectrum_k,
        exact_max_dim=args.exact_max_dim,
        overlap_with=tuple(args.overlap_with) if args.overlap_with else None,
        top_percent=args.top_percent,
        plots=not args.no_plots,
        seed=args.seed,
    )
    if args.responses:
        from megatron_sdpo.diagnostics.probes import probe_drift

        domains = [d.strip() for d in args.domains.split(",") if d.strip()]
        result["responses"] = probe_drift(
            args.a, args.b, domains=domains, n=args.probes, seed=args.seed, max_new_tokens=args.max_new_tokens
        )
        _write_json(Path(args.out) / DRIFT_FILE, result)
    return result


def _summary_line(result: dict) -> str:
    s = result["summary"]
    parts = [
        f"{s.get('n', 0)} matrices",
        f"rel change {s.get('rel_frob_pooled', math.nan):.4g}",
        f"spectral shift {s.get('mean_spectral_shift', math.nan):.4g}",
        f"angle {s.get('mean_angle_mean_deg', math.nan):.3g} deg (max {s.get('mean_angle_max_deg', math.nan):.3g})",
    ]
    if "mask_overlap" in result:
        parts.append(f"mask Jaccard {result['mask_overlap']['summary']['jaccard_pooled']:.3g}")
    return ", ".join(parts)


def report_drift(args: argparse.Namespace) -> dict:
    """`run_drift` plus its one-line summary on stdout; raises UserError."""
    result = run_drift(args)
    print(f"{_summary_line(result)} -> {os.path.join(args.out, DRIFT_FILE)}")
    return result
