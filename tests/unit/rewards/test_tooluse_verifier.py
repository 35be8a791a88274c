import json

import pytest

from megatron_sdpo.errors import DataError
from megatron_sdpo.rewards import score
from megatron_sdpo.rewards.tooluse import parse_actions

TOOLS = [
    {"name": "get_weather", "description": "", "parameters": {}},
    {"name": "get_time", "description": "", "parameters": {}},
]
REC = {
    "id": "t",
    "domain": "tooluse",
    "tools": TOOLS,
    "answer": [{"Action": "get_weather", "Action_Input": {"city": "Paris", "days": 3}}],
}


def call(name, args, raw=None):
    return f"Action: {name}\nAction Input: {raw if raw is not None else json.dumps(args)}\n"


def test_parse_actions_robust_to_fences_and_trailing_text():
    text = (
        "Thought: need weather\nAction: get_weather\nAction Input: ```json\n"
        '{"city": "Paris", "days": 3}\n```\nObservation: sunny\nThought: also time\n'
        'Action: `get_time`\nAction Input: {"tz": "CET"} and then some prose'
    )
    calls, errors = parse_actions(text)
    assert errors == []
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})]


@pytest.mark.parametrize(
    "response,want",
    [
        (call("get_weather", {"city": "Paris", "days": 3}), 1.0),
        (call("get_weather", {"days": 3.0, "city": " Paris "}), 1.0),
        (call("get_weather", {"city": "Paris"}) + call("get_weather", {"days": 3}), 0.0),
        (call("get_weather", {"city": "London", "days": 3}), 0.0),
    ],
)
def test_right_and_wrong(response, want):
    assert score("tooluse", response, REC).score == want


def test_merged_arguments_across_calls():
    rec = {
        **REC,
        "answer": json.dumps(
            [
                {"Action": "get_weather", "Action_Input": {"city": "Paris"}},
                {"Action": "get_time", "Action_Input": '{"tz": "CET"}'},
            ]
        ),
    }
    good = call("get_time", {"tz": "CET"}) + call("get_weather", {"city": "Paris"})
    assert score("tooluse", good, rec).score == 1.0
    swapped = call("get_time", {"city": "Paris"}) + call("get_weather", {"tz": "CET"})
    assert score("tooluse", swapped, rec).score == 1.0  # merged arguments, by the method's rule


@pytest.mark.parametrize(
    "response,fragment",
    [
        ("I would call the weather tool.", "No tool call found"),
        (call("get_weather", None, raw="{city: Paris}"), "not valid JSON"),
        (call("get_weather", None, raw="[1, 2]"), "not a JSON object"),
        ("Action: get_weather\nThought: hmm", "no `Action Input:`"),
        (call("delete_everything", {}), "Unknown tool 'delete_everything'"),
        (call("get_time", {"city": "Paris", "days": 3}), "Wrong tool calls"),
        (call("get_weather", {"city": "Paris"}), "Missing argument 'days'"),
        (call("get_weather", {"city": "Rome", "days": 3}), "Wrong value for argument 'city'"),
        (call("get_weather", {"city": "Paris", "days": 3, "units": "C"}), "Unexpected argument 'units'"),
    ],
)
def test_feedback_names_the_problem(response, fragment):
    result = score("tooluse", response, REC)
    assert result.score == 0.0
    assert fragment in result.feedback, result.feedback
    assert "Paris" not in result.feedback or "Paris" in response


def test_wrong_calls_feedback_does_not_name_the_gold_tools():
    fb = score("tooluse", call("get_time", {"city": "Paris", "days": 3}), REC).feedback
    assert "get_time" in fb and "get_weather" not in fb, fb  # its own wrong call, not the gold one
    rec = {
        **REC,
        "answer": json.dumps(
            [
                {"Action": "get_weather", "Action_Input": {"city": "Paris"}},
                {"Action": "get_time", "Action_Input": '{"tz": "CET"}'},
            ]
        ),
    }
    fb = score("tooluse", call("get_weather", {"city": "Paris"}), rec).feedback
    assert fb == "Wrong tool calls: 2 call(s) are needed, 1 were made.", fb


def test_bfcl_allowed_values_with_optional_arguments():
    rec = {
        "id": "b",
        "tools": TOOLS,
        "allowed": {"get_weather": {"city": ["Paris", "paris, france"], "units": ["", "C", "celsius"]}},
    }
    assert score("tooluse", call("get_weather", {"city": "Paris"}), rec).score == 1.0
    assert score("tooluse", call("get_weather", {"city": "PARIS, France", "units": "C"}), rec).score == 1.0
    bad = score("tooluse", call("get_weather", {"city": "Paris", "units": "K"}), rec)
    assert bad.score == 0.0 and "Wrong value for argument 'units'" in bad.feedback
    missing = score("tooluse", call("get_weather", {"units": "C"}), rec)
    assert missing.score == 0.0 and "Missing required argument 'city'" in missing.feedback
    extra = score("tooluse", call("get_weather", {"city": "Paris", "x": 1}), rec)
    assert extra.score == 0.0 and "Unexpected argument 'x'" in extra.feedback
    wrong_fn = score("tooluse", call("get_time", {}), rec)
    assert wrong_fn.score == 0.0


def test_bfcl_allowed_list_keeps_each_repeated_call_its_own_values():
    # the loaders' form: one entry per expected call; two calls of one function (BFCL parallel)
    rec = {
        "id": "p",
        "tools": TOOLS,
        "allowed": [
            {"Action": "get_weather", "Action_Input": {"city": ["Paris"]}},
            {"Action": "get_weather", "Action_Input": {"city": ["Rome"]}},
        ],
    }
    both = call("get_weather", {"city": "Rome"}) + "\n" + call("get_weather", {"city": "Paris"})
    assert score("tooluse", both, rec).score == 1.0
    twice = call("get_weather", {"city": "Paris"}) + "\n" + call("get_weather", {"city": "Paris"})
    bad = score("tooluse", twice, rec)
    assert bad.score == 0.0 and "Wrong value for argument 'city'" in bad.feedback


def test_malformed_gold_is_a_data_error():
    with pytest.raises(DataError, match="tool-use answer"):
        score("tooluse", call("get_time", {}), {**REC, "answer": "{not json"})


def test_adversarial_inputs_do_not_raise():
    deep = "Action: get_weather\nAction Input: " + '{"a": ' * 50_000
    assert score("tooluse", deep, REC).score == 0.0
    many = call("get_weather", {"city": "Paris", "days": 3}) * 10_000
    assert score("tooluse", many, REC).score == 0.0
    assert score("tooluse", b"\xff\xfe Action: \x00", REC).score == 0.0
