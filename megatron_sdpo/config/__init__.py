"""Typed configuration: dataclass schema, YAML presets and dotted overrides."""

from megatron_sdpo.config.construction import dump_yaml, to_dict
from megatron_sdpo.config.loader import load_config
from megatron_sdpo.config.presets import list_presets
from megatron_sdpo.config.schema import EVAL_SPLITS, RunConfig

__all__ = ["EVAL_SPLITS", "RunConfig", "dump_yaml", "list_presets", "load_config", "to_dict"]
