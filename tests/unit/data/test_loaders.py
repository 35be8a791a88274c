"""Loaders for the public schemas: each fixture maps to valid records; bad input -> one-line DataError."""

import json
from pathlib import Path

import pytest

from megatron_sdpo.data.loaders import RowError, decode_lcb_tests, load_records
from megatron_sdpo.data.records import validate_record
from megatron_sdpo.errors import DataError

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "data"

CASES = [
    ("dapo_math.jsonl", "dapo_math", "math", 2),
    ("dapo_math.parquet", "dapo_math", "math", 2),
    ("math500.jsonl", "math500", "math", 2),
    ("aime.jsonl", "aime", "math", 3),
    ("sciknoweval.jsonl", "sciknoweval", "science", 2),
    ("gpqa.json", "gpqa", "science", 2),
    ("mmlu_redux.jsonl", "mmlu_redux", "science", 2),
    ("toolalpaca.jsonl", "toolalpaca", "tooluse", 2),
    ("bfcl/BFCL_v4_multiple.json", "bfcl_multiple", "tooluse", 2),
    ("livecodebench.jsonl", "livecodebench", "code", 2),
    ("dolci_code.jsonl", "dolci_code", "code", 2),
    ("records.jsonl", "records", None, 2),
]


@pytest.mark.parametrize("name,schema,domain,count", CASES)
def test_fixture_loads_to_valid_records(name, schema, domain, count):
    recs = load_records(FIX / name, schema)
    assert len(recs) == count and recs.skipped == []
    for r in recs:
        validate_record(r, name)
        if domain is not None:
            assert r["domain"] == domain
    assert len({r["id"] for r in recs}) == count


def test_math_prompts_carry_boxed_instruction_and_answers():
    dapo = load_records(FIX / "dapo_math.jsonl", "dapo_math")
    assert dapo[0]["prompt"].startswith("What is $2+3$?")  # the "Answer:" wrapper is replaced
    assert "Answer:" not in dapo[0]["prompt"] and "\\boxed{}" in dapo[0]["prompt"]
    assert [r["answer"] for r in dapo] == ["5", "5"] and dapo[0]["source"] == "math_dapo"
    assert load_records(FIX / "dapo_math.parquet", "dapo_math") == dapo
    aime = load_records(FIX / "aime.jsonl", "aime")
    assert [r["answer"] for r in aime] == ["24", "8", "45"] and aime[0]["id"] == "2024-I-1"
    m5 = load_records(FIX / "math500.jsonl", "math500", split="ood_far")
    assert m5[0]["answer"] == "\\frac{5}{6}" and m5[0]["split"] == "ood_far"


def test_mcq_answers_map_to_letters():
    sk = load_records(FIX / "sciknoweval.jsonl", "sciknoweval")
    assert sk[0]["answer"] == "B" and "B) Carbon" in sk[0]["prompt"]
    assert sk[1]["answer"] == "A" and sk[1]["choices"] == ["7", "1", "14"]  # numeric labels
    mm = load_records(FIX / "mmlu_redux.jsonl", "mmlu_redux")
    assert [r["answer"] for r in mm] == ["B", "C"] and "<answer>" in mm[0]["prompt"]


def test_gpqa_shuffle_is_deterministic_and_seeded():
    a = load_records(FIX / "gpqa.json", "gpqa", seed=0)
    b = load_records(FIX / "gpqa.json", "gpqa", seed=0)
    assert a == b
    for r in a:
        correct = {"rec1": "Photon", "rec2": "-1 e"}[r["id"]]
        assert r["choices"][ord(r["answer"]) - 65] == correct and len(r["choices"]) == 4
    orders = {tuple(load_records(FIX / "gpqa.json", "gpqa", seed=s)[0]["choices"]) for s in range(8)}
    assert len(orders) > 1  # seeds shuffle differently
    # the order of one item does not depend on `limit`
    assert (
        load_records(FIX / "gpqa.json", "gpqa", seed=3, limit=1)[0]
        == load_records(FIX / "gpqa.json", "gpqa", seed=3)[0]
    )


def test_tooluse_answers_and_bfcl_allowed_values():
    ta = load_records(FIX / "toolalpaca.jsonl", "toolalpaca")
    assert ta[1]["answer"] == [{"Action": "getNews", "Action_Input": {"topic": "sports"}}]
    assert "getWeather" in ta[0]["prompt"] and "Action Input:" in ta[0]["prompt"]
    bf = load_records(FIX / "bfcl" / "BFCL_v4_multiple.json", "bfcl_multiple")
    assert bf[0]["answer"] == [
        {"Action": "geometry.area_triangle", "Action_Input": {"base": 10, "height": 5, "unit": "units"}}
    ]
    assert bf[0]["allowed"][0]["Action_Input"]["unit"] == ["units", ""]
    assert bf[1]["prompt"].count("geometry.area_circle") == 1
    # the verifier reads the loader's `allowed` as written: a right call scores 1, an optional
    # argument may be left out, a wrong value scores 0 (before this, every BFCL response raised)
    from megatron_sdpo.rewards import score

    def reply(args):
        return "Action: geometry.area_triangle\nAction Input: " + json.dumps(args)

    assert score("tooluse", reply({"base": 10, "height": 5}), bf[0]).score == 1.0
    assert score("tooluse", reply({"base": 10, "height": 5, "unit": "units"}), bf[0]).score == 1.0
    wrong = score("tooluse", reply({"base": 10, "height": 6}), bf[0])
    assert wrong.score == 0.0 and "Wrong value for argument 'height'" in wrong.feedback


