"""Command-line parsing: options, positionals and key=value overrides in any order."""

import pytest

from megatron_sdpo.cli import main, parse_args
from megatron_sdpo.errors import UserError

# One command line written in several orders of its options, positionals and overrides, and what
# every order parses to.
ORDERINGS = [
    (
        {"config": "tiny_sdpo", "out": "o", "quiet": True, "overrides": ["a.b=1", "c.d=2"]},
        [
            ["run", "tiny_sdpo", "a.b=1", "--out", "o", "c.d=2", "--quiet"],
            ["run", "--out", "o", "tiny_sdpo", "a.b=1", "--quiet", "c.d=2"],
            ["run", "a.b=1", "c.d=2", "--quiet", "--out", "o", "tiny_sdpo"],
        ],
    ),
    (
        {
            "config": "tiny",
            "algorithms": "sdpo,stable_sdpo",
            "overrides": ["algorithm.sdpo.context.use_feedback=false"],
        },
        [
            ["compare", "tiny", "--algorithms", "sdpo,stable_sdpo", "algorithm.sdpo.context.use_feedback=false"],
            ["compare", "tiny", "algorithm.sdpo.context.use_feedback=false", "--algorithms", "sdpo,stable_sdpo"],
            ["compare", "--algorithms", "sdpo,stable_sdpo", "tiny", "algorithm.sdpo.context.use_feedback=false"],
            ["compare", "--algorithms", "sdpo,stable_sdpo", "algorithm.sdpo.context.use_feedback=false", "tiny"],
        ],
    ),
    (
        {"model": "M", "config": "tiny_grpo", "out": "o", "overrides": ["eval.batch_size=4"]},
        [
            ["eval", "M", "tiny_grpo", "eval.batch_size=4", "--out", "o"],
            ["eval", "M", "--out", "o", "tiny_grpo", "eval.batch_size=4"],
        ],
    ),
    (
        {"model": "M", "config": "tiny", "out": "o", "overrides": ["eval.batch_size=4"]},
        [["eval", "--out", "o", "M", "eval.batch_size=4"], ["eval", "M", "eval.batch_size=4", "--out", "o"]],
    ),
    (
        {"a": "A", "b": "B", "out": "D", "rank": 4},
        [
            ["drift", "A", "B", "--out", "D", "--rank", "4"],
            ["drift", "--out", "D", "A", "B", "--rank", "4"],
            ["drift", "A", "--rank", "4", "B", "--out", "D"],
        ],
    ),
    (
        {"config": "tiny", "arms": "grpo,sdpo_frozen", "seeds": "0-1", "jobs": 2, "overrides": ["stages.0.steps=2"]},
        [
            ["study", "tiny", "--arms", "grpo,sdpo_frozen", "--seeds", "0-1", "stages.0.steps=2", "--jobs", "2"],
            ["study", "--arms", "grpo,sdpo_frozen", "stages.0.steps=2", "tiny", "--seeds", "0-1", "--jobs", "2"],
            ["study", "stages.0.steps=2", "--jobs", "2", "--arms", "grpo,sdpo_frozen", "--seeds", "0-1", "tiny"],
        ],
    ),
]


@pytest.mark.parametrize("argv, want", [(argv, want) for want, argvs in ORDERINGS for argv in argvs])
def test_orderings(argv, want):
    args = parse_args(argv)
    assert {key: getattr(args, key) for key in want} == want


def test_run_without_a_preset_takes_overrides_and_the_default_preset():
    args = parse_args(["run", "a.b=1", "--out", "o"])
    assert (args.config, args.overrides) == ("tiny", ["a.b=1"])


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
