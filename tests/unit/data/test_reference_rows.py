"""The paper's reference rows (tests/fixtures/data/reference, cut from lasgroup/SDPO's committed
files): each converts with the project's loader, and the project's verifier scores a correct
answer 1 and a wrong one 0, so the record format, the answer field and the tools are proven end
to end on the rows a cluster run reads."""

import json
from pathlib import Path

import pytest

from megatron_sdpo.data import reference_rows
from megatron_sdpo.data.loaders import load_records
from megatron_sdpo.errors import DataError
from megatron_sdpo.rewards import score

REF = Path(__file__).resolve().parents[2] / "fixtures" / "data" / "reference"


def _react(calls: list[dict]) -> str:
    return "\n".join(
        f"Thought: call it\nAction: {c['Action']}\nAction Input: {json.dumps(c['Action_Input'])}" for c in calls
    )


def test_toolalpaca_reference_rows_convert_and_score():
    raw = [json.loads(x) for x in (REF / "tooluse_test.json").read_text().splitlines()]
    recs = load_records(REF / "tooluse_test.json", "toolalpaca")
    assert [r["id"] for r in recs] == ["4046", "4051", "4052", "4079"]
    # The prompt is the reference's, as the paper trains on it; the tools come from its docs.
    assert [r["prompt"] for r in recs] == [r["prompt"] for r in raw]
    assert [t["name"] for t in recs[0]["tools"]] == ["getRandomAxolotlImage", "searchAxolotlImages", "getAxolotlFacts"]
    assert recs[0]["tools"][1]["parameters"]["color"].startswith("string. One of: [wild, leucistic, albino]")
    assert len(recs[3]["answer"]) == 2  # two calls, the second marked "[Optional]" by the reference
    for rec, row in zip(recs, raw, strict=True):
        gold = [
            {"Action": c["Action"], "Action_Input": json.loads(c["Action_Input"])} for c in json.loads(row["answer"])
        ]
        assert score("tooluse", _react(gold), rec).score == 1.0, rec["id"]
        wrong = [{**gold[0], "Action_Input": {**gold[0]["Action_Input"], "zzz": 1}}, *gold[1:]]
        assert score("tooluse", _react(wrong), rec).score == 0.0, rec["id"]


@pytest.mark.parametrize("split", ["train", "test"])
def test_sciknoweval_reference_rows_convert_and_score(split):
    path = REF / f"sciknoweval_chemistry_{split}.json"
    raw = [json.loads(x) for x in path.read_text().splitlines()]
    recs = load_records(path, "sciknoweval")
    assert [r["id"] for r in recs] == [str(r["idx"]) for r in raw]
    for rec, row in zip(recs, raw, strict=True):
        question, choices = reference_rows.mcq_from_prompt(row["prompt"])
        assert rec["choices"] == choices and len(choices) == 4 and rec["answer"] == row["answer"]
        assert rec["prompt"].startswith(question)
        # The reference's own answer format (<answer> tags, its system prompt) scores.
        assert score("science", f"<reasoning>...</reasoning>\n<answer>\n{row['answer']}\n</answer>", rec).score == 1.0
        other = "B" if row["answer"] == "A" else "A"
        assert score("science", f"<answer>{other}</answer>", rec).score == 0.0


def test_a_reference_row_without_its_layout_is_a_row_error(tmp_path):
    row = json.loads((REF / "tooluse_test.json").read_text().splitlines()[0])
    bad = tmp_path / "t.jsonl"
    bad.write_text(json.dumps({**row, "prompt": "no documentation here"}) + "\n")
    with pytest.raises(DataError, match=r"t.jsonl:1: .*no 'Documentation:' block"):
        load_records(bad, "toolalpaca")
    sci = json.loads((REF / "sciknoweval_chemistry_test.json").read_text().splitlines()[0])
    bad.write_text(json.dumps({**sci, "prompt": "Which one?\n\nA: x\nC: y"}) + "\n")
    with pytest.raises(DataError, match="choice 2 is not labelled 'B'"):
        load_records(bad, "sciknoweval")
