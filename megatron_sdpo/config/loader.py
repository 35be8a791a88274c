"""YAML presets with `defaults:` inheritance and dotted `a.b.c=value` overrides, turned into the
typed `RunConfig`. Unknown keys and wrong types are errors naming the dotted key."""
from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megatron_sdpo.config.algorithm_spec import algorithm_spec
from megatron_sdpo.config.schema import DOMAINS, RunConfig
from megatron_sdpo.errors import ConfigError

PRESET_DIR = Path(__file__).parent / "presets"

_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class _ConfigLoader(yaml.SafeLoader):
    """YAML 1.2 numbers: `2e-6` is a float (YAML 1.1 reads it as a string) and `24:00:00` stays
    a string (YAML 1.1 reads it as the base-60 integer 86400)."""


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"), list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def parse_yaml(text: str):
    """Parse config YAML with the number rules above."""
    return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader subclass


def list_presets() -> list[str]:
    """Names of the shipped presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _resolve_file(ref: str, relative_to: Path | None) -> Path:
    cand = Path(ref)
    if cand.suffix in (".yaml", ".yml"):
        if not cand.is_absolute() and relative_to is not None and not cand.exists():
            cand = relative_to / cand
        if not cand.exists():
            raise ConfigError(f"config file not found: {ref}")
        return cand
    preset = PRESET_DIR / f"{ref}.yaml"
    if not preset.exists():
        raise ConfigError(f"unknown preset {ref!r}; known presets: {', '.join(list_presets())}")
    return preset


def _read_yaml(path: Path) -> dict:
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a mapping at the top level")
    return data


def deep_merge(base: dict, over: dict) -> dict:
    """Recursive dict merge; `over` wins; lists and scalars are replaced, not merged; a name
    given to a section (`backend: megatron`) sets its `name` and keeps the rest."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        elif isinstance(v, str) and isinstance(out.get(k), dict):
            out[k] = {**out[k], "name": v}
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_raw(ref: str, _relative_to: Path | None = None, _seen: tuple = ()) -> dict:
    """The merged mapping of a preset name or YAML path, its `defaults:` chain applied first."""
    path = _resolve_file(ref, _relative_to)
    key = str(path.resolve())
    if key in _seen:
        raise ConfigError(f"defaults cycle through {path.name}")
    data = _read_yaml(path)
    parents = data.pop("defaults", []) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: dict = {}
    for parent in parents:
        merged = deep_merge(merged, load_raw(str(parent), path.parent, _seen + (key,)))
    return deep_merge(merged, data)


