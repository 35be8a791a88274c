"""The grace a stop needs against the job's signal lead: the planned step, the save and the
margin by hand; the lead read from a job script or the environment; the preflight's line."""

import math

import pytest

from megatron_sdpo.errors import UserError
from megatron_sdpo.planning import stop_grace as sg


def _by_hand(**kw):
    """The step test_planned_step_by_hand works out."""
    return sg.planned_step_seconds(
        params=10**9,
        world=4,
        samples=10,
        max_len=1000,
        new_tokens=100,
        waves=2,
        wave_seqs=5,
        kv_bytes_per_token=1000,
        engine_weight_bytes=2 * 10**9,
        extra_forwards=1,
        **kw,
    )


def test_planned_step_by_hand():
    # Train: (6 + 2*1) * 1e9 params * 10 samples * 1000 tokens / (4 ranks * peak * MFU).
    # Decode: 100 tokens * 2 waves * (2e9 weight bytes + 5 seqs * (1000 - 50) tokens * 1000 bytes).
    seconds, how = _by_hand()
    train = 8e9 * 1e4 / (4 * sg.PEAK_FLOPS * sg.TRAIN_MFU)
    decode = 200 * (2e9 + 5 * 950 * 1000) / (sg.HBM_BYTES_S * sg.DECODE_HBM_SHARE)
    assert seconds == pytest.approx(train + decode, rel=1e-12)
    assert "every answer at 1000 tokens" in how


def test_the_planned_step_adds_the_collectives_to_the_rollout():
    """The rollout engine's TP collectives (engine_class.py) add to the step's time."""
    base, _ = _by_hand()
    more, how = _by_hand(collectives_s=7.0)
    assert more == pytest.approx(base + 7.0, rel=1e-12) and "rollout" in how


def test_budget_adds_step_save_refit_and_margin():
    b = sg.planned_budget(
        step_s=300.0,
        step_source="x",
        node_bytes=24 * 2**30,
        write_gib_s=2.0,
        refit_bytes_per_rank=10**10,
        offloaded=True,
    )
    assert b.save_s == pytest.approx(12.0) and b.refit_s == pytest.approx(1e10 / sg.REFIT_BYTES_S)
    assert b.margin_s == pytest.approx(max(sg.MARGIN_MIN_S, 0.1 * (300 + 12 + 0.2)))
    assert b.total_s == pytest.approx(300 + 12 + 0.2 + b.margin_s)
    assert b.reserve_s == pytest.approx(b.total_s - 300)
    # Without offload the weights stay with the engine: no refit after a save.
    assert (
        sg.planned_budget(
            step_s=1, step_source="x", node_bytes=0, write_gib_s=1, refit_bytes_per_rank=10**10, offloaded=False
        ).refit_s
        == 0
    )
    assert b.line().startswith(f"stop grace: {b.total_s:.0f} s = step 300 s (x) + save 12 s (24.0 GiB per node")


@pytest.mark.parametrize(
    "line, lead",
    [
        ("#SBATCH --signal=B:USR1@720", 720),
        ("#SBATCH --signal=USR1@90", 90),
        ("#SBATCH --signal=SIGUSR1@30", 30),
        ("#SBATCH --signal=B:USR1", 60),
        ("#SBATCH --signal RB:TERM@300", 300),
    ],
)
def test_the_lead_is_read_from_the_job_script(tmp_path, monkeypatch, line, lead):
    monkeypatch.delenv(sg.LEAD_ENV, raising=False)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --time=1:00:00\n{line}\nexec true\n")
    assert sg.signal_lead(script)[0] == lead
    monkeypatch.setenv(sg.LEAD_ENV, "1200")  # sbatch --signal on the command line, stated
    assert sg.signal_lead(script) == (1200, sg.LEAD_ENV)


