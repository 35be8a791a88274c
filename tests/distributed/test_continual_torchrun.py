"""The continual job under torchrun: two gloo ranks train one policy with DDP; rank 0 writes."""

import json
import os
import subprocess

import pytest

from cli_process import torchrun_cli

SECTIONS = dict(
    rollout="{engine: auto, max_new_tokens: 16}",
    eval="{max_new_tokens: 16}",
    diagnostics="{probe_n: 2}",
)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_rank_run_completes_and_slow_stage_end_diagnostics_do_not_hold_the_ranks(tmp_path, tiny_two_stage):
    """One 2-rank run checks both (each is a whole run on 2 cores, so they share it): the ranks
    train one policy and rank 0 alone writes; and the main rank's drift work at a stage end takes
    longer than the process group's timeout (a delay in each detached job), yet the ranks pass
    every boundary (checkpoints at every step included) and report.md holds every stage's drift,
    waited for at the end."""
    from megatron_sdpo.outputs.drift_jobs import DELAY_ENV

    cfg = tmp_path / "ddp.yaml"
    cfg.write_text(
        tiny_two_stage("ddp", checkpoint="{save_every: 1}", launch="{distributed_timeout_minutes: 0.25}", **SECTIONS)
    )
    cmd = torchrun_cli(2, "run", str(cfg), "--out", "run", "--quiet")
    env = {**os.environ, "OMP_NUM_THREADS": "1", DELAY_ENV: "30"}  # twice the 15 s timeout
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "run"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["stage"], m["step"]) for m in metrics] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(m["samples"] == 16 for m in metrics)  # the global batch, trained across both ranks
    rows = (run / "eval_matrix.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["base", "math", "tooluse"]
    assert proc.stdout.count("done in") == 1  # only rank 0 reports
    for k in (1, 2):
        record = json.loads((run / "drift" / f"stage_{k}.json").read_text())
        assert record["stage"] == k and "param_vs_prev" in record
    report = (run / "report.md").read_text()
    assert "## Drift after each stage" in report and "| 1 math |" in report and "| 2 tooluse |" in report
    assert not (run / "drift" / "pending").exists()
