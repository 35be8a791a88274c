"""Which operation a run's answers use on the synthetic math eval sets, stage by stage.

A drop on an OOD math split can come from arithmetic or from reading the question: an answer
that writes `7 + 3 = 10` for "If 3 of Ann's 7 pens are taken, how many stay?" has the
arithmetic right and the operation wrong. For every run under a study (or run) directory this
reads the saved eval answers of each eval-matrix row, rebuilds each item from the run's own
config (the synthetic sets are a function of it), and reports per arm, eval row and split:
the share of answers whose first `a op b` uses the item's operation, the share using `+`, and
the accuracy, each averaged over seeds.

    python -m megatron_sdpo results operations runs/study-smollm2 [--splits id,ood_near,ood_far] [--csv out.csv]

Only the synthetic math sets carry a worked solution with the operation; other sets are skipped.
"""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from pathlib import Path

# The first binary operation between two numbers; `x` and `×` are multiplication.
EQUATION = re.compile(r"\d+\s*([-+*×x/])\s*\d+")
SPLITS = ("id", "ood_near", "ood_mid", "ood_far")


def first_operation(text: str) -> str | None:
    m = EQUATION.search(text)
    return None if m is None else {"×": "*", "x": "*"}.get(m.group(1), m.group(1))


def run_dirs(root: Path) -> list[Path]:
    """The finished-or-not run directories under `root` (one holding resolved_config.yaml)."""
    if (root / "resolved_config.yaml").is_file():
        return [root]
    return sorted(p.parent for p in root.rglob("resolved_config.yaml"))


def arm_of(run: Path, root: Path) -> str:
    """A study's runs sit at runs/<arm>/seed<k>; anything else is named by its path."""
    rel = run.relative_to(root).parts if run != root else (run.name,)
    return rel[-2] if len(rel) >= 2 and rel[-1].startswith("seed") else "/".join(rel)


def operations(run: Path, splits: tuple[str, ...]) -> dict[tuple[int, str, str], tuple[float, float, float, int]]:
    """{(eval-matrix row index, its label, split): (right-operation share, '+' share, accuracy,
    answers)} of one run, over the rows whose answers were saved."""
    from megatron_sdpo.config import load_config
    from megatron_sdpo.evaluation import load_eval_sets
    from megatron_sdpo.outputs.report import read_eval_samples
    from megatron_sdpo.outputs.run_dir import RunDir
    from megatron_sdpo.study.metrics import stage_label

    rd = RunDir(run)
    sets = load_eval_sets(load_config(str(rd.config)))
    gold: dict[str, str | None] = {}
    for split in splits:
        for rec in sets.get(f"math/{split}", []):
            if rec.get("source") == "synthetic_math":
                gold[rec["id"]] = first_operation(rec.get("solution", ""))
    rows_of_matrix = [name for name, _ in rd.read_eval_matrix()]
    out = {}
    for i in range(len(rows_of_matrix)):
        label = stage_label(rows_of_matrix, i)
        if not (rd.eval_samples / f"{label}.json").is_file():
            continue
        answers = read_eval_samples(rd, label)
        for split in splits:
            rows = [a for a in answers.get(f"math/{split}", []) if a.get("id") in gold]
            if not rows:
                continue
            ops = [first_operation(a.get("response", "")) for a in rows]
            n = len(rows)
            out[(i, label, split)] = (
                sum(op == gold[a["id"]] for op, a in zip(ops, rows, strict=True)) / n,
                sum(op == "+" for op in ops) / n,
                sum(float(a.get("score", 0.0)) for a in rows) / n,
                n,
            )
    return out


def operations_table(root: Path, splits: tuple[str, ...]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the table over every run under `root`: per arm, eval row and split, the
    share of answers using the item's operation, the share using '+', the accuracy (seed means).
    A bad split, no run, a corrupt run or no math answers: UserError (one line)."""
    from megatron_sdpo.errors import UserError

    bad = [s for s in splits if s not in SPLITS]
    if bad:
        raise UserError(f"unknown split {bad[0]!r}; known: {', '.join(SPLITS)}")
    runs = run_dirs(root)
    if not runs:
        raise UserError(f"no run directory (with resolved_config.yaml) under {root}")
    table: dict[tuple[str, int, str, str], list[tuple[float, float, float, int]]] = defaultdict(list)
    for run in runs:
        try:
            found = operations(run, splits)
        except (UserError, ValueError, OSError) as exc:  # a bad config, a corrupt answers file
            raise UserError(f"{run}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        for (i, label, split), value in found.items():
            table[(arm_of(run, root), i, label, split)].append(value)
    if not table:
        raise UserError(f"no synthetic math answers in eval_samples/ under {root}")
    header = ["arm", "row", "split", "runs", "right operation", "'+'", "accuracy"]
    rows = []
    for arm, i, label, split in sorted(table, key=lambda k: (k[0], k[1], SPLITS.index(k[3]))):
        vals = table[(arm, i, label, split)]
        mean = [sum(v[i] for v in vals) / len(vals) for i in range(3)]
        rows.append([arm, label, split, str(len(vals)), *(f"{x:.3f}" for x in mean)])
    return header, rows


def write_table(header: list[str], rows: list[list[str]], csv_path: Path | None = None) -> None:
    """Prints the table as markdown; with `csv_path` writes it there too."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if csv_path is not None:
        with csv_path.open("w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
