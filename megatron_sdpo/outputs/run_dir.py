"""The run directory: where every output of a run lives, and how it is read back on resume."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from megatron_sdpo.errors import UserError


class RunDir:
    """Paths and small file formats of one run directory (see README "What a run prints and writes")."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    # -- layout -----------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.root / "resolved_config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def eval_matrix(self) -> Path:
        return self.root / "eval_matrix.csv"

    @property
    def report(self) -> Path:
        return self.root / "report.md"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def drift(self) -> Path:
        return self.root / "drift"

    @property
    def eval_samples(self) -> Path:
        return self.root / "eval_samples"

    @property
    def timings(self) -> Path:
        return self.root / "timings.json"

    def prepare(self, *, resume: bool) -> None:
        """Create the directory (and check it is writable) or check it can be resumed."""
        if self.config.exists() and not resume:
            raise UserError(f"{self.root} already holds a run; pass --resume to continue it or choose another --out")
        if resume and not self.config.exists():
            raise UserError(f"--resume: {self.root} holds no run to resume (no {self.config.name})")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for sub in (self.checkpoints, self.plots, self.drift, self.eval_samples):
                sub.mkdir(exist_ok=True)
            probe = self.root / f".write-test-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise UserError(f"output directory {self.root} is not writable: {exc.strerror}") from None

    # -- metrics.jsonl ----------------------------------------------------------------------
    def append_metrics(self, record: dict) -> None:
        with self.metrics.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def read_metrics(self) -> list[dict]:
        if not self.metrics.exists():
            return []
        out = []
        for line in self.metrics.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a crash mid-write; resume rewrites it
        return out

    def truncate_metrics(self, keep) -> None:
        """Keep only the records for which `keep(record)` is true (resume drops later steps)."""
        kept = [r for r in self.read_metrics() if keep(r)]
        tmp = self.metrics.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        os.replace(tmp, self.metrics)

    # -- eval_matrix.csv --------------------------------------------------------------------
    def write_eval_matrix(self, rows: list[tuple[str, dict[str, float]]]) -> None:
        """rows: (after_stage name, {"domain/split": accuracy}); columns in first-row order."""
        columns: list[str] = []
        for _, accs in rows:
            for key in accs:
                if key not in columns:
                    columns.append(key)
        tmp = self.eval_matrix.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["after_stage", *columns])
            for name, accs in rows:
                w.writerow([name, *(f"{accs[c]:.4f}" if c in accs else "" for c in columns)])
        os.replace(tmp, self.eval_matrix)

    def read_eval_matrix(self) -> list[tuple[str, dict[str, float]]]:
        if not self.eval_matrix.exists():
            return []
        with self.eval_matrix.open(newline="") as f:
            reader = csv.DictReader(f)
            rows = []
            for row in reader:
                name = row.pop("after_stage")
                rows.append((name, {k: float(v) for k, v in row.items() if v not in ("", None)}))
        return rows

    # -- timings.json -----------------------------------------------------------------------
    def write_timings(self, timings: dict) -> None:
        """The run's wall time by phase (stopwatch.RunClock.breakdown); a resumed run's file
        holds its last session's."""
        tmp = self.timings.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(timings, indent=1))
        os.replace(tmp, self.timings)

    def read_timings(self) -> dict | None:
        return json.loads(self.timings.read_text()) if self.timings.is_file() else None
