"""`data prepare` of Dolci-Think-RL's code set end to end, from a local copy of the hub split
holding the seven real rows (fixtures/data/dolci) and rows made from them: repeats of a prompt,
rows of about 2 MB, a test output no sandbox run can match, a hostile pickle, no tests at all."""

import base64
import json
import os
import pickle
import tracemalloc
import zlib
from pathlib import Path

import pytest

from megatron_sdpo.data import dolci_rows, dolci_set
from megatron_sdpo.data.hub_table import prepare
from megatron_sdpo.data.loaders import load_records

pytest.importorskip("datasets", reason="`data prepare` needs the data extra: make data")
ROWS = json.loads((Path(__file__).resolve().parents[2] / "fixtures/data/dolci/rows.json").read_text())
BY_ID = {r["id"][:8]: r for r in ROWS}
TRAIN, TEST = "dolci_think_rl_code.jsonl", "dolci_think_rl_code_test.jsonl"
# A test of 50,002 bytes: 20 of them fit the 1 MiB cap, the 21st would not.
BIG_CASE = {"input": "1 " * 25_000, "output": "x"}
assert 20 * 50_002 <= dolci_rows.MAX_TESTS_BYTES < 21 * 50_002


def _big_row(i: int) -> dict:
    return {
        **BY_ID["cd8edea3"],
        "id": f"big{i}",
        "prompt": f"user: Big task {i}.",
        "ground_truth": [json.dumps([BIG_CASE] * 40)],
    }


def _stdio_row(i: int) -> dict:
    return {
        **BY_ID["cd8edea3"],
        "id": f"filler{i}",
        "prompt": f"user: Task {i}: print {i}.",
        "ground_truth": [json.dumps([{"input": "", "output": f"{i}\n", "type": "code"}])],
    }


def _write_hub(root: Path, rows: list[dict]) -> Path:
    path = root / "allenai/Dolci-Think-RL-7B/train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


def _hub_rows() -> list[dict]:
    fence = BY_ID["cd8edea3"]
    evil = base64.b64encode(zlib.compress(pickle.dumps([os.system]))).decode()
    long_output = [
        {"input": "1\n", "output": "y" * (dolci_rows.MAX_OUTPUT_CHARS + 1)},
        {"input": "2\n", "output": "2\n"},
    ]
    return [
        *ROWS,
        # The same prompt twice more: the "user: " prefix, spacing and case differ, not the key.
        {**fence, "id": "dup-a", "prompt": fence["prompt"][len("user: ") :].upper()},
        {**fence, "id": "dup-b", "prompt": "user:  " + fence["prompt"][len("user: ") :].replace(" ", "  ")},
        {**fence, "id": "evil", "prompt": "user: Evil.", "ground_truth": [evil]},
        *[_big_row(i) for i in range(3)],
        {**fence, "id": "long-output", "prompt": "user: Long output.", "ground_truth": [json.dumps(long_output)]},
        {**BY_ID["bebd647e"], "id": "no-tests", "prompt": "user: Nothing.", "ground_truth": ["[]"]},
        {
            "id": "m1",
            "prompt": "user: What is 1+1?",
            "ground_truth": ["2"],
            "dataset": ["math"],
            "original_dataset": "math-set",
            "custom_id": "m",
            "dataset_source": "x",
        },
        *[_stdio_row(i) for i in range(10)],
    ]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    hub = _write_hub(tmp_path_factory.mktemp("hub"), _hub_rows())
    out = tmp_path_factory.mktemp("prepared") / "data"
    return out, prepare("qwen3_4b", out, local_root=hub, only=["dolci_code"])


def test_manifest_counts_and_refusals(prepared):
    out, manifest = prepared
    assert manifest["failed"] == {}
    entry = manifest["files"][TRAIN]
    checks = entry["checks"]
    # 7 real rows, 2 repeats, the hostile one, 3 big, 1 long output, 1 without tests, 10 fillers,
    # and one math row: 26 rows, 25 of them code rows (5 `code`, 20 `code_stdio`).
    assert (checks["rows"], checks["code_rows"]) == (26, 25)
    assert checks["by_dataset"] == {"code_stdio": 20, "code": 5, "math": 1}
    assert checks["by_original_dataset"]["hamishivi/llama-nemotron-rlvr-difficulty-6_filtered"] == 2
    assert checks["by_original_dataset"]["hamishivi/synthetic2-rlvr-code-compressed_filtered"] == 2
    # Every code row's tests but the hostile pickle's could be read: 2 SYNTHETIC-2 pickles.
    assert checks["encodings"] == {"json": 22, "base64-zlib-pickle": 2}
    assert checks["refused"] == {"list-typed test cases": 1, "the ground truth is unreadable": 1, "no test cases": 1}
    assert entry["unconverted"]["count"] == 3
    assert sorted(x.split(":")[0] for x in entry["unconverted"]["items"]) == ["evil", "no-tests", "prime_rl_code_21902"]
    assert (
        checks["capped"]["rows_over_the_byte_cap"] == 3
        and checks["capped"]["rows_with_outputs_over_the_sandbox_cap"] == 1
    )
    assert checks["split"] == {"distinct_prompts": 23, "test_prompts": 2, "duplicate_rows": 2}
    assert checks["revision"].startswith("local copy (files sha256 ")
    # A local copy is not the hub: its counts depart from the expected ones, and nothing is verified.
    assert checks["warnings"] == [
        "code rows: 5, expected 12,113",
        "code_stdio rows: 20, expected 9,272",
        "code rows in all: 25, expected 21,385",
    ]
    assert checks["verified"] is False
    assert manifest["files"][TEST]["unconverted"]["count"] == 0 and "checks" not in manifest["files"][TEST]


