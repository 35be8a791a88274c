"""`data prepare` against a local copy of the hub sets (no network): the same fetch, conversion
and writing as on a cluster, the hub id replaced by a folder holding the split's files."""

import json
import os
from pathlib import Path

import pytest

from megatron_sdpo.data import hub_table
from megatron_sdpo.data.hub_table import BY_OUTPUT, TABLE, needed_sets, prepare
from megatron_sdpo.data.loaders import load_records
from megatron_sdpo.errors import DataError, UserError

datasets = pytest.importorskip("datasets", reason="`data prepare` needs the data extra: make data")
pytest.importorskip("bfcl_eval", reason="BFCL v4 comes from the bfcl-eval wheel: make data")
FIX = Path(__file__).resolve().parents[2] / "fixtures" / "data"
REF = FIX / "reference"


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _fixture(name: str) -> list[dict]:
    text = (FIX / name).read_text(encoding="utf-8")
    return (
        json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    )


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """A local copy of every set qwen3_4b reads, in the hub sets' own column layouts."""
    root = tmp_path_factory.mktemp("hub")
    dapo = _fixture("dapo_math.jsonl")
    _jsonl(root / "BytedTsinghua-SIA/DAPO-Math-17k/train.jsonl", dapo + dapo)  # the hub file repeats problems
    aime = [{"id": f"2024-{i}", "problem": f"Problem {i}: compute {i} + {i}.", "answer": str(2 * i)} for i in range(3)]
    _jsonl(root / "HuggingFaceH4/aime_2024/train.jsonl", aime)
    _jsonl(root / "HuggingFaceH4/MATH-500/test.jsonl", _fixture("math500.jsonl"))
    _jsonl(root / "Idavidrein/gpqa/gpqa_diamond/train.jsonl", _fixture("gpqa.json"))
    mm = _fixture("mmlu_redux.jsonl")
    _jsonl(root / "edinburgh-dawg/mmlu-redux-2.0/anatomy/test.jsonl", mm[:1])
    _jsonl(
        root / "edinburgh-dawg/mmlu-redux-2.0/virology/test.jsonl",
        mm[1:]
        + [
            {**mm[0], "question": "Corrected?", "error_type": "wrong_groundtruth", "correct_answer": "A"},
            {**mm[0], "question": "No answer?", "error_type": "no_correct_answer", "correct_answer": None},
        ],
    )
    _jsonl(
        root / "math-ai/aime25/test.jsonl",
        [{"id": f"2025-{i}", "problem": f"Problem {i}: compute {i} * 3.", "answer": str(3 * i)} for i in range(2)],
    )
    # The reference's committed files (rows cut from lasgroup/SDPO at the pinned commit, REF). Its
    # ToolAlpaca train.json is not in the fixtures: its test rows stand in for it.
    ref = root / "lasgroup/SDPO/datasets"
    for split in ("train", "test"):
        (ref / "sciknoweval/chemistry").mkdir(parents=True, exist_ok=True)
        (ref / f"sciknoweval/chemistry/{split}.json").write_text(
            (REF / f"sciknoweval_chemistry_{split}.json").read_text()
        )
    (ref / "tooluse").mkdir(parents=True, exist_ok=True)
    tool_rows = (REF / "tooluse_test.json").read_text().splitlines(keepends=True)
    (ref / "tooluse/train.json").write_text("".join(tool_rows[:2]))
    (ref / "tooluse/test.json").write_text("".join(tool_rows))
    lcb = [
        {**r, "contest_date": f"2025-03-0{i}T00:00:00"}
        for i, r in enumerate(_fixture("livecodebench.jsonl") + _fixture("livecodebench_pickled.jsonl"))
    ]
    lcb.append({**lcb[0], "question_id": "early", "contest_date": "2025-01-31T00:00:00"})  # before the window
    _jsonl(root / "livecodebench/code_generation_lite/test6.jsonl", lcb)
    # Seven real rows (one cannot be converted: list-typed tests) and eight more stdin rows like the fifth
    # (the Dolci set end to end, with its checks: test_dolci_set).
    dolci = _fixture("dolci/rows.json")
    dolci += [{**dolci[4], "id": f"extra{i}", "prompt": f"user: Task {i}: print {i}."} for i in range(8)]
    dolci.append({"id": "m1", "prompt": "user: What is 1+1?", "ground_truth": ["2"], "dataset": ["math"]})
    _jsonl(root / "allenai/Dolci-Think-RL-7B/train.jsonl", dolci)
    return root


