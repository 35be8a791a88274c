"""Study arms: named sets of config overrides applied on top of the study's preset.

The paper's arms are built in (`BUILTIN_ARMS`); user arms come from a YAML file
(`--arms-file`) or the command line (`--arm NAME:key=value,key=value`). Every arm is checked
by the normal config loader before anything runs, so a bad key is one `error:` line.

YAML form (a mapping of arm names; `arms:` at the top is optional):

    arms:
      sdpo_frozen_a1:
        extends: sdpo_frozen          # start from another arm's overrides (optional)
        overrides: {algorithm.sdpo.alpha: 1.0}   # or a list: ["algorithm.sdpo.alpha=1.0"]
        restart_every: 20             # restart-and-freeze period in steps (optional)
        description: SDPO_0 with reverse KL
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_sdpo.errors import ConfigError, UserError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$")


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...] = ()
    # Restart-and-freeze period in steps: each stage gets teacher.freeze_fraction =
    # min(1, restart_every / its steps), whatever the stage lengths (the paper matches gamma to
    # the EMA horizon 1 / rate: gamma 40% <-> rate 5% on its 50-step stages).
    restart_every: int | None = None
    # A config ref that replaces the study's preset for this arm (compare's `<preset>_<algo>`).
    preset: str | None = None
    description: str = ""


BUILTIN_ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("grpo", ("algorithm.name=grpo",), description="GRPO, one optimizer step per rollout"),
        Arm(
            "grpo_mb4",
            ("algorithm.name=grpo", "algorithm.grpo.mini_batches=4"),
            description=(
                "GRPO with 4 optimizer mini-batches per rollout (the paper's baseline: 32 prompts in mini-batches of 8)"
            ),
        ),
        Arm(
            "sdpo_frozen",
            ("algorithm.name=sdpo", "teacher.mode=frozen"),
            description=(
                "SDPO₀: the teacher is the student at each stage start, frozen (the paper's main continual arm)"
            ),
        ),
        Arm(
            "sdpo_ema5",
            ("algorithm.name=sdpo", "teacher.mode=ema", "teacher.ema_rate=0.05", "teacher.reset_at_stage=stage_start"),
            description=(
                "SDPO with a 5% EMA teacher reset to the student at each stage start (the paper's collapse arm)"
            ),
        ),
        Arm(
            "stable_sdpo",
            ("algorithm.name=stable_sdpo", "teacher.mode=restart_freeze"),
            restart_every=20,
            description="StableSDPO: restart-and-freeze every 20 steps, the 5% EMA's horizon 1/0.05",
        ),
        Arm(
            "sdpo_feedback_off",
            ("algorithm.name=sdpo", "teacher.mode=frozen", "algorithm.sdpo.context.use_feedback=false"),
            description="SDPO₀ without verifier feedback in any domain (the feedback factor)",
        ),
        Arm(
            "sdpo_gate",
            ("algorithm.name=sdpo", "teacher.mode=frozen", "algorithm.sdpo.contrast_gate=0"),
            description="SDPO₀ with the binary contrast gate: no distillation in a group whose rewards all agree "
            "(algorithms/safeguards.py; set algorithm.sdpo.contrast_gate=s0 for the graded gate)",
        ),
        Arm(
            "sdpo_agree",
            ("algorithm.name=sdpo", "teacher.mode=frozen", "algorithm.sdpo.agreement_mask=true"),
            description="SDPO₀ with the advantage-agreement mask: a token is distilled only where the teacher's "
            "log-ratio has the sign of the sample's advantage",
        ),
        Arm(
            "hybrid_frozen",
            ("algorithm.name=hybrid", "teacher.mode=frozen"),
            description="the λ-hybrid, λ GRPO + (1 − λ) SDPO₀ (algorithm.sdpo.hybrid_lambda, 0.5), frozen teacher",
        ),
        Arm(
            "sdpo_old_defaults",
            (
                "algorithm.name=sdpo",
                "teacher.mode=ema",
                "teacher.ema_rate=0.05",
                "teacher.reset_at_stage=none",
                "algorithm.sdpo.context.feedback_domains=[math,science,tooluse,code]",
                "algorithm.sdpo.context.feedback_only_without_solution=false",
                "algorithm.grpo.norm_by_std=true",
            ),
            description="positive control: this project's first defaults, which collapsed on tiny (feedback on every "
            "failed answer in every domain, a 5% EMA teacher never reset, advantages ÷ std)",
        ),
    )
}


def _check_name(name: str, where: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise UserError(f"{where}: arm name {name!r} must be letters, digits, '_' or '-' (it names a directory)")
    return name


def _render(value: Any) -> str:
    """A YAML value as override text (`apply_override` parses it back as YAML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float, str)):
        return str(value)
    return json.dumps(value)  # JSON is YAML flow syntax


def _overrides(raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, dict):
        return tuple(f"{k}={_render(v)}" for k, v in raw.items())
    if isinstance(raw, list) and all(isinstance(x, str) and "=" in x for x in raw):
        return tuple(raw)
    raise UserError(f"{where}.overrides: expected a mapping of dotted keys or a list of key=value strings")


