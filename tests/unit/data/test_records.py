"""validate_record: accepts each domain's record format, names `where` on every error."""

import pytest

from megatron_sdpo.data.records import required_keys, tool_calls, validate_record
from megatron_sdpo.errors import DataError
from megatron_sdpo.interfaces.domains import DOMAINS

BASE = {"id": "1", "split": "train", "prompt": "q", "source": "s"}
GOOD = {
    "math": {"answer": "3"},
    "science": {"choices": ["a", "b", "c"], "answer": "C"},
    "tooluse": {
        "tools": [{"name": "f", "description": "", "parameters": {}}],
        "answer": '[{"Action": "f", "Action_Input": {"x": 1}}]',
    },
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
        ("math", {"history": [{"role": "user", "content": "q"}]}, "list of user / assistant turn pairs"),
        (
            "math",
            {"history": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
            r"history\[0\] must be \{'role': 'user'",
        ),
        (
            "math",
            {"history": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]},
            r"history\[1\] must be \{'role': 'assistant'",
        ),
    ],
)
def test_bad_records_name_where(domain, patch, msg):
    rec = {**BASE, "domain": domain, **GOOD[domain], **patch}
    with pytest.raises(DataError, match=rf"^f.jsonl:7: .*({msg})"):
        validate_record(rec, "f.jsonl:7")


def test_history_of_turn_pairs_passes():
    turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "\\boxed{4}"}]
    rec = {**BASE, "domain": "math", **GOOD["math"], "history": turns}
    assert validate_record(rec, "x")["history"] == turns


def test_missing_keys_and_domain():
    with pytest.raises(DataError, match=r"w: missing field\(s\) 'answer'"):
        validate_record({**BASE, "domain": "math"}, "w")
    with pytest.raises(DataError, match="field 'domain' must be one of"):
        validate_record({**BASE, "domain": "poetry"}, "w")
    with pytest.raises(DataError, match="must be a JSON object"):
        validate_record([1], "w")
    assert tool_calls({**BASE, "domain": "tooluse", **GOOD["tooluse"]})[0]["Action"] == "f"
