"""Numeric precision of the megatron model: fp32 / bf16 parameters and the FP8 recipes.

FP8 runs through Transformer Engine's linear layers only. The LM head stays in BF16/FP32 in
every recipe: megatron's GPTModel builds `output_layer` as a plain `ColumnParallelLinear`, never
a TE module, and the loss (log-softmax, KL) is computed in fp32 by the backend. The first and
last transformer layers can be kept in BF16 (`bf16_edge_layers`), as large FP8 runs usually do.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from megatron_sdpo.errors import ConfigError, MissingDependencyError

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
# Minimum (major, minor) compute capability of each recipe, and what it is called.
_MIN_CAPABILITY = {
    "delayed": ((8, 9), "Ada/Hopper (sm_89+)"),
    "tensorwise": ((8, 9), "Ada/Hopper (sm_89+)"),
    "blockwise": ((9, 0), "Hopper (sm_90)"),
    "mxfp8": ((10, 0), "Blackwell (sm_100+)"),
}


@dataclass(frozen=True)
class PrecisionConfig:
    """params: "float32" | "bfloat16"; fp8: None or one of RECIPES (requires bfloat16 params)."""

    params: str = "float32"
    fp8: str | None = None
    bf16_edge_layers: int = 0  # transformer layers kept in BF16 at each end under FP8
    fp8_amax_history_len: int = 1024  # delayed scaling only
    fp8_param_gather: bool = False  # keep FP8 parameter copies (distributed optimizer gathers fp8)
    fp8_format: str | None = None  # "e4m3" | "hybrid"; None: the recipe's usual format

    @property
    def dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.params]


def have_transformer_engine() -> bool:
    """True when Transformer Engine can be imported (checked without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def _capability() -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


def transformer_config_fields(
    cfg: PrecisionConfig,
    *,
    have_te: bool | None = None,
    capability: tuple[int, int] | None = None,
    detect_capability: bool = True,
) -> dict:
    """The TransformerConfig keyword arguments for `cfg`, validated.

    have_te / capability default to the running machine (pass them to check a config meant for
    another machine). Errors: ConfigError for an unknown dtype/recipe or a GPU too old for the
    recipe, MissingDependencyError when FP8 is asked for without Transformer Engine.
    """
    if cfg.params not in ("float32", "bfloat16"):
        raise ConfigError(f"precision.params={cfg.params!r}; expected 'float32' or 'bfloat16'")
    fields: dict = {"params_dtype": cfg.dtype, "bf16": cfg.params == "bfloat16", "fp16": False}
    if cfg.params == "bfloat16":
        fields["pipeline_dtype"] = torch.bfloat16
    if cfg.fp8 is None:
        return fields
    if cfg.fp8 not in RECIPES:
        raise ConfigError(f"precision.fp8={cfg.fp8!r}; expected one of {RECIPES} or null")
    if cfg.params != "bfloat16":
        raise ConfigError(f"precision.fp8={cfg.fp8!r} needs precision.params='bfloat16'")
    if have_te is None:
        have_te = have_transformer_engine()
    if not have_te:
        raise MissingDependencyError(
            f"precision.fp8={cfg.fp8!r} needs Transformer Engine, which is not installed; "
            "install it with `pip install -e .[gpu]` (GPU stack only)"
        )
    if capability is None and detect_capability:
        capability = _capability()
    need, name = _MIN_CAPABILITY[cfg.fp8]
    if capability is None or tuple(capability) < need or (cfg.fp8 == "blockwise" and capability[0] != 9):
        have = "no CUDA GPU" if capability is None else f"sm_{capability[0]}{capability[1]}"
        raise ConfigError(f"precision.fp8={cfg.fp8!r} needs a {name} GPU; this machine has {have}")
    if cfg.bf16_edge_layers < 0:
        raise ConfigError(f"precision.bf16_edge_layers={cfg.bf16_edge_layers} must be >= 0")
    if cfg.bf16_edge_layers and cfg.fp8 == "delayed":
        # megatron-core rejects this pair too, but only deep inside TransformerConfig.
        raise ConfigError("precision.bf16_edge_layers needs a current-scaling recipe, not fp8='delayed'")
    fmt = cfg.fp8_format or ("hybrid" if cfg.fp8 in ("delayed", "tensorwise") else "e4m3")
    if fmt not in ("e4m3", "hybrid"):
        raise ConfigError(f"precision.fp8_format={fmt!r}; expected 'e4m3' or 'hybrid'")
    fields.update(
        fp8=fmt,
        fp8_recipe=cfg.fp8,
        fp8_param=cfg.fp8_param_gather,
        fp8_margin=0,
        fp8_amax_history_len=cfg.fp8_amax_history_len if cfg.fp8 == "delayed" else 1,
        fp8_amax_compute_algo="max" if cfg.fp8 == "delayed" else "most_recent",
    )
    if cfg.bf16_edge_layers:
        fields.update(
            first_last_layers_bf16=True,
            num_layers_at_start_in_bf16=cfg.bf16_edge_layers,
            num_layers_at_end_in_bf16=cfg.bf16_edge_layers,
        )
    return fields
