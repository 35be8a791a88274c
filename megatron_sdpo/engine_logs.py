"""Where the engines' own log lines go: `<run>/logs/engine.log`, unless `--verbose`.

vLLM logs several INFO/WARNING lines per training step (weight reloads, prefix-cache resets)
and transformers, megatron-core and torch add their own: hundreds of lines around the run's
progress. The run's terminal shows the run; the engines' lines stay in a file beside it.

vLLM configures its "vllm" logger once per process at import, from a `logging.config.dictConfig`
JSON file named by VLLM_LOGGING_CONFIG_PATH (its documented way to redirect its logs; the
engine re-reads the same setting when it starts). `route_engine_logs` writes that file and sets
the variable before vLLM is imported, and applies the same configuration at once so that a
vLLM already imported in this process (tests) and the other libraries follow it too.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import re
from pathlib import Path

# Library loggers kept out of the terminal. Children ("vllm.engine", ...) inherit the handler.
ENGINE_LOGGERS = ("vllm", "transformers", "megatron", "torch.distributed", "py.warnings")
LOG_FILE = "engine.log"
VLLM_CONFIG_FILE = "vllm_logging.json"
_set_by_us: str | None = None  # the VLLM_LOGGING_CONFIG_PATH this module set (a later run replaces it)


# Loggers that repeat the same lines at every refit (and every bucket of one): the layer-wise
# reload's note on modules without weights (rotary embeddings) and its timing, the prefix-cache
# reset, the CPU worker's refusal of torch.set_num_threads. engine.log keeps the first of each.
PER_REFIT_LOGGERS = (
    "vllm.model_executor.model_loader.reload",
    "vllm.v1.core.block_pool",
    "vllm.v1.worker.cpu_worker",
)


class FirstOfEachRefitLine(logging.Filter):
    """Passes a per-refit logger's line the first time its text (numbers aside) is seen."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(PER_REFIT_LOGGERS):
            return True
        key = (record.name, re.sub(r"[\d.]+", "N", record.getMessage()))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def engine_logging_config(log_file: Path) -> dict:
    """A dictConfig that sends every engine logger (INFO and above) to `log_file` only, each
    per-refit line once."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
        "filters": {"first_of_each_refit_line": {"()": f"{__name__}.FirstOfEachRefitLine"}},
        "handlers": {
            "engine_file": {
                "class": "logging.FileHandler",
                "filename": str(log_file),
                "mode": "a",
                "encoding": "utf-8",
                "formatter": "plain",
                "level": "INFO",
                "filters": ["first_of_each_refit_line"],
            }
        },
        "loggers": {
            name: {"handlers": ["engine_file"], "level": "INFO", "propagate": False} for name in ENGINE_LOGGERS
        },
    }


def route_engine_logs(run_dir: str | Path, *, verbose: bool = False) -> Path | None:
    """Send the engines' log records to `<run_dir>/logs/engine.log` (returned); with
    verbose=True leave them on the terminal and return None.

    Call before vLLM is imported (it reads VLLM_LOGGING_CONFIG_PATH then). A
    VLLM_LOGGING_CONFIG_PATH or VLLM_CONFIGURE_LOGGING=0 set by the user wins for vLLM.
    """
    if verbose:
        return None
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = logs / LOG_FILE
    config = engine_logging_config(log_file)
    vllm_config = logs / VLLM_CONFIG_FILE
    vllm_config.write_text(json.dumps(config, indent=1))
    global _set_by_us
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and os.environ.get("VLLM_LOGGING_CONFIG_PATH") in (
        None,
        _set_by_us,
    ):
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = _set_by_us = str(vllm_config)
    # Library warnings (warnings.warn) go through the "py.warnings" logger into the same file.
    logging.captureWarnings(True)
    logging.config.dictConfig(config)
    return log_file
