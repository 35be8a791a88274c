"""validate_record: accepts each domain's record format, names `where` on every error."""
import pytest

from megatron_sdpo.data.records import DOMAINS, required_keys, tool_calls, validate_record
from megatron_sdpo.errors import DataError

BASE = {"id": "1", "split": "train", "prompt": "q", "source": "s"}
GOOD = {
    "math": {"answer": "3"},
    "science": {"choices": ["a", "b", "c"], "answer": "C"},
    "tooluse": {"tools": [{"name": "f", "description": "", "parameters": {}}],
                "answer": '[{"Action": "f", "Action_Input": {"x": 1}}]'},
    "code": {"tests": [{"input": "1", "output": "2", "testtype": "functional"}], "fn_name": "f"},
}


@pytest.mark.parametrize("domain", DOMAINS)
def test_good_records_pass(domain):
    rec = {**BASE, "domain": domain, **GOOD[domain]}
    assert validate_record(rec, "x") is rec
    assert set(required_keys(domain)) <= set(rec)


@pytest.mark.parametrize(
    "domain,patch,msg",
    [
        ("math", {"answer": 3}, "field 'answer' must be a string"),
        ("science", {"answer": "D"}, "must be a letter A..C"),
        ("science", {"choices": ["only"]}, "list of 2..26 strings"),
        ("tooluse", {"answer": "[{"}, "not valid JSON"),
        ("tooluse", {"answer": [{"Action": "f", "Action_Input": "x"}]}, "must be a JSON object"),
        ("code", {"tests": [{"input": "1"}]}, "needs|must be a dict with 'input' and 'output'"),
        ("code", {"fn_name": None}, "functional tests need"),
        ("math", {"prompt": "  "}, "'prompt' is empty"),
    ],
)
def test_bad_records_name_where(domain, patch, msg):
    rec = {**BASE, "domain": domain, **GOOD[domain], **patch}
    with pytest.raises(DataError, match=rf"^f.jsonl:7: .*({msg})"):
        validate_record(rec, "f.jsonl:7")


def test_missing_keys_and_domain():
    with pytest.raises(DataError, match=r"w: missing field\(s\) 'answer'"):
        validate_record({**BASE, "domain": "math"}, "w")
    with pytest.raises(DataError, match="field 'domain' must be one of"):
        validate_record({**BASE, "domain": "poetry"}, "w")
    with pytest.raises(DataError, match="must be a JSON object"):
        validate_record([1], "w")
    assert tool_calls({**BASE, "domain": "tooluse", **GOOD["tooluse"]})[0]["Action"] == "f"
