"""An HF model directory written from a stream of HF-named tensors, one tensor at a time.

Each tensor is copied to host memory as it arrives and written in the dtype it comes in (the
model's: bf16 for a bf16 run), in safetensors shards of at most `shard_bytes`; no model is built
and no full state dict is held, on the device or on the host. Config and tokenizer files come
from the model directory the run started from (config's dtype set to what was written); the
tensor names are checked against that directory's own safetensors headers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_sdpo.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
# Host memory the writer holds at most (one shard being filled); HF's own default is 5 GB.
SHARD_BYTES = 4 << 30
_TOKENIZER_FILES = ("chat_template.jinja", "vocab.json", "merges.txt", "generation_config.json")


def source_tensor_names(model_dir: str | Path) -> set[str]:
    """The tensor names in a model directory's safetensors files (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            names.update(h.keys())
    return names


class HFDirWriter:
    """Write `out_dir` from tensors added one at a time; `close()` finishes the directory."""

    def __init__(self, out_dir: str | Path, source_dir: str | Path, *, tied: bool, shard_bytes: int = SHARD_BYTES):
        self.out = Path(out_dir)
        self.source = Path(source_dir)
        self.tied = tied
        self.shard_bytes = shard_bytes
        self.out.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self._total = 0
        self._dtypes: set[torch.dtype] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise CheckpointError(f"HF export: tensor {name!r} sent twice")
        self._names.add(name)
        # A copy on the host: the device tensor can go as soon as the exporter drops it.
        host = tensor.detach().to("cpu", copy=True).contiguous()
        nbytes = host.numel() * host.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        self._pending[name] = host
        self._pending_bytes += nbytes
        self._total += nbytes
        self._dtypes.add(host.dtype)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(
            self._pending, str(self.out / f".shard-{len(self._shards):05d}.safetensors"), metadata={"format": "pt"}
        )
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, the index, config and tokenizer files; the names written."""
        if self._pending:
            self._flush()
        written = [n for s in self._shards for n in s]
        expected = source_tensor_names(self.source)
        missing = sorted(expected - set(written) - ({"lm_head.weight"} if self.tied else set()))
        unexpected = sorted(set(written) - expected)
        if missing or unexpected:
            raise CheckpointError(
                f"HF export and {self.source} disagree: missing {missing[:4]}, unexpected {unexpected[:4]}"
            )
        n = len(self._shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            (self.out / f".shard-{i:05d}.safetensors").rename(self.out / final)
        if n > 1:
            index = {
                "metadata": {"total_size": self._total},
                "weight_map": {t: names[i] for i, s in enumerate(self._shards) for t in s},
            }
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        self._write_config()
        for f in self.source.iterdir():
            if f.is_file() and ("token" in f.name or f.name in _TOKENIZER_FILES):
                shutil.copyfile(f, self.out / f.name)
        return written

    def _write_config(self) -> None:
        config = json.loads((self.source / "config.json").read_text())
        if len(self._dtypes) == 1:
            dtype = str(next(iter(self._dtypes))).removeprefix("torch.")
            config["dtype"] = dtype
            if "torch_dtype" in config:
                config["torch_dtype"] = dtype
        (self.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_hf_dir(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    source_dir: str | Path,
    out_dir: str | Path,
    *,
    tied: bool,
    shard_bytes: int = SHARD_BYTES,
) -> list[str]:
    """Stream `named_tensors` into an HF model directory at `out_dir` (see HFDirWriter)."""
    writer = HFDirWriter(out_dir, source_dir, tied=tied, shard_bytes=shard_bytes)
    for name, t in named_tensors:
        writer.add(name, t)
    return writer.close()
