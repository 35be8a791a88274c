"""The config entry point: a preset name or YAML path plus dotted overrides, merged
(config/presets.py), typed (config/construction.py) and validated (config/validation.py)."""

from __future__ import annotations

from megatron_sdpo.config.construction import build, to_dict
from megatron_sdpo.config.presets import apply_override, deep_merge, load_raw
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.config.validation import validate


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