def test_bfcl_missing_answer_file(tmp_path):
    q = tmp_path / "BFCL_v4_multiple.json"
    q.write_text((FIX / "bfcl" / "BFCL_v4_multiple.json").read_text())
    with pytest.raises(DataError, match="possible_answer file not found"):
        load_records(q, "bfcl_multiple")
    ans = tmp_path / "answers.json"
    ans.write_text(
        json.dumps({"id": "multiple_0", "ground_truth": [{"geometry.area_triangle": {"base": [10], "height": [5]}}]})
        + "\n"
    )
    with pytest.raises(DataError, match=r"BFCL_v4_multiple.json:2: id 'multiple_1' has no entry"):
        load_records(q, "bfcl_multiple", answers_path=ans)


def test_livecodebench_tests_decoded_and_functional():
    lcb = load_records(FIX / "livecodebench.jsonl", "livecodebench")
    assert lcb[0]["tests"] == [{"input": "3\n", "output": "9\n"}, {"input": "5\n", "output": "25\n"}]
    assert "fn_name" not in lcb[0] and "standard input" in lcb[0]["prompt"]
    assert lcb[1]["fn_name"] == "add" and all(t["testtype"] == "functional" for t in lcb[1]["tests"])
    assert "class Solution" in lcb[1]["prompt"]


def test_livecodebench_refuses_pickle():
    with pytest.raises(DataError, match=r"livecodebench_pickled.jsonl:1: .*pickled data, which is refused"):
        load_records(FIX / "livecodebench_pickled.jsonl", "livecodebench")
    with pytest.raises(RowError, match="neither JSON nor base64"):
        decode_lcb_tests("definitely not base64 !!", "private_test_cases")


def test_dolci_code_forms():
    d = load_records(FIX / "dolci_code.jsonl", "dolci_code")
    assert d[0]["tests"] == [{"input": "1 2\n", "output": "3\n"}] and "standard input" in d[0]["prompt"]
    assert d[1]["tests"][1] == {"input": "xy\n", "output": "yx\n"}
    assert d[1]["prompt"].startswith("Read a word")


def test_malformed_file_names_file_and_line():
    with pytest.raises(DataError, match=r"malformed.jsonl:2: invalid JSON") as exc:
        load_records(FIX / "malformed.jsonl", "math500")
    assert "\n" not in str(exc.value)


def test_skip_counts_bad_rows():
    with pytest.warns(UserWarning, match="skipped 2 malformed"):
        recs = load_records(FIX / "malformed.jsonl", "math500", on_error="skip")
    assert [r["answer"] for r in recs] == ["2", "6"]
    assert len(recs.skipped) == 2 and "malformed.jsonl:3: missing field 'answer'" in recs.skipped[1]


def test_bad_arguments(tmp_path):
    with pytest.raises(DataError, match="unknown data schema 'nope'"):
        load_records(FIX / "math500.jsonl", "nope")
    with pytest.raises(DataError, match="data file not found"):
        load_records(tmp_path / "absent.jsonl", "math500")
    with pytest.raises(DataError, match="yields 'math' records, not 'code'"):
        load_records(FIX / "math500.jsonl", "math500", domain="code")
    with pytest.raises(DataError, match="on_error"):
        load_records(FIX / "math500.jsonl", "math500", on_error="ignore")
    bad = tmp_path / "bad.json"
    bad.write_text('[{"problem": 1,\n')
    with pytest.raises(DataError, match=r"bad.json:\d+: invalid JSON"):
        load_records(bad, "math500")


def test_records_schema_filters_domain_and_validates(tmp_path):
    assert [r["id"] for r in load_records(FIX / "records.jsonl", "records", domain="science")] == ["r2"]
    assert len(load_records(FIX / "records.jsonl", "records", limit=1)) == 1
    bad = tmp_path / "r.jsonl"
    bad.write_text(
        json.dumps(
            {
                "id": "x",
                "domain": "science",
                "split": "t",
                "prompt": "p",
                "source": "s",
                "choices": ["a", "b"],
                "answer": "C",
            }
        )
        + "\n"
    )
    with pytest.raises(DataError, match=r"r.jsonl:1: field 'answer' must be a letter A..B"):
        load_records(bad, "records")


def test_jsonl_lines_break_only_at_newline(tmp_path):
    # JSON allows U+2028, U+2029 and U+0085 unescaped inside strings; str.splitlines() would
    # cut such a row in two (two real MMLU rows hold them). \r\n line ends still work.
    texts = ["line\u2028separator", "next\u0085line", "para\u2029graph"]
    rows = [{"question": t, "choices": ["a", "b"], "answer": 0} for t in texts]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    path = tmp_path / "mmlu.jsonl"
    path.write_bytes(("\n".join(lines[:2]) + "\r\n" + lines[2] + "\n").encode("utf-8"))
    assert "\u2028" in path.read_text(encoding="utf-8")  # stored raw, not escaped
    recs = load_records(path, "mmlu_redux")
    assert [r["prompt"].split("\n\n")[0] for r in recs] == texts and recs.skipped == []
