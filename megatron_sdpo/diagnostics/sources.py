"""Tensor sources: stream (name, tensor) pairs from checkpoints, state dicts or a backend.

Drift diagnostics never hold a whole model. A source is read one tensor at a time:

* a directory written by HF ``save_pretrained`` (``*.safetensors``, possibly sharded with a
  ``model.safetensors.index.json``) or a single ``.safetensors`` file -- opened lazily with
  ``safetensors.safe_open``, so only the tensor being read is materialized;
* a ``Mapping[str, Tensor]`` (an in-memory state dict, small models and tests);
* any iterable of ``(name, tensor)`` pairs, e.g. ``Backend.export_weights()`` of a Megatron
  backend that gathers TP/PP shards into full HF-named tensors one at a time.

``iter_tensors(source)`` walks one source; ``AlignedTensors(sources)`` walks several in step,
matching tensors by name, so per-tensor metrics can be computed with a memory peak of a few
copies of the largest tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol, cast, runtime_checkable

import torch

from megatron_sdpo.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


@runtime_checkable
class TensorSource(Protocol):
    """Random-access source: names known up front, tensors read on demand."""

    label: str

    def names(self) -> list[str]:
        """All tensor names, in storage order."""

    def get(self, name: str) -> torch.Tensor:
        """The full tensor `name` (a fresh CPU tensor in its stored dtype)."""


SourceLike = str | os.PathLike | TensorSource | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


class SafetensorsCheckpoint:
    """A HF checkpoint directory (or one ``.safetensors`` file), read one tensor at a time.

    Opening validates the layout: the path exists, it holds safetensors files, every shard
    named by the index exists, and every shard's header parses and covers the file (a
    truncated file fails here with `CheckpointError`, not half-way through a drift run).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.label = str(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint not found: {self.path}")
        files = self._shard_files()
        from safetensors import safe_open

        self._handles = {}
        self._where: dict[str, Path] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except Exception as exc:  # SafetensorError, OSError: both mean an unusable shard
                raise CheckpointError(f"corrupt checkpoint shard {f}: {_one_line(exc)}") from None
            self._handles[f] = handle
            for name in handle.keys():
                if name in self._where:
                    raise CheckpointError(f"tensor {name} appears in two shards of {self.path}")
                self._where[name] = f
        if not self._where:
            raise CheckpointError(f"checkpoint {self.path} holds no tensors")
        if self._index is not None:
            missing = sorted(set(self._index) - set(self._where))
            if missing:
                raise CheckpointError(
                    f"checkpoint {self.path}: {len(missing)} tensor(s) listed in {INDEX_FILE} "
                    f"are absent from the shards (first: {missing[0]})"
                )

    def _shard_files(self) -> list[Path]:
        self._index: dict[str, str] | None = None
        if self.path.is_file():
            if self.path.suffix != ".safetensors":
                raise CheckpointError(f"not a safetensors file: {self.path}")
            return [self.path]
        index_path = self.path / INDEX_FILE
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"corrupt index {index_path}: {_one_line(exc)}") from None
            self._index = dict(weight_map)
            files = []
            for shard in dict.fromkeys(weight_map.values()):
                f = self.path / shard
                if not f.exists():
                    raise CheckpointError(f"checkpoint {self.path}: shard {shard} named by the index is missing")
                files.append(f)
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in checkpoint directory {self.path}")
        return files

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the header, without reading the data."""
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except KeyError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read {name} from {self.path}: {_one_line(exc)}") from None


class MappingSource:
    """A state dict (name -> tensor) as a random-access source."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], label: str = "state_dict"):
        self._tensors = tensors
        self.label = label

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


