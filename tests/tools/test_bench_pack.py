"""tools/bench_pack.py: per (loss, arm, round) rows in the bench_harness schema and a summary per
(loss, arm), on a tiny model."""

import csv

import pytest
from bench_harness import FIELDS, parse_params, summary_path

from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3

from bench_cli import run

METRICS = ("step_s", "step_cpu_s", "model_tokens", "real_tokens")


def run_pack(tmp_path, *extra):
    model = save_tiny_qwen3(tmp_path / "m", seed=0)
    out = tmp_path / "bench.csv"
    sizes = ["--samples", "6", "--micro-batch-size", "4", "--rounds", "2", "--threads", "1"]
    run(tmp_path, "bench_pack.py", "--model", model, *sizes, "--out", str(out), *extra)
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == FIELDS
    summary = {
        (parse_params(s["params"])["loss"], s["arm"], s["metric"]): s for s in csv.DictReader(summary_path(out).open())
    }
    return rows, summary


def test_writes_rows_per_round_and_a_summary_per_loss_and_arm(tmp_path):
    rows, summary = run_pack(tmp_path, "--row-tokens", "0,40", "--group-size", "3")
    arms = ("padded", "packed_0", "shared_0", "packed_40", "shared_40")
    assert sorted((parse_params(r["params"])["loss"], r["arm"], r["round"], r["metric"]) for r in rows) == sorted(
        (loss, arm, rnd, m) for loss in ("grpo", "sdpo") for arm in arms for rnd in "12" for m in METRICS
    )
    assert list(dict.fromkeys((k[0], k[1]) for k in summary)) == [
        (loss, arm) for loss in ("grpo", "sdpo") for arm in arms
    ]
    fed = {(loss, arm): int(s["median"]) for (loss, arm, m), s in summary.items() if m == "model_tokens"}
    for (loss, arm, metric), s in summary.items():
        assert s["rounds"] == "2" and s["baseline"] == "padded"
        if metric != "real_tokens":
            continue
        real = int(s["median"])
        assert real > 0 and float(summary[loss, arm, "step_s"]["median"]) > 0
        assert float(summary[loss, arm, "step_cpu_s"]["median"]) > 0
        if arm == "padded":
            assert float(summary[loss, arm, "step_s"]["ratio"]) == 1.0 and fed[loss, arm] >= real
        if arm == "packed_0":
            assert fed[loss, arm] == real  # one row per micro-batch: not a single pad token
        if arm == "packed_40":  # rows of at most 40 tokens unless one sample is longer (< 73)
            assert real <= fed[loss, arm] <= fed[loss, "padded"]
        if arm == "shared_0":  # one row per micro-batch, 6 samples of 2 prompts: prompt copies dropped
            assert fed[loss, arm] < fed[loss, "packed_0"]


@pytest.mark.megatron
def test_megatron_arms_feed_the_real_tokens_when_packed(tmp_path):
    _, summary = run_pack(tmp_path, "--backend", "megatron")
    assert list(dict.fromkeys((k[0], k[1]) for k in summary)) == [
        (loss, arm) for loss in ("grpo", "sdpo") for arm in ("padded", "packed")
    ]
    for (loss, arm, metric), s in summary.items():
        if metric != "model_tokens":
            continue
        fed, real = int(s["median"]), int(summary[loss, arm, "real_tokens"]["median"])
        assert float(summary[loss, arm, "step_s"]["median"]) > 0
        # Packed rows (no pipeline parallelism) hold the samples and nothing else; padded rows
        # are the longest sample (teacher prompts included) long.
        assert fed == real if arm == "packed" else fed > real