def _derive(name: str, spec: dict, known: dict[str, Arm], where: str) -> Arm:
    unknown = set(spec) - {"extends", "overrides", "restart_every", "description"}
    if unknown:
        raise UserError(
            f"{where}: unknown arm field(s) {', '.join(sorted(unknown))} "
            "(an arm has extends, overrides, restart_every, description)"
        )
    parent = None
    if spec.get("extends") is not None:
        parent = known.get(str(spec["extends"]))
        if parent is None:
            raise UserError(f"{where}.extends: unknown arm {spec['extends']!r}; known: {', '.join(known)}")
    every = spec.get("restart_every", parent.restart_every if parent else None)
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise UserError(f"{where}.restart_every: expected a positive integer, got {every!r}")
    return Arm(
        name,
        (parent.overrides if parent else ()) + _overrides(spec.get("overrides"), where),
        restart_every=every,
        description=str(spec.get("description", f"{parent.name} + overrides" if parent else "user arm")),
    )


def load_arms_file(path: str | Path, known: dict[str, Arm]) -> dict[str, Arm]:
    """User arms from a YAML file (module docstring); UserError naming the file on a mistake."""
    from megatron_sdpo.config.presets import parse_yaml

    p = Path(path)
    try:
        data = parse_yaml(p.read_text())
    except OSError as exc:
        raise UserError(f"--arms-file {p}: cannot read ({exc.strerror})") from None
    except Exception as exc:  # yaml.YAMLError; yaml is typed Any here
        raise UserError(f"--arms-file {p}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if isinstance(data, dict) and set(data) == {"arms"}:
        data = data["arms"]
    if not isinstance(data, dict) or not data:
        raise UserError(f"--arms-file {p}: expected a mapping of arm names to arms")
    out: dict[str, Arm] = {}
    for name, spec in data.items():
        where = f"{p}: {name}"
        _check_name(name, str(p))
        if name in known or name in out:
            raise UserError(f"{where}: arm {name!r} is already defined (built-in arms: {', '.join(BUILTIN_ARMS)})")
        if not isinstance(spec, dict):
            raise UserError(f"{where}: expected a mapping (extends, overrides, restart_every, description)")
        out[name] = _derive(name, spec, {**known, **out}, where)
    return out


def parse_arm_option(text: str, known: dict[str, Arm]) -> Arm:
    """`NAME:key=value,key=value` (a key `extends` names the arm to start from)."""
    name, sep, body = text.partition(":")
    where = f"--arm {text}"
    if not sep:
        raise UserError(f"{where}: expected NAME:key=value,key=value")
    _check_name(name, where)
    if name in known:
        raise UserError(f"{where}: arm {name!r} is already defined")
    pairs = [x.strip() for x in body.split(",") if x.strip()]
    bad = [x for x in pairs if "=" not in x]
    if bad:
        raise UserError(f"{where}: {bad[0]!r} is not key=value")
    spec: dict[str, Any] = {"overrides": [x for x in pairs if not x.startswith(("extends=", "restart_every="))]}
    for x in pairs:
        key, _, value = x.partition("=")
        if key in ("extends", "restart_every"):
            spec[key] = int(value) if key == "restart_every" and value.isdigit() else value
    return _derive(name, spec, known, where)


def select_arms(names: str, user: dict[str, Arm]) -> list[Arm]:
    """The arms named in `--arms A,B,...` (built-in or user), in that order."""
    known = {**BUILTIN_ARMS, **user}
    picked = [x.strip() for x in names.split(",") if x.strip()]
    if not picked:
        raise UserError(f"--arms needs at least one arm; known: {', '.join(known)}")
    for name in picked:
        if name not in known:
            raise UserError(f"unknown arm {name!r}; known: {', '.join(known)} (or define one with --arm / --arms-file)")
    if len(set(picked)) != len(picked):
        raise UserError(f"--arms names an arm twice: {names}")
    return [known[n] for n in picked]


def arm_overrides(arm: Arm, preset: str, study_overrides: list[str], seed: int | None) -> tuple[str, list[str]]:
    """(config ref, overrides) of one run of `arm`: the arm's overrides, then the study's, then
    the seed and the restart periods; validated by the config loader (ConfigError naming the
    arm on a bad key)."""
    from megatron_sdpo.config import load_config

    ref = arm.preset or preset
    ovs = [*arm.overrides, *study_overrides, *([f"seed={seed}"] if seed is not None else [])]
    try:
        cfg = load_config(ref, ovs)
        if arm.restart_every is not None:
            ovs += [
                f"stages.{k}.teacher.freeze_fraction={min(1.0, arm.restart_every / max(st.steps, 1))!r}"
                for k, st in enumerate(cfg.stages)
            ]
            load_config(ref, ovs)
    except ConfigError as exc:
        raise ConfigError(f"arm {arm.name}: {exc}") from None
    return ref, ovs
