"""Typed configs from mappings: a (partial) mapping coerced into its dataclass, with unknown
keys and wrong types as errors naming the dotted key; and back to plain mappings / YAML."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

import yaml

from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.domains import DOMAINS


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
        return build(typing.cast(type, tp), value, key)
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


def to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (for YAML dumps and the run directory)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    data = to_dict(cfg)
    if isinstance(data, dict) and isinstance(data.get("domains"), dict):
        # A domain the run removed is written as null: loading this file merges it over the
        # defaults, which would otherwise bring the domain back (a resumed run then evaluated
        # sets it never trained on).
        data["domains"].update({d: None for d in DOMAINS if d not in data["domains"]})
    return yaml.safe_dump(data, sort_keys=False)