@pytest.fixture(scope="module")
def prepared(hub, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "data"
    return out, prepare("qwen3_4b", out, local_root=hub)


def test_prepare_writes_every_file_the_preset_reads(prepared):
    from megatron_sdpo.config import load_config

    out, manifest = prepared
    cfg = load_config("qwen3_4b", [])
    for domain in ("math", "science", "tooluse", "code"):
        d = cfg.domains[domain]
        for src in [d.train, *d.eval.values()]:
            path = out / Path(src.source).name
            recs = load_records(path, src.schema)
            assert recs and recs.skipped == [], src.source
            assert manifest["files"][path.name]["rows"] == len(recs)
    assert manifest["table_verified"] is False and manifest["preset"] == "qwen3_4b"
    # Every set from the local copy, BFCL v4 from its wheel.
    assert all(
        f["source"].get("revision", "").startswith("local copy") or f["source"].get("package") == "bfcl-eval"
        for f in manifest["files"].values()
    )
    assert (out / "possible_answer" / "bfcl_v4_multiple.jsonl").is_file()


def test_prepare_conversions(prepared):
    out, manifest = prepared
    assert manifest["files"]["dapo-math-17k.parquet"]["rows"] == 2  # the repeats removed
    redux = load_records(out / "mmlu_redux.jsonl", "mmlu_redux")
    # `ok` rows and the corrected `wrong_groundtruth` one (answer A); `no_correct_answer` left out.
    assert sorted(r["subject"] for r in redux) == ["anatomy", "virology", "virology"]
    assert [r["answer"] for r in redux if r["prompt"].startswith("Corrected?")] == ["A"]
    assert manifest["files"]["mmlu_redux.jsonl"]["unconverted"]["items"] == [
        "virology/2: error_type no_correct_answer (left out)"
    ]
    train = load_records(out / "sciknoweval_chem_l3.jsonl", "sciknoweval")
    test = load_records(out / "sciknoweval_chem_l3_test.jsonl", "sciknoweval")
    # The reference's committed split, file for file.
    assert [r["id"] for r in train] == [
        str(json.loads(x)["idx"]) for x in (REF / "sciknoweval_chemistry_train.json").read_text().splitlines()
    ]
    assert (len(train), len(test)) == (3, 3)
    assert manifest["files"]["sciknoweval_chem_l3.jsonl"]["source"]["revision"].startswith("local copy")
    assert len(load_records(out / "toolalpaca_test.jsonl", "toolalpaca")) == 4
    assert manifest["files"]["bfcl_v4_multiple.jsonl"]["source"] == {
        "package": "bfcl-eval",
        "version": "2026.3.23",
        "path": "bfcl_eval/data/BFCL_v4_multiple.json",
    }
    assert manifest["files"]["aime25.jsonl"]["rows"] == 2 and manifest["failed"] == {}
    lcb = load_records(out / "livecodebench_v6.jsonl", "livecodebench")
    # The pickled private tests were read (no globals allowed) into JSON; the problem from before the
    # reference's window (2025-02-01) is not part of the set.
    assert len(lcb) == 3 and "early" not in {r["id"] for r in lcb}
    dolci_train = load_records(out / "dolci_think_rl_code.jsonl", "dolci_code")
    dolci_test = load_records(out / "dolci_think_rl_code_test.jsonl", "dolci_code")
    # 15 code rows of 15 distinct prompts, 2 of them (round(1.5)) to test: extra0's and the list-typed
    # row's, which is named (the math row is no code row)
    assert len(dolci_train) == 13 and [r["id"] for r in dolci_test] == ["extra0"]
    assert not {r["id"] for r in dolci_train} & {r["id"] for r in dolci_test}
    assert [x.split(":")[0] for x in manifest["files"]["dolci_think_rl_code.jsonl"]["unconverted"]["items"]] == [
        "prime_rl_code_21902"
    ]


def test_refused_rows_are_counted_and_named(hub, tmp_path):
    bad = tmp_path / "hub"
    bad_rows = _fixture("math500.jsonl") + [
        {"problem": "No answer here", "solution": "", "answer": None, "unique_id": "x/1"}
    ]
    _jsonl(bad / "HuggingFaceH4/MATH-500/test.jsonl", bad_rows)
    files = hub_table.convert_set(BY_OUTPUT["math500.jsonl"], hub_table.fetch(BY_OUTPUT["math500.jsonl"], bad)[0], {})
    assert len(files[0].rows) == 2 and files[0].unconverted == ["x/1: missing field 'answer'"]


def test_missing_columns_name_the_table(tmp_path):
    _jsonl(tmp_path / "HuggingFaceH4/MATH-500/test.jsonl", [{"question": "q", "final": "1"}])
    with pytest.raises(DataError, match="no column.*problem.*the hub table needs updating"):
        hub_table.convert_set(BY_OUTPUT["math500.jsonl"], hub_table.fetch(BY_OUTPUT["math500.jsonl"], tmp_path)[0], {})


def test_gated_and_missing_library_errors(monkeypatch):
    gpqa = BY_OUTPUT["gpqa_diamond.jsonl"]
    err = hub_table._hub_error(gpqa, RuntimeError("401 Client Error: Cannot access gated repo"))
    assert "HF_TOKEN" in str(err) and "\n" not in str(err)
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    with pytest.raises(UserError, match=r"pip install -e \.\[data\]"):
        hub_table._datasets()


def test_unsafe_pickle_is_refused():
    import base64
    import pickle
    import zlib

    blob = base64.b64encode(zlib.compress(pickle.dumps(os.path.join))).decode()  # a global reference
    out = hub_table._livecodebench([{"question_id": "q9", "private_test_cases": blob, "contest_date": "2025-03-01"}])
    rows, bad = out["livecodebench_v6.jsonl"]
    assert rows == [] and bad == [
        "q9: private tests unreadable (not a plain-data pickle (UnpicklingError: refused global posixpath.join))"
    ]


def test_needed_sets_and_table():
    sets, names = needed_sets("qwen3_4b")
    assert "gpqa_diamond.jsonl" in names and {s.name for s in sets} >= {"gpqa_diamond", "toolalpaca", "dapo_math"}
    with pytest.raises(DataError, match="every data source is synthetic"):
        needed_sets("tiny")
    assert len({s.name for s in TABLE}) == len(TABLE) and len(BY_OUTPUT) == sum(len(s.outputs) for s in TABLE)


def test_cli_and_dry_run_name_the_command(hub, tmp_path, monkeypatch, capsys):
    from megatron_sdpo.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("megatron_sdpo.models.hub.check_reachable", lambda repo: "hub")  # no network here
    assert main(["run", "qwen3_4b", "--dry-run", "--strict", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "megatron-sdpo data prepare qwen3_4b --out data" in err
    assert main(["data", "prepare", "qwen3_4b", "--out", "data", "--from", str(hub)]) == 0
    assert "manifest: data/manifest.json" in capsys.readouterr().out
    main(["run", "qwen3_4b", "--dry-run", "--strict", "--world-size", "8"])
    out, err = capsys.readouterr()
    assert "data file not found" not in err
    # Every file the stages read is listed as parsed, AIME 2025 (an extra file of math's ID eval) too.
    assert "data: domains.math.eval.id.extra_files data/aime25.jsonl (aime): ok" in out
    listed = [line for line in out.splitlines() if line.startswith("data: domains.")]
    assert len(listed) == 21 and all(": ok (" in line for line in listed)


def test_a_failed_set_is_one_line_and_the_others_are_written(hub, tmp_path, capsys):
    import shutil

    from megatron_sdpo.cli import main

    broken = tmp_path / "hub"
    shutil.copytree(hub, broken)
    shutil.rmtree(broken / "Idavidrein/gpqa")  # e.g. gated, or the network dropped midway
    out = tmp_path / "data"
    assert main(["data", "prepare", "qwen3_4b", "--out", str(out), "--from", str(broken)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: set gpqa_diamond failed: gpqa_diamond: no local copy of Idavidrein/gpqa")
    assert err[1] == f"retry with: megatron-sdpo data prepare qwen3_4b --out {out} --only gpqa_diamond"
    manifest = json.loads((out / "manifest.json").read_text())
    assert "gpqa_diamond.jsonl" not in manifest["files"] and not (out / "gpqa_diamond.jsonl").exists()
    assert {"aime24.jsonl", "toolalpaca_test.jsonl", "dolci_think_rl_code.jsonl"} <= set(manifest["files"])
    assert not list(out.glob(".*partial*"))
    # The retry writes that set alone and keeps the others' entries.
    assert main(["data", "prepare", "qwen3_4b", "--out", str(out), "--from", str(hub), "--only", "gpqa_diamond"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert "gpqa_diamond.jsonl" in manifest["files"] and "aime24.jsonl" in manifest["files"]
    assert main(["data", "prepare", "qwen3_4b", "--out", str(out), "--only", "gpqa"]) == 2
    assert "--only gpqa: not a set preset qwen3_4b reads" in capsys.readouterr().err