def test_written_rows(prepared):
    out, manifest = prepared
    train, test = load_records(out / TRAIN, "dolci_code"), load_records(out / TEST, "dolci_code")
    assert len(train) + len(test) == 22 == manifest["files"][TRAIN]["rows"] + manifest["files"][TEST]["rows"]
    by_id = {r["id"]: r for r in [*train, *test]}
    # Repeats of one prompt stand on one side.
    sides = {rid: rid in {r["id"] for r in test} for rid in ("cd8edea3ded8ed3beda996bc0c94ad86", "dup-a", "dup-b")}
    assert len(set(sides.values())) == 1
    assert all(len(by_id[f"big{i}"]["tests"]) == 20 for i in range(3))  # of 40: the byte cap
    assert by_id["long-output"]["tests"] == [{"input": "2\n", "output": "2\n"}]
    assert len(by_id["8266ecad-2cea-44d5-9434-0f8761fbb148"]["tests"]) == 15  # the try/except script kept
    assert {r["hub_revision"] for r in by_id.values()} == {manifest["files"][TRAIN]["checks"]["revision"]}
    assert by_id["prime_rl_code_18280"]["original_dataset"] == "hamishivi/synthetic2-rlvr-code-compressed_filtered"
    raw = [json.loads(line) for line in (out / TRAIN).read_text().splitlines()]
    assert all(sorted(r) == sorted([*dolci_set.KEPT, "hub_revision"]) for r in raw)  # no rollouts, no token ids


def test_the_cli_prints_the_checks(prepared, tmp_path, capsys):
    from megatron_sdpo.cli import main

    hub = _write_hub(tmp_path / "hub", _hub_rows())
    assert (
        main(
            ["data", "prepare", "qwen3_4b", "--out", str(tmp_path / "data"), "--from", str(hub), "--only", "dolci_code"]
        )
        == 0
    )
    printed = capsys.readouterr().out.splitlines()
    assert f"{TRAIN}: {prepared[1]['files'][TRAIN]['rows']} rows (dolci_code), 3 not convertible" in printed
    assert "  refused: list-typed test cases 1, the ground truth is unreadable 1, no test cases 1" in printed
    assert f"warning: {TRAIN}: code rows in all: 25, expected 21,385" in printed


def test_rows_are_streamed_not_held(tmp_path):
    # 16 rows of 2 MB (40 tests each): 32 MB if the set were held; one row at a time, the peak
    # of Python's own allocations stays near a few rows' worth (the split on disk is Arrow's).
    # As on the hub, the split is parquet (a JSON lines copy is parsed into Arrow by Python
    # code of `datasets` first, which is not this project's reading).
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub = tmp_path / "hub"
    (hub / "allenai/Dolci-Think-RL-7B").mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist([_big_row(i) for i in range(16)]),
        hub / "allenai/Dolci-Think-RL-7B/train-00000-of-00001.parquet",
    )
    prepare("qwen3_4b", tmp_path / "warm", local_root=hub, only=["dolci_code"])  # imports done before tracing
    tracemalloc.start()
    try:
        manifest = prepare("qwen3_4b", tmp_path / "data", local_root=hub, only=["dolci_code"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert manifest["files"][TRAIN]["checks"]["capped"]["rows_over_the_byte_cap"] == 16
    # A row passes through a few copies at once (its text, the decoded tests, the capped JSON,
    # the loader's check, the line written): about 3.5 rows measured. Holding the set would be
    # 16 rows and more; the bound allows 6.
    row = 40 * 50_002
    assert peak < 6 * row, f"peak {peak / 2**20:.1f} MiB of Python allocations, a row is {row / 2**20:.1f} MiB"


def test_a_set_with_nothing_to_write_fails_in_one_line_and_leaves_no_partial_file(tmp_path):
    hub = _write_hub(tmp_path / "hub", [ROWS[-1]])  # prime_rl_code_21902, the list-typed row, alone
    manifest = prepare("qwen3_4b", tmp_path / "data", local_root=hub, only=["dolci_code"])
    assert manifest["failed"] == {"dolci_code": f"{TRAIN}: no rows converted (1 unconvertible)"}
    assert list((tmp_path / "data").glob(".*partial*")) == [] and not (tmp_path / "data" / TRAIN).exists()
