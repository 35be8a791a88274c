"""The one gate: every numeric field of the schema has its bound in config/validation.py (or is
listed as unbounded, with a reason), and every bad value is one line from `load_config` and
from `run --dry-run`, before any model loads."""

import dataclasses
import types
import typing

import pytest

from megatron_sdpo import cli
from megatron_sdpo.config import load_config
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.config.validation import BOUNDS, UNBOUNDED
from megatron_sdpo.errors import ConfigError

# Values tried, in order, for one outside a bound: every bound of the table refuses one of them.
PROBES = (-1, 0, 1.5, 2**32, 1, 3)


def _numeric(t) -> bool:
    args = typing.get_args(t)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return any(_numeric(a) for a in args if a is not type(None))
    if typing.get_origin(t) is list:
        return _numeric(args[0])
    return t in (int, float)


def _numeric_fields(cls, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out += _numeric_fields(t, f"{prefix}{f.name}.")
        elif _numeric(t):
            out.append(f"{prefix}{f.name}")
    return out


def test_every_numeric_field_of_the_schema_has_its_bound_or_a_reason():
    fields = set(_numeric_fields(RunConfig))
    assert len(fields) > 60  # the walk reaches the nested sections
    assert sorted(fields - BOUNDS.keys() - UNBOUNDED.keys()) == [], "a numeric field without a bound or a reason"
    assert sorted((BOUNDS.keys() | UNBOUNDED.keys()) - fields) == [], "a row for a field the schema lacks"
    assert not BOUNDS.keys() & UNBOUNDED.keys()


def _bad(key: str):
    bound = BOUNDS[key]
    return next(v for v in PROBES if not bound.holds(v))


@pytest.mark.parametrize("key", sorted(BOUNDS))
def test_each_bound_refuses_a_value_outside_it_in_one_line(key):
    bad = _bad(key)
    with pytest.raises(ConfigError) as err:
        load_config("tiny_sdpo", [f"{key}={bad}"])
    msg = str(err.value)
    assert msg.startswith(f"{key} must be {BOUNDS[key].says}, got {bad!r}") and "\n" not in msg, msg


# The bounds once checked only when the loss was built (after the models loaded), and a rule
# across sections the run met only when it built its engine.
AFTER_LOAD_ONCE = [
    ("algorithm.grpo.clip_low=1.0", "algorithm.grpo.clip_low must be in [0, 1)"),
    ("algorithm.grpo.clip_high=-0.1", "algorithm.grpo.clip_high must be >= 0"),
    ("algorithm.grpo.kl_coef=-1", "algorithm.grpo.kl_coef must be >= 0"),
    ("algorithm.grpo.tis_cap=0", "algorithm.grpo.tis_cap must be > 0 or null"),
    ("algorithm.sdpo.is_clip=0", "algorithm.sdpo.is_clip must be > 0 or null"),
    ("algorithm.sdpo.variant=sampled", "algorithm.sdpo.variant=sampled is the reverse KL only"),
    ("rollout.tensor_parallel_size=2", "rollout.tensor_parallel_size=2 needs rollout.engine=vllm"),
]


@pytest.mark.parametrize("override, says", AFTER_LOAD_ONCE, ids=[o for o, _ in AFTER_LOAD_ONCE])
def test_dry_run_says_it_in_one_line_before_any_model_loads(override, says, monkeypatch, capsys):
    from megatron_sdpo import builders

    def no_model(*a, **k):
        raise AssertionError("a model was built before the config was refused")

    monkeypatch.setattr(builders, "make_backend", no_model)
    monkeypatch.setattr(builders, "make_rollout", no_model)
    extra = ["rollout.engine=hf"] if override.startswith("rollout.") else ["algorithm.sdpo.alpha=0.5"]
    assert cli.main(["run", "tiny_sdpo", override, *extra, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and err.count("\n") == 1, err
