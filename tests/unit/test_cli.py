"""Command-line parsing: options, positionals and key=value overrides in any order."""

import pytest

from megatron_sdpo.cli import main, parse_args
from megatron_sdpo.errors import UserError


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "tiny_sdpo", "a.b=1", "--out", "o", "c.d=2", "--quiet"],
        ["run", "--out", "o", "tiny_sdpo", "a.b=1", "--quiet", "c.d=2"],
        ["run", "a.b=1", "c.d=2", "--quiet", "--out", "o", "tiny_sdpo"],
    ],
)
def test_run_orderings(argv):
    args = parse_args(argv)
    assert (args.config, args.out, args.quiet, args.overrides) == ("tiny_sdpo", "o", True, ["a.b=1", "c.d=2"])


def test_run_without_a_preset_takes_overrides_and_the_default_preset():
    args = parse_args(["run", "a.b=1", "--out", "o"])
    assert (args.config, args.overrides) == ("tiny", ["a.b=1"])


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "tiny", "--algorithms", "sdpo,stable_sdpo", "algorithm.sdpo.context.use_feedback=false"],
        ["compare", "tiny", "algorithm.sdpo.context.use_feedback=false", "--algorithms", "sdpo,stable_sdpo"],
        ["compare", "--algorithms", "sdpo,stable_sdpo", "tiny", "algorithm.sdpo.context.use_feedback=false"],
        ["compare", "--algorithms", "sdpo,stable_sdpo", "algorithm.sdpo.context.use_feedback=false", "tiny"],
    ],
)
def test_compare_orderings(argv):
    args = parse_args(argv)
    assert (args.config, args.algorithms) == ("tiny", "sdpo,stable_sdpo")
    assert args.overrides == ["algorithm.sdpo.context.use_feedback=false"]


@pytest.mark.parametrize(
    "argv, config",
    [
        (["eval", "M", "tiny_grpo", "eval.batch_size=4", "--out", "o"], "tiny_grpo"),
        (["eval", "M", "--out", "o", "tiny_grpo", "eval.batch_size=4"], "tiny_grpo"),
        (["eval", "--out", "o", "M", "eval.batch_size=4"], "tiny"),
        (["eval", "M", "eval.batch_size=4", "--out", "o"], "tiny"),
    ],
)
def test_eval_orderings(argv, config):
    args = parse_args(argv)
    assert (args.model, args.config, args.out, args.overrides) == ("M", config, "o", ["eval.batch_size=4"])


@pytest.mark.parametrize(
    "argv",
    [
        ["drift", "A", "B", "--out", "D", "--rank", "4"],
        ["drift", "--out", "D", "A", "B", "--rank", "4"],
        ["drift", "A", "--rank", "4", "B", "--out", "D"],
    ],
)
def test_drift_orderings(argv):
    args = parse_args(argv)
    assert (args.a, args.b, args.out, args.rank) == ("A", "B", "D", 4)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["run", "tiny", "--bogus"], "unrecognized option '--bogus'"),
        (["run", "tiny", "stray"], "unrecognized argument 'stray'"),
        (["compare", "tiny", "grpo"], "unrecognized argument 'grpo'"),
        (["compare", "--algorithms", "grpo", "a.b=1"], "name a preset"),
        (["drift", "A", "B"], "required: --out"),
        (["drift", "A", "B", "--out", "D", "a=b"], "unrecognized argument 'a=b'"),
        (["drift", "A", "B", "--out", "D", "--rank", "four"], "invalid int value"),
        (["presets", "extra"], "unrecognized argument 'extra'"),
        ([], "required: command"),
    ],
)
def test_bad_command_lines_raise_user_error(argv, needle):
    with pytest.raises(UserError, match=needle):
        parse_args(argv)


def test_main_prints_one_line_and_exits_2(capsys):
    assert main(["run", "tiny", "--out", "o", "stray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: megatron-sdpo run: unrecognized argument 'stray'")


@pytest.mark.parametrize("override", ["teacher.ema_rate=0", "stages.2.teacher.ema_rate=0"])
def test_a_bad_bound_stops_the_run_before_anything_is_built(monkeypatch, tmp_path, capsys, override):
    # Validated with the config, not minutes later when the teacher schedule starts.
    from megatron_sdpo import builders

    built = []
    for name in ("make_backend", "make_rollout", "resolve_model_path"):
        monkeypatch.setattr(builders, name, lambda *a, _n=name, **k: built.append(_n))
    assert main(["run", "tiny_sdpo", override, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "teacher.ema_rate must be in (0, 1]" in err[0]
    assert built == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["study", "tiny", "--arms", "grpo,sdpo_frozen", "--seeds", "0-1", "stages.0.steps=2", "--jobs", "2"],
        ["study", "--arms", "grpo,sdpo_frozen", "stages.0.steps=2", "tiny", "--seeds", "0-1", "--jobs", "2"],
        ["study", "stages.0.steps=2", "--jobs", "2", "--arms", "grpo,sdpo_frozen", "--seeds", "0-1", "tiny"],
    ],
)
def test_study_orderings(argv):
    args = parse_args(argv)
    assert (args.config, args.arms, args.seeds, args.jobs, args.overrides) == (
        "tiny",
        "grpo,sdpo_frozen",
        "0-1",
        2,
        ["stages.0.steps=2"],
    )


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["study", "--arms", "grpo"], "study: name a preset"),
        (["study", "tiny", "--arms", "grpo,ppo", "--out", "o"], "unknown arm 'ppo'"),
        (
            ["study", "tiny", "--arm", "x:teacher.bogus=1", "--arms", "grpo,x", "--out", "o"],
            "arm x: unknown config key",
        ),
        (["study", "tiny", "--pilot", "3", "--seeds", "0-2", "--out", "o"], "drop --seeds"),
        (["study", "tiny", "--pilot", "1", "--out", "o"], "at least 2 seeds"),
        (["study", "tiny", "--seeds", "x", "--out", "o"], "--seeds 'x'"),
        (["study", "tiny", "--jobs", "0", "--out", "o"], "--jobs must be at least 1"),
        (["study", "tiny", "--baseline", "sdpo_ema5", "--out", "o"], "not among the arms"),
        (["study", "tiny", "--pilot", "2", "--detect", "-1", "--out", "o"], "--detect '-1'"),
    ],
)
def test_bad_study_lines_are_one_line_errors_before_any_run(argv, needle, tmp_path, monkeypatch, capsys):
    from megatron_sdpo.study import runner

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner.StudyRunner, "run", lambda self: pytest.fail("no run may start"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
