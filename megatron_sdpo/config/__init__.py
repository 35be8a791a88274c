"""Typed configuration: dataclass schema, YAML presets and dotted overrides."""
from megatron_sdpo.config.loader import dump_yaml, list_presets, load_config, to_dict
from megatron_sdpo.config.schema import DOMAINS, EVAL_SPLITS, RunConfig

__all__ = ["DOMAINS", "EVAL_SPLITS", "RunConfig", "dump_yaml", "list_presets", "load_config", "to_dict"]
