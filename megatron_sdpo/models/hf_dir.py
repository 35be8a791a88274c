"""A cheap validity check of a Hugging Face model directory before anything loads it.

Loaders (vLLM, transformers, safetensors) fail on a corrupt directory deep inside their own code
with a traceback. `check_hf_model_dir` reads only config.json, the shard index and each
safetensors header (a few KB per file, no tensor data) and raises `CheckpointError` with one
line naming the file and what is wrong.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from megatron_sdpo.errors import CheckpointError

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# The safetensors format caps its JSON header at 100 MB; a larger length field is garbage.
MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor entries of one safetensors file ({name: {dtype, shape, data_offsets}}).

    Raises CheckpointError when the header does not parse or the tensor data it describes does
    not exactly fill the rest of the file (truncated copy, interrupted write, appended bytes).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors header (length field {n}, file {size} bytes)")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({' '.join(str(exc).split())})") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data_len = size - 8 - n
    end_max = 0
    for name, entry in tensors.items():
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = [int(d) for d in entry["shape"]]
            dtype = str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}") from None
        if not 0 <= begin <= end:
            raise CheckpointError(f"{path}: tensor {name!r} has offsets [{begin}, {end}]")
        if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype}, shape {shape}) spans {end - begin} bytes, "
                f"expected {math.prod(shape) * DTYPE_BYTES[dtype]}"
            )
        end_max = max(end_max, end)
    if end_max > data_len:
        raise CheckpointError(
            f"{path}: truncated: the header describes {end_max} bytes of tensor data, the file holds {data_len}"
        )
    if end_max < data_len:
        raise CheckpointError(f"{path}: {data_len - end_max} bytes after the last tensor (not a safetensors file)")
    return tensors


def _index_shards(index_path: Path) -> dict[str, list[str]]:
    """{shard file: [tensor names]} from a HF shard index."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(str(shard), []).append(name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index_path}: corrupt shard index ({' '.join(str(exc).split())})") from None
    return shards


def check_hf_model_dir(path: str | Path, *, weights: bool = True, what: str = "model directory") -> Path:
    """`path` as a Path once it is an HF model directory whose config parses and whose weights
    are all present with intact safetensors headers; else CheckpointError (one line).

    weights=False checks only the directory and config.json (for callers that read the
    configuration and tokenizer, never the weights).
    """
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{what} {str(path)!r} is not a local directory")
    config = p / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{what} {str(path)!r} has no config.json (not an HF model directory)")
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config}: corrupt config ({' '.join(str(exc).split())})") from None
    if not weights:
        return p
    if (p / SAFETENSORS_INDEX).is_file():
        for shard, names in _index_shards(p / SAFETENSORS_INDEX).items():
            f = p / shard
            if not f.is_file():
                raise CheckpointError(f"{what} {str(path)!r}: shard {shard} named by {SAFETENSORS_INDEX} is missing")
            absent = sorted(set(names) - set(safetensors_header(f)))
            if absent:
                raise CheckpointError(
                    f"{f}: {len(absent)} tensor(s) named by the index are absent (first: {absent[0]})"
                )
        return p
    files = sorted(p.glob("*.safetensors"))
    for f in files:
        safetensors_header(f)
    if files:
        return p
    # Legacy pickled weights: only their presence can be checked without loading them.
    if (p / BIN_INDEX).is_file():
        for shard in _index_shards(p / BIN_INDEX):
            if not (p / shard).is_file():
                raise CheckpointError(f"{what} {str(path)!r}: shard {shard} named by {BIN_INDEX} is missing")
        return p
    if (p / "pytorch_model.bin").is_file():
        return p
    raise CheckpointError(f"{what} {str(path)!r} has no weights (*.safetensors or pytorch_model.bin)")