def test_no_lead_and_bad_leads(tmp_path, monkeypatch):
    monkeypatch.delenv(sg.LEAD_ENV, raising=False)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n# USR1 ten minutes before: #SBATCH --signal in prose is not a directive\n")
    assert sg.signal_lead(script)[0] is None and sg.signal_lead(None) == (None, "no job script")
    with pytest.raises(UserError, match="--job-script .*missing.sh"):
        sg.signal_lead(tmp_path / "missing.sh")
    monkeypatch.setenv(sg.LEAD_ENV, "ten minutes")
    with pytest.raises(UserError, match="SDPO_STOP_LEAD_S='ten minutes' is not a whole number"):
        sg.signal_lead(script)


def test_a_short_lead_is_one_line_naming_the_lead_to_use():
    b = sg.StopBudget(step_s=500.0, step_source="planned", save_s=100.0, save_source="s", refit_s=0.0)
    assert sg.lead_error(700, "job.sh", b) is None  # 500 + 100 + 60 = 660 fits
    err = sg.lead_error(600, "job.sh", b)
    assert err is not None and "\n" not in err
    assert "lead 600 s (job.sh) is shorter than the 660 s" in err and "--signal=B:USR1@660" in err
    assert "--signal=B:USR1@720" in sg.lead_error(600, "j", sg.StopBudget(541.0, "p", 100.0, "s", 0.0))  # 705.1 s


def test_the_launch_env_file():
    b = sg.StopBudget(step_s=100.0, step_source="p", save_s=20.5, save_source="s", refit_s=0.0)
    text = sg.env_lines(600, b)
    assert text == f"export {sg.LEAD_ENV}=600\nexport {sg.RESERVE_ENV}={math.ceil(20.5 + 30)}\n"
    assert sg.env_lines(None, None) == ""


def test_ranks_per_node(monkeypatch):
    for key in ("GPUS_PER_NODE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert sg.ranks_per_node(16) == 8 and sg.ranks_per_node(2) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert sg.ranks_per_node(16) == 4
    monkeypatch.setenv("GPUS_PER_NODE", "x")
    with pytest.raises(UserError, match="GPUS_PER_NODE='x'"):
        sg.ranks_per_node(16)


def test_the_dry_run_prints_the_grace_and_the_preflight_fails_a_short_lead(tmp_path, monkeypatch, capsys):
    from megatron_sdpo.cli import main

    monkeypatch.delenv(sg.LEAD_ENV, raising=False)
    monkeypatch.setenv("GPUS_PER_NODE", "8")
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --signal=B:USR1@120\n")
    env_file = tmp_path / "launch.env"
    rc = main(
        [
            "run",
            "olmo3_7b",
            "--dry-run",
            "--world-size",
            "16",
            "--job-script",
            str(script),
            "--launch-env",
            str(env_file),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0  # not strict: a warning
    grace = [ln for ln in out.splitlines() if ln.startswith("stop grace: ")]
    assert len(grace) == 1 and "save 136 s (136.0 GiB per node at 1 GiB/s)" in grace[0], out[-3000:]
    assert "stop signal: 120 s before the kill (job.sh: #SBATCH --signal USR1@120)" in out
    assert [ln for ln in out.splitlines() if ln.startswith("warning: stop signal lead 120 s")]
    assert f"export {sg.LEAD_ENV}=120\n" in env_file.read_text()
    main(["run", "olmo3_7b", "--dry-run", "--strict", "--world-size", "16", "--job-script", str(script)])
    err = [ln for ln in capsys.readouterr().err.splitlines() if "stop signal lead" in ln]
    assert len(err) == 1 and err[0].startswith("error: stop signal lead 120 s"), err
    # The shipped script's lead holds its preset's grace.
    main(["run", "olmo3_7b", "--dry-run", "--world-size", "16", "--job-script", "slurm/continual_7b.sh"])
    assert "warning: stop signal lead" not in capsys.readouterr().out


def test_job_script_is_for_the_dry_run(capsys):
    from megatron_sdpo.cli import main

    assert main(["run", "tiny", "--job-script", "x.sh"]) == 2
    assert "--job-script and --launch-env are for --dry-run" in capsys.readouterr().err
