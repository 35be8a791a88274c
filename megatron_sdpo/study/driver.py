"""A study from arms and seeds to study.csv and study.md (`megatron-sdpo study`; `compare` is
its one-seed case): validate every run's config, run what is not finished, tabulate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_sdpo.errors import UserError
from megatron_sdpo.study.arms import Arm, arm_overrides
from megatron_sdpo.study.findings import PILOT_HEADER, compare_arms, load_runs, pilot_rows, write_csv, write_markdown
from megatron_sdpo.study.runner import RunSpec, StudyRunner, read_timings


def study_layout(out: Path) -> Callable[[str, int | None], Path]:
    """OUT/runs/<arm>/seed<k>."""
    return lambda arm, seed: out / "runs" / arm / f"seed{seed}"


@dataclass
class Study:
    preset: str
    arms: list[Arm]
    seeds: list[int | None]  # None: the config's own seed (one run per arm)
    out: Path
    overrides: list[str] = field(default_factory=list)
    baseline: str | None = None  # default: grpo when among the arms, else the first arm
    jobs: int = 1
    threads: int | None = None  # CPU threads split between the jobs (default: this machine's)
    n_boot: int = 1000
    pilot_detect: float | None = None
    layout: Callable[[str, int | None], Path] | None = None
    quiet: bool = False
    verbose: bool = False
    title: str = ""
    comparisons: list = field(default_factory=list)  # filled by `run`

    def specs(self) -> list[RunSpec]:
        """One run per (arm, seed), each config loaded and validated now (fail before training)."""
        layout = self.layout or study_layout(self.out)
        # Every run's base row is the same where the evaluation is greedy: evaluated once
        # (outputs/base_rows.py); the study's own overrides come after and may change it.
        shared = [f"eval.base_row_cache={(self.out / 'base_rows').resolve()}", *self.overrides]
        out = []
        for arm in self.arms:
            for seed in self.seeds:
                ref, ovs = arm_overrides(arm, self.preset, shared, seed)
                out.append(RunSpec(arm.name, seed, ref, tuple(ovs), layout(arm.name, seed)))
        return out

    @property
    def baseline_arm(self) -> str:
        names = [a.name for a in self.arms]
        if self.baseline is not None:
            if self.baseline not in names:
                raise UserError(f"--baseline {self.baseline!r} is not among the arms ({', '.join(names)})")
            return self.baseline
        return "grpo" if "grpo" in names else names[0]

    def run(self) -> Path:
        """Run (or resume) every run not finished, then write study.csv and study.md; UserError
        naming the failed runs after the tables of the finished ones are written."""
        baseline = self.baseline_arm
        specs = self.specs()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"output directory {self.out} is not writable: {exc.strerror}") from None
        timings = self.out / "timings.jsonl"
        # Seed by seed: a study stopped early (or out of budget) holds whole seeds, every arm paired.
        order = sorted(specs, key=lambda s: self.seeds.index(s.seed))
        failed = StudyRunner(
            order,
            jobs=self.jobs,
            threads=self.threads,
            log_dir=self.out / "logs" if self.jobs > 1 else None,
            timings=timings,
            quiet=self.quiet,
            verbose=self.verbose,
        ).run()
        md = self.tabulate(specs, baseline, timings)
        if failed:
            shown = "; ".join(f"{s.label} (exit {rc}{f', log {log}' if log else ''})" for s, rc, log in failed)
            raise UserError(f"study: {len(failed)} run(s) failed: {shown}; tables of the finished runs: {md}")
        return md

    def tabulate(self, specs: list[RunSpec], baseline: str, timings: Path) -> Path:
        runs = load_runs([(s.arm, s.seed, s.out) for s in specs], read_timings(timings))
        write_csv(self.out / "study.csv", runs)
        names = [a.name for a in self.arms]
        comparisons = compare_arms(runs, baseline, names, n_boot=self.n_boot)
        self.comparisons = comparisons
        return write_markdown(
            self.out / "study.md",
            title=self.title or f"Study: {self.preset}, arms {', '.join(names)}",
            arms={
                a.name: " ".join(a.overrides) + (f" (restart every {a.restart_every} steps)" if a.restart_every else "")
                for a in self.arms
            },
            runs=runs,
            planned=len(specs),
            baseline=baseline,
            comparisons=comparisons,
            n_boot=self.n_boot,
            pilot_detect=self.pilot_detect,
        )

    def pilot_report(self) -> str:
        """The pilot's seed counts as plain text (after `run`)."""
        if self.pilot_detect is None:
            return ""
        rows = pilot_rows(self.comparisons, self.pilot_detect)
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(PILOT_HEADER)]
        lines = [
            f"seeds needed to detect a difference of {self.pilot_detect:g} "
            f"(paired t-test, 5% two-sided, 80% power; paired SD from {len(self.seeds)} pilot seeds):",
            "  ".join(h.ljust(w) for h, w in zip(PILOT_HEADER, widths, strict=True)),
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join(lines)
