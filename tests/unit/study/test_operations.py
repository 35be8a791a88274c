"""study/operations.py on a hand-made study: two runs whose answers use known operations."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sdpo import cli
from megatron_sdpo.config import dump_yaml, load_config
from megatron_sdpo.evaluation import load_eval_sets
from megatron_sdpo.outputs.run_dir import RunDir
from megatron_sdpo.study import operations as M


def _cli(argv: list[str]) -> int:
    return cli.main(["results", "operations", *argv])


def test_first_operation():
    assert M.first_operation("7 + 3 = 10. The answer is \\boxed{10}.") == "+"
    assert M.first_operation("Ann has 4 bags: 4 x 5 = 20") == "*"
    assert M.first_operation("4×5=20") == "*"
    assert M.first_operation("The answer is \\boxed{3}.") is None


def _run(root, arm, seed, answer):
    """A run of `tiny` whose every ood_near answer is `answer(record)` and scores 1 when it
    uses the record's own operation."""
    run = root / "runs" / arm / f"seed{seed}"
    (run / "eval_samples").mkdir(parents=True)
    cfg = load_config("tiny", [f"seed={seed}"])
    (run / "resolved_config.yaml").write_text(dump_yaml(cfg))
    recs = load_eval_sets(cfg)["math/ood_near"]
    rows = []
    for r in recs:
        text = answer(r)
        rows.append(
            {
                "id": r["id"],
                "response": text,
                "score": float(M.first_operation(text) == M.first_operation(r["solution"])),
            }
        )
    (run / "eval_samples" / "base.json").write_text(json.dumps({"math/ood_near": rows}))
    RunDir(run).write_eval_matrix([("base", {"math/ood_near": sum(r["score"] for r in rows) / len(rows)})])
    return recs


def test_right_operation_and_plus_shares_by_hand(tmp_path, capsys):
    recs = _run(tmp_path, "right", 0, lambda r: r["solution"])  # the worked solution itself
    _run(tmp_path, "adds", 0, lambda r: "2 + 2 = 4")  # always adds
    plus = sum(M.first_operation(r["solution"]) == "+" for r in recs) / len(recs)
    assert 0 < plus < 1  # both operations occur in the split
    assert _cli([str(tmp_path), "--splits", "ood_near", "--csv", str(tmp_path / "t.csv")]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines[2:]}
    # right: every operation right, '+' as often as the split's own additions; adds: right only
    # on the additions, '+' always.
    assert rows["right"][4:7] == ["1.000", f"{plus:.3f}", "1.000 |"]
    assert rows["adds"][4:7] == [f"{plus:.3f}", "1.000", f"{plus:.3f} |"]
    assert (tmp_path / "t.csv").read_text().count("\n") == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--splits", "ood_nearby"], "unknown split"),
        ([], "no run directory"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, capsys, argv, message):
    assert _cli([str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_corrupt_run_is_one_error_line(tmp_path, capsys):
    _run(tmp_path, "right", 0, lambda r: r["solution"])
    (tmp_path / "runs" / "right" / "seed0" / "eval_samples" / "base.json").write_text("{not json")
    assert _cli([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "seed0" in err and err.count("\n") == 1
    (tmp_path / "runs" / "right" / "seed0" / "resolved_config.yaml").write_text("no_such_key: 1\n")
    assert _cli([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no_such_key" in err and err.count("\n") == 1


def test_the_command_line_runs_it(tmp_path):
    # `python -m megatron_sdpo results operations`, as docs/findings.md shows it.
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_sdpo", "results", "operations", str(tmp_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: no run directory") and proc.stderr.count("\n") == 1