class StreamSource:
    """A one-pass stream of (name, tensor) pairs, e.g. a backend's ``export_weights()``."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]], label: str = "stream"):
        self._pairs = pairs
        self.label = label
        self._used = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._used:
            raise RuntimeError(f"tensor stream {self.label} can only be read once")
        self._used = True
        for item in self._pairs:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"tensor stream {self.label} must yield (name, tensor) pairs, got {type(item)}")
            yield item
            del item  # drop our reference before the producer materializes the next tensor


def open_source(source: SourceLike, label: str | None = None) -> TensorSource | StreamSource:
    """Wrap anything tensor-like into a `TensorSource` (random access) or `StreamSource`."""
    if isinstance(source, (str, os.PathLike)):
        return SafetensorsCheckpoint(source)
    if isinstance(source, (SafetensorsCheckpoint, MappingSource, StreamSource)):
        return source
    if isinstance(source, Mapping):
        return MappingSource(source, label or "state_dict")
    if isinstance(source, TensorSource):
        return source
    if isinstance(source, Iterable):
        return StreamSource(source, label or "stream")
    raise TypeError(f"cannot read tensors from {type(source).__name__}")


def iter_tensors(source: SourceLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from any source, one tensor materialized at a time."""
    src = open_source(source)
    if isinstance(src, StreamSource):
        yield from src
        return
    for name in src.names():
        yield name, src.get(name)


class AlignedTensors:
    """Walk several sources in step: yields ``(name, [tensor per source])`` for names all hold.

    Random-access sources are joined by name. Streams (at most the order of one model's
    export) are walked in lock-step and must present the same names in the same order; this
    holds for exports of the same architecture and keeps the memory peak at one tensor per
    source. Names absent from some source are skipped and listed in `missing` (source label ->
    names it lacks) once iteration has finished.
    """

    def __init__(self, sources: Sequence[SourceLike], labels: Sequence[str] | None = None):
        if not sources:
            raise ValueError("AlignedTensors needs at least one source")
        self.sources = [open_source(s) for s in sources]
        self.labels = list(labels) if labels is not None else [s.label for s in self.sources]
        self.missing: dict[str, list[str]] = {lab: [] for lab in self.labels}

    def __iter__(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        stream_src = {i: s for i, s in enumerate(self.sources) if isinstance(s, StreamSource)}
        keyed_src = {i: s for i, s in enumerate(self.sources) if not isinstance(s, StreamSource)}
        streams, keyed = list(stream_src), list(keyed_src)
        keyed_names = {i: set(keyed_src[i].names()) for i in keyed}
        seen: set[str] = set()

        def driver() -> Iterator[tuple[str, dict[int, torch.Tensor]]]:
            if not streams:
                union = list(dict.fromkeys(n for i in keyed for n in keyed_src[i].names()))
                for name in union:
                    yield name, {}
                return
            # Manual lock-step instead of zip(): zip caches its last result tuple, which would
            # keep the previous step's tensors alive while the next ones are produced.
            iters = [iter(stream_src[i]) for i in streams]
            while True:
                maybe = [next(it, None) for it in iters]
                if all(item is None for item in maybe):
                    return
                if any(item is None for item in maybe):
                    ended = [self.labels[i] for i, item in zip(streams, maybe, strict=True) if item is None]
                    raise CheckpointError(f"tensor stream(s) {', '.join(ended)} ended before the others")
                items = cast(list[tuple[str, torch.Tensor]], maybe)
                del maybe
                names = {n for n, _ in items}
                if len(names) != 1:
                    raise CheckpointError(
                        "tensor streams are out of step: got "
                        + ", ".join(f"{self.labels[i]}={n}" for i, (n, _) in zip(streams, items, strict=True))
                    )
                yield items[0][0], {i: t for i, (_, t) in zip(streams, items, strict=True)}
                del items  # else the previous step's tensors live while the next are produced

        for name, got in driver():
            seen.add(name)
            lacking = [i for i in keyed if name not in keyed_names[i]]
            if lacking:
                for i in lacking:
                    self.missing[self.labels[i]].append(name)
                del got
                continue
            tensors = [got[i] if i in got else keyed_src[i].get(name) for i in range(len(self.sources))]
            yield name, tensors
            del tensors, got
        for i in keyed:
            extra = [n for n in keyed_src[i].names() if n not in seen]
            for j in range(len(self.sources)):
                if j != i:
                    for n in extra:
                        if n not in self.missing[self.labels[j]] and (j in streams or n not in keyed_names[j]):
                            self.missing[self.labels[j]].append(n)
