"""results/<study>: a study's runs exported to what its metrics read, and every table generated
from the export alone, one per baseline in one pass, the same bytes each time."""

import csv
import gzip
import json

import pytest

from megatron_sdpo.errors import UserError
from megatron_sdpo.study import results
from megatron_sdpo.study.findings import compare_arms, load_runs

CASE = [1, 2, 3, 0, 2, 4]  # SDPO - GRPO in items of 10 per seed (test_study_findings.py)
DRIFT = {
    "param_vs_base": {
        "summary": {"mean_spectral_shift": 0.01, "mean_angle_max_deg": 3.0},
        "per_matrix": [list(range(50))] * 20,
    },
    "response_cosine_mean": 0.9,
    "excess_kl_mean_k3": 0.1,
    "big": "x" * 10_000,
}


def _items(correct, n=10):
    return [1] * correct + [0] * (n - correct)


@pytest.fixture
def study(tmp_path, make_run):
    root = tmp_path / "study"
    for seed, extra in enumerate(CASE):
        for arm, correct in (("grpo", 3), ("sdpo_frozen", 3 + extra)):
            run = make_run(
                root / "runs" / arm / f"seed{seed}",
                {
                    "base": {"math/id": _items(2)},
                    "math": {"math/id": _items(correct)},
                    "tooluse": {"math/id": _items(correct), "tooluse/id": _items(4)},
                },
                [(0, "math", [0.1 * correct]), (1, "tooluse", [0.3])],
                drift=DRIFT,
            )
            (run / "metrics.jsonl").open("a").write(json.dumps({"stage": 1, "step": 2, "unread": "y" * 5000}) + "\n")
    (root / "runs" / "grpo" / "seed9").mkdir()  # an unfinished run: not exported
    (root / "timings.jsonl").write_text(json.dumps({"run": "grpo/seed0", "seconds": 12.0}) + "\n")
    return root


def test_export_keeps_what_the_metrics_read_and_tabulate_regenerates_them(study, tmp_path):
    dest = results.export(study, tmp_path / "results" / "s", command="megatron-sdpo study x --seeds 0-5")
    meta = json.loads((dest / "study.json").read_text())
    assert meta["arms"] == ["grpo", "sdpo_frozen"] and meta["seeds"] == list(range(6)) and meta["wall_s_total"] == 12
    assert not (dest / "runs" / "grpo" / "seed9").exists()
    run = dest / "runs" / "sdpo_frozen" / "seed2"
    with gzip.open(run / "eval_samples" / "stage_1_math.json.gz", "rt") as f:
        samples = json.load(f)
    assert samples["math/id"][0] == {"id": "math/id-0", "score": 1}  # no answer text
    assert (
        "big" not in (run / "drift" / "stage_2.json").read_text()
        and "unread" not in (run / "metrics.jsonl").read_text()
    )
    assert sum(f.stat().st_size for f in run.rglob("*") if f.is_file()) < 8_000  # kilobytes a run
    again = results.export(study, tmp_path / "again", command="megatron-sdpo study x --seeds 0-5")
    packed = sorted(p.relative_to(dest) for p in dest.rglob("*.gz"))
    assert packed and all((dest / p).read_bytes() == (again / p).read_bytes() for p in packed)  # the same bytes

    # Every metric from the export equals the study's own.
    original = {
        (r.arm, r.seed): r.values
        for r in load_runs(
            [(a, s, study / "runs" / a / f"seed{s}") for a in ("grpo", "sdpo_frozen") for s in range(6)], {}
        )
    }
    exported = {(r.arm, r.seed): r.values for r in load_runs(results._study_runs(dest), {})}
    assert exported == original

    first = results.tabulate(dest, ["grpo", "sdpo_frozen"], n_boot=200)
    assert [p.name for p in first] == ["study_vs_grpo.md", "study_vs_sdpo_frozen.md"]
    texts = [p.read_text() for p in first]
    assert results.tabulate(dest, ["grpo", "sdpo_frozen"], n_boot=200) == first
    assert [p.read_text() for p in first] == texts  # the same bytes again: a test can hold docs to them
    line = next(x for x in texts[0].splitlines() if x.startswith("| `in_stage_gain/math` |"))
    assert "[0.052, 0.348] (95%)" in line and "*established*" in line
    verdicts = {
        x.rsplit("|", 2)[-2].strip() for x in texts[1].splitlines() if x.startswith("| `") and x.count("|") > 10
    }
    assert verdicts == {"*descriptive*"}  # no paper direction against SDPO
    rows = list(csv.DictReader((dest / "study.csv").open()))
    assert rows[0]["run_dir"] == "runs/grpo/seed0" and len(rows) == 12
    comps = compare_arms(load_runs(results._study_runs(dest), {}), "grpo", ["grpo", "sdpo_frozen"], n_boot=0)
    assert {c.metric.name for c in comps if c.verdict == "established"} >= {"in_stage_gain/math"}


