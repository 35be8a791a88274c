"""Fake run directories: an eval matrix built from per-item scores, the saved answers it came from,
metrics.jsonl and a report (what marks a run finished)."""

import json

import pytest

from megatron_sdpo.outputs.run_dir import RunDir


def write_run(root, items, rewards=(), drift=None):
    """items: {row: {column: [item scores]}}, rows in order from "base"; rewards: (stage index,
    stage domain, [reward per step]); drift: the last stage's drift record."""
    rd = RunDir(root)
    for sub in (rd.root, rd.eval_samples, rd.drift):
        sub.mkdir(parents=True, exist_ok=True)
    rows = list(items)
    rd.write_eval_matrix([(row, {c: sum(v) / len(v) for c, v in cols.items()}) for row, cols in items.items()])
    for i, row in enumerate(rows):
        label = "base" if i == 0 else f"stage_{i}_{row}"
        samples = {
            c: [{"id": f"{c}-{j}", "response": "", "score": s} for j, s in enumerate(v)] for c, v in items[row].items()
        }
        (rd.eval_samples / f"{label}.json").write_text(json.dumps(samples))
    for stage, domain, values in rewards:
        for step, r in enumerate(values, start=1):
            rd.append_metrics({"stage": stage, "stage_domain": domain, "step": step, "reward_mean": r})
    if drift is not None:
        (rd.drift / f"stage_{len(rows) - 1}.json").write_text(json.dumps(drift))
    rd.report.write_text("# fake\n")
    return rd.root


@pytest.fixture
def make_run():
    return write_run
