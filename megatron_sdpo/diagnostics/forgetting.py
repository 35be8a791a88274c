"""Continual-learning metrics from the eval matrix.

``eval_matrix.csv``: header ``after_stage,<domain>/<split>,...``; first row ``base`` (before
any training), then one row per finished stage named by the domain it trained (``math``,
``science``, ...). Cells are accuracies in [0, 1] (or percentages -- the metrics are
differences, so they keep the unit); an empty cell is a missing eval.

With a_{r,c} the accuracy of column c after row r, stage row k_d where domain d was trained,
and F the final row, for every column c of domain d:
  backward transfer  BWT_c = a_{F,c} - a_{k_d,c}
  forgetting         FGT_c = max_{k_d <= r < F} a_{r,c} - a_{F,c}    (Chaudhry et al. 2018)
  forward transfer   FWT_c = a_{k_d - 1,c} - a_{base,c}   (what earlier stages gave d before
                     its own stage; 0 by construction for the first stage, reported anyway)
Domains without a stage row get ``untrained_transfer`` = a_{F,c} - a_{base,c}. Per-domain
headline numbers use the `id_split` column; all columns are reported under "columns".
OOD accuracy is grouped by distance from split names ``ood_near`` / ``ood_mid`` / ``ood_far``.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_sdpo.errors import DataError

OOD_SPLITS = {"ood_near": "near", "ood_mid": "mid", "ood_far": "far"}
_COLUMN_RE = re.compile(r"^[A-Za-z0-9_\-]+/[A-Za-z0-9_\-]+$")


@dataclass
class EvalMatrix:
    """rows: stage names in order ("base" first); columns: "domain/split" names;
    values[row][column]: accuracy, or None where the eval is missing."""

    rows: list[str]
    columns: list[str]
    values: dict[str, dict[str, float | None]]

    def get(self, row: str, column: str) -> float | None:
        return self.values[row].get(column)


def read_eval_matrix(path: str | Path) -> EvalMatrix:
    """Parse eval_matrix.csv; raises DataError naming the file and line on malformed input."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"eval matrix not found: {path}")
    try:
        with path.open(newline="") as fh:
            raw = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: cannot read eval matrix ({exc})") from None
    lines = [(i + 1, row) for i, row in enumerate(raw) if any(cell.strip() for cell in row)]
    if not lines:
        raise DataError(f"{path}: empty eval matrix")
    lineno, first = lines[0]
    header = [h.strip() for h in first]
    if header[0] != "after_stage":
        raise DataError(f"{path}:{lineno}: header must start with 'after_stage', got {header[0]!r}")
    columns = header[1:]
    for col in columns:
        if not _COLUMN_RE.match(col):
            raise DataError(f"{path}:{lineno}: column {col!r} is not '<domain>/<split>'")
    if len(set(columns)) != len(columns):
        raise DataError(f"{path}:{lineno}: duplicate column in header")
    rows: list[str] = []
    values: dict[str, dict[str, float | None]] = {}
    for lineno, cells in lines[1:]:
        if len(cells) != len(header):
            raise DataError(f"{path}:{lineno}: {len(cells)} cells, header has {len(header)}")
        name = cells[0].strip()
        if not name:
            raise DataError(f"{path}:{lineno}: empty stage name")
        if name in values:
            raise DataError(f"{path}:{lineno}: duplicate stage row {name!r}")
        row: dict[str, float | None] = {}
        for col, cell in zip(columns, cells[1:], strict=True):
            cell = cell.strip()
            if cell == "" or cell.lower() in ("nan", "none", "null"):
                row[col] = None
                continue
            try:
                v = float(cell)
            except ValueError:
                raise DataError(f"{path}:{lineno}: column {col}: {cell!r} is not a number") from None
            if math.isinf(v):
                raise DataError(f"{path}:{lineno}: column {col}: accuracy {cell!r} is not finite")
            row[col] = v
        rows.append(name)
        values[name] = row
    if not rows:
        raise DataError(f"{path}: eval matrix has a header but no rows")
    if rows[0] != "base":
        raise DataError(f"{path}: first row must be 'base' (the model before training), got {rows[0]!r}")
    return EvalMatrix(rows, columns, values)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _mean(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return sum(got) / len(got) if got else None


def forgetting_metrics(matrix: EvalMatrix, *, id_split: str = "id") -> dict:
    """Backward/forward transfer, forgetting, final averages and OOD-by-distance.

    Returns a JSON-serializable dict:
      stages: trained stage names in order;
      columns: {column: {"bwt", "forgetting", "fwt", "untrained_transfer", "final", "base"}}
        (keys that do not apply to the column, or whose cells are missing, are None);
      domains: {domain: the same for its `<domain>/<id_split>` column};
      average: {"bwt", "forgetting", "fwt"} over domains (the last-trained domain's BWT and
        forgetting are 0 by definition and left out); final_avg_id, final_avg_all;
      ood: {"near"|"mid"|"far": {"by_row": {row: mean acc}, "final_minus_base": float}}.
    """
    rows = matrix.rows
    stages = rows[1:]
    final = rows[-1]
    stage_row: dict[str, int] = {}
    for i, name in enumerate(rows[1:], start=1):
        stage_row.setdefault(name, i)  # a domain trained twice: its first stage anchors it
    columns: dict[str, dict] = {}
    for col in matrix.columns:
        domain = col.split("/", 1)[0]
        series = [matrix.get(r, col) for r in rows]
        entry = {
            "base": series[0],
            "final": series[-1],
            "bwt": None,
            "forgetting": None,
            "fwt": None,
            "untrained_transfer": None,
        }
        k = stage_row.get(domain)
        if k is None:
            entry["untrained_transfer"] = _diff(series[-1], series[0])
        else:
            entry["fwt"] = _diff(series[k - 1], series[0])
            if k < len(rows) - 1:
                entry["bwt"] = _diff(series[-1], series[k])
                prev = [v for v in series[k:-1] if v is not None]
                entry["forgetting"] = (max(prev) - series[-1]) if prev and series[-1] is not None else None
        columns[col] = entry
    domains = {}
    for col, entry in columns.items():
        domain, split = col.split("/", 1)
        if split == id_split:
            domains[domain] = dict(entry)
    trained = [d for d in stages if d in domains]
    not_last = [d for d in trained if stage_row[d] < len(rows) - 1]
    average = {
        "bwt": _mean([domains[d]["bwt"] for d in not_last]),
        "forgetting": _mean([domains[d]["forgetting"] for d in not_last]),
        "fwt": _mean([domains[d]["fwt"] for d in trained if stage_row[d] > 1]),
    }
    ood: dict[str, dict] = {}
    for split, distance in OOD_SPLITS.items():
        cols = [c for c in matrix.columns if c.split("/", 1)[1] == split]
        if not cols:
            continue
        by_row = {r: _mean([matrix.get(r, c) for c in cols]) for r in rows}
        ood[distance] = {
            "columns": cols,
            "by_row": by_row,
            "final_minus_base": _diff(by_row[final], by_row["base"]),
        }
    return {
        "stages": stages,
        "columns": columns,
        "domains": domains,
        "average": average,
        "final_avg_id": _mean([matrix.get(final, f"{d}/{id_split}") for d in domains]),
        "final_avg_all": _mean([matrix.get(final, c) for c in matrix.columns]),
        "ood": ood,
    }