def test_errors_are_one_line(study, tmp_path):
    with pytest.raises(UserError, match="no finished run"):
        results.export(tmp_path, tmp_path / "r", command="")
    dest = results.export(study, tmp_path / "r", command="")
    with pytest.raises(UserError, match="already holds an exported study"):
        results.export(study, dest, command="")
    with pytest.raises(UserError, match="--baseline ppo: the study's arms are grpo, sdpo_frozen"):
        results.tabulate(dest, ["ppo"])
    with pytest.raises(UserError, match="no study.json"):
        results.tabulate(tmp_path, ["grpo"])


def test_cli(study, tmp_path, capsys):
    from megatron_sdpo.cli import main

    assert main(["results", "export", str(study), "--to", str(tmp_path / "r"), "--command", "study x"]) == 0
    assert main(["results", "tabulate", str(tmp_path / "r"), "--baseline", "grpo", "--bootstrap", "50"]) == 0
    assert (tmp_path / "r" / "study_vs_grpo.md").is_file() and "wrote" in capsys.readouterr().out


def test_a_study_exported_in_parts_equals_it_exported_at_once(study, tmp_path):
    import shutil

    # Two sessions: seeds 0-2 in one study directory, 3-5 in another (each with its timings).
    first, second = tmp_path / "first", tmp_path / "second"
    for part, seeds in ((first, range(3)), (second, range(3, 6))):
        for arm in ("grpo", "sdpo_frozen"):
            for s in seeds:
                shutil.copytree(study / "runs" / arm / f"seed{s}", part / "runs" / arm / f"seed{s}")
        part.mkdir(exist_ok=True)
        (part / "timings.jsonl").write_text(
            "".join(
                json.dumps({"run": f"{a}/seed{s}", "seconds": 10.0 + s}) + "\n"
                for a in ("grpo", "sdpo_frozen")
                for s in seeds
            )
        )
    whole = results.export(study, tmp_path / "whole", command="x")
    dest = results.export(first, tmp_path / "parts", command="study --seeds 0-2", commit="aaa")
    with pytest.raises(UserError, match="no exported study to add to"):
        results.export(second, tmp_path / "nothing", command="", add=True)
    results.export(second, dest, command="study --seeds 3-5", commit="bbb", add=True, note="second session")
    meta = json.loads((dest / "study.json").read_text())
    assert meta["seeds"] == list(range(6)) and meta["commit"] == "aaa"
    assert [(p["commit"], len(p["runs"]), p["wall_s_total"]) for p in meta["parts"]] == [("aaa", 6, 66), ("bbb", 6, 84)]
    assert meta["wall_s_total"] == 150 and meta["parts"][1]["note"] == "second session"
    values = lambda root: {(r.arm, r.seed): r.values for r in load_runs(results._study_runs(root), {})}
    assert values(dest) == values(whole)
    rows = list(csv.DictReader((dest / "study.csv").open()))
    assert len(rows) == 12 and {r["run_dir"] for r in rows} == {
        f"runs/{a}/seed{s}" for a in ("grpo", "sdpo_frozen") for s in range(6)
    }
    gain = lambda root: [
        x
        for x in results.tabulate(root, ["grpo"], n_boot=0)[0].read_text().splitlines()
        if x.startswith("| `in_stage_gain/math` |")
    ]
    assert gain(dest) == gain(whole) and gain(dest)
    with pytest.raises(UserError, match="grpo/seed3, grpo/seed4, .* already exported"):
        results.export(second, dest, command="", add=True)
    # A run of another base (another model, other items) is not the same study.
    other = tmp_path / "other" / "runs" / "grpo" / "seed9"
    shutil.copytree(study / "runs" / "grpo" / "seed0", other)
    text = (other / "eval_matrix.csv").read_text().splitlines()
    (other / "eval_matrix.csv").write_text("\n".join([text[0], text[1].replace("0.2", "0.25"), *text[2:]]) + "\n")
    with pytest.raises(UserError, match="its base row differs"):
        results.export(tmp_path / "other", dest, command="", add=True)