def apply_override(data: dict, override: str) -> None:
    """Apply one `a.b.c=value` override in place (value parsed as YAML: 3, 1e-4, true, [a,b]).
    A name given to a section (`backend=megatron`) sets the section's `name`."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key.path=value")
    dotted, _, raw = override.partition("=")
    dotted = dotted.strip()
    if not dotted:
        raise ConfigError(f"override {override!r} has an empty key")
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node: Any = data
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {dotted}: {where} is not a valid list index")
            idx = int(part)
            if last:
                node[idx] = value
            else:
                node = node[idx]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {'.'.join(parts[:i])} is not a section")
        if last:
            # `backend=megatron` is short for `backend.name=megatron` (the rest stays).
            node.update(deep_merge(node, {part: value}))
        else:
            node = node.setdefault(part, {})


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__}")
        return [_coerce(v, args[0], f"{key}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if tp is Any:  # per-stage partial sections: validated by config/stages.py
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")  # pragma: no cover


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """Construct dataclass `cls` from a (partial) mapping; missing fields keep their defaults."""
    where = prefix or "config"
    if isinstance(data, cls):
        return data
    if isinstance(data, str) and "name" in {f.name for f in dataclasses.fields(cls)}:
        data = {"name": data}  # a section given by its name alone: `backend: megatron`
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else str(unknown[0])
        raise ConfigError(f"unknown config key {key!r} (valid keys here: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], f"{prefix}.{name}" if prefix else name)
    return cls(**kwargs)


def validate(cfg: RunConfig) -> RunConfig:
    """Cross-field checks that types alone cannot express."""
    if not cfg.stages:
        raise ConfigError("stages: at least one stage is needed")
    for i, stage in enumerate(cfg.stages):
        if stage.domain not in cfg.domains:
            raise ConfigError(
                f"stages.{i}.domain: unknown domain {stage.domain!r}; known: {', '.join(cfg.domains)}"
            )
        if stage.steps < 0:
            raise ConfigError(f"stages.{i}.steps must be >= 0")
    for name, dcfg in cfg.domains.items():
        if name not in DOMAINS:
            raise ConfigError(f"domains.{name}: unknown domain; known: {', '.join(DOMAINS)}")
        for where, src in [("train", dcfg.train), *((f"eval.{k}", v) for k, v in dcfg.eval.items())]:
            if src.instruction is not None and src.source != "synthetic":
                raise ConfigError(f"domains.{name}.{where}.instruction applies to synthetic sources only (source: {src.source})")
            if src.instruction is not None and not src.instruction.strip():
                raise ConfigError(f"domains.{name}.{where}.instruction must be non-empty or null")
            if src.difficulty is not None:
                if src.source != "synthetic":
                    raise ConfigError(f"domains.{name}.{where}.difficulty applies to synthetic sources only (source: {src.source})")
                if isinstance(src.difficulty, bool) or not 0.0 <= float(src.difficulty) <= 1.0:
                    raise ConfigError(f"domains.{name}.{where}.difficulty must be in [0, 1] or null, got {src.difficulty!r}")
        for k, shot in enumerate(dcfg.shots):
            for part in ("user", "assistant"):
                if not getattr(shot, part).strip():
                    raise ConfigError(f"domains.{name}.shots.{k}.{part} must be non-empty text")
    a = cfg.algorithm
    spec = algorithm_spec(a.name)
    if a.group_size < 2 and spec.uses_teacher:
        raise ConfigError("algorithm.group_size must be >= 2 for SDPO (it needs siblings)")
    if a.group_size < 1 or a.prompts_per_step < 1:
        raise ConfigError("algorithm.group_size and algorithm.prompts_per_step must be >= 1")
    if not 0.0 <= a.sdpo.alpha <= 1.0:
        raise ConfigError(f"algorithm.sdpo.alpha must be in [0, 1], got {a.sdpo.alpha}")
    if a.sdpo.topk is not None and a.sdpo.topk < 1:
        raise ConfigError("algorithm.sdpo.topk must be >= 1 or null")
    if not 0.0 <= a.sdpo.hybrid_lambda <= 1.0:
        raise ConfigError("algorithm.sdpo.hybrid_lambda must be in [0, 1]")
    _validate_context(a.sdpo.context, "algorithm.sdpo.context")
    if a.grpo.mini_batches < 1:
        raise ConfigError("algorithm.grpo.mini_batches must be >= 1")
    if a.grpo.mini_batches > 1 and not spec.supports_mini_batches:
        raise ConfigError("algorithm.grpo.mini_batches > 1 needs algorithm.name=grpo")
    if a.prompts_per_step % a.grpo.mini_batches:
        raise ConfigError(
            f"algorithm.prompts_per_step={a.prompts_per_step} does not split into "
            f"algorithm.grpo.mini_batches={a.grpo.mini_batches} mini-batches of whole prompt groups"
        )
    if a.grpo.dual_clip is not None and a.grpo.dual_clip <= 1.0:
        raise ConfigError("algorithm.grpo.dual_clip must be > 1 or null")
    if spec.requires_teacher_mode and cfg.teacher.mode != spec.teacher_mode:
        raise ConfigError(f"algorithm.name={a.name} needs teacher.mode={spec.teacher_mode}")
    if not 0.0 <= cfg.teacher.ema_rate <= 1.0:
        raise ConfigError("teacher.ema_rate must be in [0, 1]")
    if not 0.0 < cfg.teacher.freeze_fraction <= 1.0:
        raise ConfigError("teacher.freeze_fraction must be in (0, 1]")
    if cfg.diagnostics.teacher_signal_every < 0:
        raise ConfigError("diagnostics.teacher_signal_every must be >= 0 (0: off)")
    r = cfg.diagnostics.collapse_min_length_ratio
    if r is not None and not 0.0 < r <= 1.0:
        raise ConfigError("diagnostics.collapse_min_length_ratio must be in (0, 1] or null")
    if cfg.backend.lr <= 0:
        raise ConfigError("backend.lr must be > 0")
    if cfg.backend.micro_batch_size < 1:
        raise ConfigError("backend.micro_batch_size must be >= 1")
    if cfg.backend.pack_row_tokens < 0:
        raise ConfigError("backend.pack_row_tokens must be >= 0 (0: one packed row per micro-batch)")
    if cfg.backend.share_prompts is True and not (cfg.backend.packed() and cfg.backend.name == "hf"):
        raise ConfigError(
            "backend.share_prompts=true needs the HF backend's packed layout (backend.packing on; "
            "megatron's THD rows cannot state the shared-prompt mask); set backend.share_prompts=false or null"
        )
    _validate_lr_schedule(cfg)
    m = cfg.backend.megatron
    if m.tensor_parallel < 1 or m.pipeline_parallel < 1:
        raise ConfigError("backend.megatron.tensor_parallel / pipeline_parallel must be >= 1")
    if isinstance(m.vocab_divisor, bool) or m.vocab_divisor < 1:
        raise ConfigError(f"backend.megatron.vocab_divisor must be >= 1, got {m.vocab_divisor!r}")
    if m.sequence_parallel and m.tensor_parallel == 1:
        raise ConfigError("backend.megatron.sequence_parallel needs tensor_parallel > 1")
    if cfg.kernel.fused_kl and spec.uses_teacher and (a.sdpo.topk is not None or a.sdpo.variant != "logits"):
        raise ConfigError(
            "kernel.fused_kl=true is the full-vocabulary path: it needs algorithm.sdpo.topk=null and variant=logits"
        )
    if cfg.backend.name == "megatron" and m.tensor_parallel > 1 and spec.uses_teacher and a.sdpo.variant == "logits":
        # Full logits are vocab-sharded under TP: the full-vocabulary distillation goes through
        # the vocab-parallel KL (top-k is computed from shards by the backend).
        if a.sdpo.topk is None and not cfg.kernel.fused_kl:
            raise ConfigError("full-vocabulary SDPO (sdpo.topk=null) with backend.megatron.tensor_parallel > 1 needs kernel.fused_kl=true")
    ro = cfg.rollout
    if not ro.temperature > 0:
        raise ConfigError(f"rollout.temperature must be > 0 (greedy evaluation is eval.greedy), got {ro.temperature}")
    if ro.tensor_parallel_size < 1:
        raise ConfigError(f"rollout.tensor_parallel_size must be >= 1, got {ro.tensor_parallel_size}")
    if ro.threads is not None and ro.threads < 1:
        raise ConfigError(f"rollout.threads must be >= 1 or null, got {ro.threads}")
    if ro.bucket_bytes is not None and ro.bucket_bytes <= 0:
        raise ConfigError(f"rollout.bucket_bytes must be > 0, got {ro.bucket_bytes}")
    if ro.guard.max_mismatch is not None:
        if not ro.guard.max_mismatch > 0:
            raise ConfigError(f"rollout.guard.max_mismatch must be > 0 or null, got {ro.guard.max_mismatch}")
        if ro.top_p != 1.0:
            raise ConfigError(
                "rollout.guard.max_mismatch compares the engine's logprobs with the trainer's, which renormalize over "
                "the whole vocabulary, not the top-p nucleus: it needs rollout.top_p=1 (or rollout.guard.max_mismatch=null)"
            )
    if m.fp8.recipe != "none" and cfg.backend.name != "megatron":
        raise ConfigError("backend.megatron.fp8.recipe needs backend.name=megatron")
    from megatron_sdpo.config.stages import stage_config

    for i in range(len(cfg.stages)):
        stage_config(cfg, i)  # per-stage overrides: known keys, allowed changes, valid values
    return cfg


def _validate_lr_schedule(cfg: RunConfig) -> None:
    """`backend.lr_schedule` (the style is a Literal, checked when built): the warmup must end
    inside every stage, counted in optimizer steps (mini_batches per rollout step)."""
    s = cfg.backend.lr_schedule
    if s.warmup_steps < 0:
        raise ConfigError(f"backend.lr_schedule.warmup_steps={s.warmup_steps} must be >= 0")
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ConfigError(f"backend.lr_schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")
    for i, stage in enumerate(cfg.stages):
        total = stage.steps * cfg.algorithm.grpo.mini_batches
        if total > 0 and s.warmup_steps >= total:
            raise ConfigError(
                f"backend.lr_schedule.warmup_steps={s.warmup_steps} must be smaller than the stage's {total} "
                f"optimizer steps (stages.{i})"
            )


def _validate_context(ctx, where: str) -> None:
    for k, d in enumerate(ctx.feedback_domains):
        if d not in DOMAINS:
            raise ConfigError(f"{where}.feedback_domains.{k}: unknown domain {d!r}; known: {', '.join(DOMAINS)}")
    if ctx.max_context_tokens is not None and ctx.max_context_tokens < 1:
        raise ConfigError(f"{where}.max_context_tokens must be >= 1 or null")
    for name in ("max_solution_chars", "max_feedback_chars"):
        v = getattr(ctx, name)
        if v is not None and v <= 3:
            raise ConfigError(f"{where}.{name} must be > 3 or null")


def load_config(ref: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Preset name or YAML path + overrides -> validated RunConfig."""
    data = deep_merge(to_dict(RunConfig()), load_raw(ref))
    for ov in overrides:
        apply_override(data, ov)
    # Mappings merge key by key, so a preset cannot otherwise drop an inherited domain: a domain
    # set to null (`domains: {code: null}`) is removed from the run (and from its eval matrix).
    if isinstance(data.get("domains"), dict):
        data["domains"] = {k: v for k, v in data["domains"].items() if v is not None}
    return validate(build(RunConfig, data))


def to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (for YAML dumps and the run directory)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
