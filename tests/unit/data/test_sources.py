"""Choosing rows of a data file from the config: `where` (column values) and `part` (a share of
the file's questions by a hash of the question text), and which shots an eval record is shown."""

import json

import pytest

from megatron_sdpo.config import load_config
from megatron_sdpo.config.schema import DataSource
from megatron_sdpo.data.sources import load_source, question_share
from megatron_sdpo.errors import ConfigError, DataError


def _math_file(tmp_path, n=40):
    rows = [
        {
            "problem": f"What is {i} + {i}?",
            "solution": f"\\boxed{{{2 * i}}}",
            "answer": str(2 * i),
            "level": str(1 + i % 5),
            "unique_id": f"q{i}",
        }
        for i in range(n)
    ]
    # a second copy of question 0 under another id: a part must keep whole questions
    rows.append({**rows[0], "unique_id": "q0-copy"})
    rows.append({"problem": "No level here: 1 + 1?", "solution": "\\boxed{2}", "answer": "2", "unique_id": "nolevel"})
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def test_where_keeps_rows_by_column_value_compared_as_text(tmp_path):
    path, rows = _math_file(tmp_path)
    src = DataSource(source=str(path), schema="math500", n=0, where={"level": ["1", "2"]})
    got = load_source(src, "math", "id", seed=0)
    want = [r for r in rows if r.get("level") in ("1", "2")]  # the row without "level" is not kept
    assert sorted(r["answer"] for r in got) == sorted(r["answer"] for r in want)
    # numbers in YAML are text after config coercion: `where: {level: [1, 2]}` is the same filter
    cfg = load_config(
        "tiny",
        [
            f"domains.math.eval.id.source={path}",
            "domains.math.eval.id.schema=math500",
            "domains.math.eval.id.where={level: [1, 2]}",
        ],
    )
    assert cfg.domains["math"].eval["id"].where == {"level": ["1", "2"]}
    with pytest.raises(DataError, match=r"no records for domain 'math' with level in \['9'\]"):
        load_source(DataSource(source=str(path), schema="math500", where={"level": ["9"]}), "math", "id", seed=0)


def test_parts_of_a_file_are_disjoint_by_question_and_cover_it(tmp_path):
    path, rows = _math_file(tmp_path)
    whole = load_source(DataSource(source=str(path), schema="math500", n=0), "math", "id", seed=0)
    lo = load_source(DataSource(source=str(path), schema="math500", n=0, part=[0.0, 0.7]), "math", "train", seed=0)
    hi = load_source(DataSource(source=str(path), schema="math500", n=0, part=[0.7, 1.0]), "math", "id", seed=0)
    assert lo and hi and len(lo) + len(hi) == len(whole)
    assert not {r["id"] for r in lo} & {r["id"] for r in hi}
    assert not {r["prompt"] for r in lo} & {r["prompt"] for r in hi}
    # the duplicated question sits in one part with its copy
    twice = [r for r in whole if r["prompt"] == whole[0]["prompt"]]
    assert len(twice) == 2 and len({question_share(r["prompt"]) < 0.7 for r in twice}) == 1
    # the share is a hash of the question text: whitespace and case do not move it
    assert question_share("What is 1 + 1?") == question_share("  what IS 1 +   1? ")
    assert 0.0 <= question_share("x") < 1.0


@pytest.mark.parametrize(
    "over,match",
    [
        (["domains.math.train.where={level: [1]}"], r"domains.math.train.where and .part apply to file sources only"),
        (
            ["domains.math.eval.id.source=x.jsonl", "domains.math.eval.id.where={level: []}"],
            r"domains.math.eval.id.where.level must list at least one value",
        ),
        (
            ["domains.math.eval.id.source=x.jsonl", "domains.math.eval.id.part=[0.5, 0.5]"],
            r"domains.math.eval.id.part must be \[lo, hi\] with 0 <= lo < hi <= 1",
        ),
        (["domains.math.eval.id.source=x.jsonl", "domains.math.eval.id.part=[0.2, 1.5]"], r"part must be \[lo, hi\]"),
        (["domains.math.eval.id.source=x.jsonl", "domains.math.eval.id.part=[0.2]"], r"part must be \[lo, hi\]"),
    ],
)
def test_where_and_part_are_checked_at_config_validation(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny", over)


def test_an_eval_record_is_shown_its_own_domains_shots(tmp_path):
    from megatron_sdpo.evaluation import load_eval_sets

    mmlu = tmp_path / "mmlu.jsonl"
    mmlu.write_text(json.dumps({"question": "2 + 2?", "choices": ["3", "4"], "answer": 1, "subject": "math"}) + "\n")
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "defaults: tiny\n"
        "stages: [{domain: math, steps: 1}]\n"
        "domains:\n"
        "  math:\n"
        f"    eval: {{ood_far: {{source: {mmlu}, schema: mmlu_redux, n: 0}}}}\n"
        "    shots: [{user: 'math q', assistant: '\\boxed{1}'}]\n"
        "  science:\n"
        "    shots: [{user: 'science q', assistant: '<answer>A</answer>'}]\n"
        "  tooluse: null\n"
        "  code: null\n"
    )
    evals = load_eval_sets(load_config(str(path)))
    # MMLU under math is scored as science: it is prompted with the science answer format
    assert [r["domain"] for r in evals["math/ood_far"]] == ["science"]
    assert evals["math/ood_far"][0]["history"][1]["content"] == "<answer>A</answer>"
    assert all(r["history"][1]["content"] == "\\boxed{1}" for r in evals["math/id"])
