"""The base model's eval row, shared by the runs that would each compute the same one.

Every run of a study starts by evaluating the base model. With greedy evaluation on the same
items, every arm and seed computes the same row: on SmolLM2's exhaustive compact math splits
(3,649 items) that is minutes a run. `eval.base_row_cache: DIR` (the study sets it to
`OUT/base_rows`) keeps each row once, under a key of everything that determines it: the model
directory's config and weight files (names and sizes), the eval items, the eval settings, the
engine and, where evaluation samples, the seed. A run finds its row there or evaluates it and
writes it (atomically: two runs starting together both evaluate, one file results).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from megatron_sdpo.config.construction import to_dict


def _model_identity(model_path: str) -> dict[str, Any]:
    d = Path(model_path)
    if not d.is_dir():
        return {"path": model_path}
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin", ".jinja"))
    return {
        "config": (d / "config.json").read_text() if (d / "config.json").is_file() else None,
        "files": [(p.name, p.stat().st_size) for p in files],
    }


def row_key(cfg, model_path: str, eval_sets: dict[str, list[dict]]) -> str:
    """The key of a run's base row (see the module docstring)."""
    e = {k: v for k, v in to_dict(cfg.eval).items() if k not in ("base_row_cache", "at_steps")}
    sampled = not cfg.eval.greedy
    engine = {"kind": cfg.rollout.engine, "max_model_len": cfg.rollout.max_model_len}
    if cfg.rollout.dtype not in ("auto", cfg.model.dtype):
        # Only where it differs from the model's: rows cached before the field existed stay valid.
        engine["dtype"] = cfg.rollout.dtype
    parts = {
        "model": _model_identity(model_path),
        "dtype": cfg.model.dtype,
        "chat_template_kwargs": cfg.model.chat_template_kwargs,
        "eval": e,
        "sets": {
            k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()
            for k, v in eval_sets.items()
        },
        "engine": engine,
        "sampling": {"seed": cfg.seed, "temperature": cfg.rollout.temperature} if sampled else None,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class BaseRows:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def load(self, key: str) -> tuple[dict[str, float], dict[str, list[dict]]] | None:
        """(accuracies, samples) of `key`'s row, None when no run wrote it (or it does not parse:
        then it is evaluated again and rewritten)."""
        try:
            data = json.loads((self.root / f"{key}.json").read_text())
            return {k: float(v) for k, v in data["accuracies"].items()}, data["samples"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def store(self, key: str, accs: dict[str, float], samples: dict[str, list[dict]]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"accuracies": accs, "samples": samples}))
        os.replace(tmp, self.root / f"{key}.json")
