"""The shared base row (outputs/base_rows.py): its key changes with what determines the row and
with nothing else; a stored row reads back, a corrupt one is evaluated again; two runs sharing a
cache give the second the first's row without evaluating it."""

import json
import subprocess
import sys

import pytest

from megatron_sdpo.config import load_config
from megatron_sdpo.outputs.base_rows import BaseRows, row_key

SETS = {"math/id": [{"id": 1, "prompt": "2+2?"}], "math/ood_far": [{"id": 2, "prompt": "2*3?"}]}


def test_the_key_follows_what_determines_the_row(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(b"x" * 10)
    key = lambda *ovs, sets=SETS: row_key(load_config("tiny", list(ovs)), str(model), sets)
    base = key()
    # Not part of the row with greedy evaluation: the seed, the training, the cache's own path.
    assert key("seed=7") == base and key("algorithm.name=sdpo") == base == key("eval.base_row_cache=/x")
    assert key("eval.at_steps=[3]") == base
    # Part of it: the eval settings, the items, the weights, the seed once evaluation samples.
    assert key("eval.max_new_tokens=16") != base
    # The engine's dtype where it is not the model's (tiny's model is fp32).
    assert key("rollout.dtype=float32") == base == key("rollout.dtype=auto")
    assert key("rollout.dtype=bfloat16") != base
    assert key(sets={**SETS, "math/id": [{"id": 1, "prompt": "2+3?"}]}) != base
    sampled = key("eval.greedy=false", "eval.avg_k=4")
    assert sampled != base and key("eval.greedy=false", "eval.avg_k=4", "seed=7") != sampled
    (model / "model.safetensors").write_bytes(b"x" * 11)
    assert key() != base


def test_rows_read_back_and_a_corrupt_one_is_a_miss(tmp_path):
    rows = BaseRows(tmp_path / "rows")
    assert rows.load("k") is None
    rows.store("k", {"math/id": 0.5}, {"math/id": [{"id": 1, "response": "4", "score": 1.0}]})
    assert rows.load("k") == ({"math/id": 0.5}, {"math/id": [{"id": 1, "response": "4", "score": 1.0}]})
    (tmp_path / "rows" / "k.json").write_text("{not json")
    assert rows.load("k") is None
    assert [p.name for p in (tmp_path / "rows").iterdir()] == ["k.json"]  # no temporary file left


@pytest.mark.slow
def test_a_second_run_takes_the_first_runs_base_row(tmp_path, tiny_two_stage):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        tiny_two_stage(
            "rows",
            steps=(1, 1),
            rollout="{engine: hf, max_new_tokens: 8}",
            eval="{max_new_tokens: 8}",
            checkpoint="{save_every: 0}",
            diagnostics="{enabled: false}",
        )
    )
    outs = []
    # The same seed: tiny's eval items are drawn with it (an exhaustive split's are not).
    for name, ovs in (("a", ["seed=1"]), ("b", ["seed=1", "algorithm.name=sdpo"])):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_sdpo",
                "run",
                str(cfg),
                *ovs,
                f"eval.base_row_cache={tmp_path / 'rows'}",
                "--out",
                str(tmp_path / name),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        outs.append(proc.stdout)
    assert "base eval row from" not in outs[0] and "base eval row from" in outs[1]
    matrices = [(tmp_path / n / "eval_matrix.csv").read_text().splitlines() for n in ("a", "b")]
    assert matrices[0][:2] == matrices[1][:2]  # header and base row
    samples = [json.loads((tmp_path / n / "eval_samples" / "base.json").read_text()) for n in ("a", "b")]
    assert samples[0] == samples[1] and len(list((tmp_path / "rows").glob("*.json"))) == 1
