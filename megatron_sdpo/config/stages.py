"""Per-stage settings: a stage may override parts of the run's `algorithm`, `teacher` and
`backend` sections (e.g. the reference's rich-feedback code recipe: EMA 0.01, alpha 1, top-k 20).

    stages:
      - {domain: code, steps: 200, teacher: {ema_rate: 0.01}, algorithm: {sdpo: {alpha: 1.0, topk: 20}}}

or on the command line `stages.3.teacher.ema_rate=0.01`. The overrides are validated like the
rest of the config when it is loaded (config/validation.py; an unknown key is a ConfigError
naming `stages.<i>.<section>.<key>`) and applied by the continual loop at the stage start. Settings
that fix what the backend builds (the algorithm's name, the teacher mode, the backend and its
parallel layout) cannot change between stages.
"""

from __future__ import annotations

import dataclasses

from megatron_sdpo.config.construction import build, to_dict
from megatron_sdpo.config.presets import deep_merge
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.errors import ConfigError

SECTIONS = ("algorithm", "teacher", "backend")
# Top-level keys of each section a stage may set (None: all but those in _FIXED).
_ALLOWED = {
    "algorithm": None,
    "teacher": ("ema_rate", "freeze_fraction", "reset_at_stage"),
    "backend": ("lr", "lr_schedule", "weight_decay", "grad_clip", "stage_start"),
}
_FIXED = {"algorithm": ("name",)}


def _check_allowed(section: str, over: dict, where: str) -> None:
    allowed = _ALLOWED[section]
    for key in over:
        if key in _FIXED.get(section, ()) or (allowed is not None and key not in allowed):
            ok = "everything but " + ", ".join(_FIXED[section]) if allowed is None else ", ".join(allowed)
            raise ConfigError(f"{where}.{key} cannot change between stages (a stage may set: {ok})")


def stage_config(cfg: RunConfig, i: int) -> RunConfig:
    """The configuration stage `i` runs with: the run's config with the stage's overrides merged
    into its sections (and no per-stage overrides left in `stages`); `cfg` itself when the
    stage overrides nothing. ConfigError naming the dotted key when an override is unknown, not
    allowed per stage, or of the wrong type (its values are checked by config/validation.py)."""
    stage = cfg.stages[i]
    changes = {}
    for section in SECTIONS:
        over = getattr(stage, section)
        if not over:
            continue
        where = f"stages.{i}.{section}"
        if not isinstance(over, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(over).__name__}")
        base = getattr(cfg, section)
        changes[section] = build(type(base), deep_merge(to_dict(base), over), where)
        _check_allowed(section, over, where)
    if not changes:
        return cfg
    plain = [dataclasses.replace(s, algorithm={}, teacher={}, backend={}) for s in cfg.stages]
    return dataclasses.replace(cfg, stages=plain, **changes)
