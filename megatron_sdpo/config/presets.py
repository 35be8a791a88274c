"""Config mappings before they are typed: YAML presets with `defaults:` inheritance, their
deep merge, and dotted `a.b.c=value` overrides."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

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
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str):
    """Parse config YAML with the number rules above."""
    return yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader subclass


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
