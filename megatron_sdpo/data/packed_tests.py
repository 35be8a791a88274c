"""Test cases packed as base64(zlib(pickle)), read as plain data only.

LiveCodeBench's private tests and Dolci-Think-RL's synthetic2 code rows are stored that way.
Unpickling can call any importable function, so no global is resolved at all (lists, tuples,
dicts, str, numbers, bools and None need none in any protocol), and what comes out must be
JSON-like data. Two more ways a hostile blob can hurt are capped: zlib can inflate a few bytes
a thousandfold, and memo references let a small pickle describe a tree exponentially larger
than itself, which the JSON written from it would spell out.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import zlib
from typing import Any

MAX_UNPACKED_BYTES = 1 << 30
PICKLE_OPCODE = b"\x80"  # the PROTO opcode that opens every pickle of protocol 2 or later


class PackedError(ValueError):
    """A blob that is not base64(zlib(pickle or JSON)) of plain data."""


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def unpack(text: str, limit: int = MAX_UNPACKED_BYTES) -> bytes:
    """The bytes of base64(zlib(bytes)), refusing more than `limit` of them."""
    try:
        packed = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise PackedError("not base64") from None
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(packed, limit + 1)
    except zlib.error:
        raise PackedError("not zlib data") from None
    if len(raw) > limit:
        raise PackedError(f"unpacks to more than {limit} bytes")
    if not inflater.eof or inflater.unused_data:
        raise PackedError("the zlib stream is truncated or followed by other bytes")
    return raw


def _check_plain(value: Any, budget: int) -> None:
    """JSON-like data only, and no more of it than `budget` (nodes plus characters)."""
    stack, spent = [value], 0
    while stack:
        item = stack.pop()
        spent += 1
        if item is None or isinstance(item, (bool, int, float)):
            pass
        elif isinstance(item, str):
            spent += len(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, str):
                    raise PackedError(f"holds a dict key of type {type(key).__name__}, not a string")
                spent += len(key)
                stack.append(inner)
        else:
            raise PackedError(f"holds a {type(item).__name__}, which is not plain data")
        if spent > budget:
            raise PackedError("expands far beyond its own size (shared or self-referring parts)")


def load_plain(raw: bytes) -> Any:
    """The plain data a pickle holds; PackedError for a global, a malformed pickle or anything
    but lists, tuples, string-keyed dicts, str, int, float, bool and None."""
    try:
        value = _NoGlobals(io.BytesIO(raw)).load()
    except Exception as exc:  # the unpickler raises many kinds on malformed input: all named
        raise PackedError(f"not a plain-data pickle ({type(exc).__name__}: {str(exc)[:120]})") from None
    # Without sharing each node and character costs at least one byte of pickle; the factor
    # leaves room for memoised keys and strings repeated by reference, not for exponential trees.
    _check_plain(value, 16 * len(raw) + (1 << 20))
    return value


def json_text(text: str) -> str:
    """JSON text of a base64(zlib(...)) blob holding JSON, a pickled JSON string (LiveCodeBench)
    or pickled plain data (Dolci's synthetic2 rows)."""
    raw = unpack(text)
    if not raw.startswith(PICKLE_OPCODE):
        try:
            json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise PackedError("unpacks to something that is neither a pickle nor JSON") from None
        return raw.decode("utf-8")
    value = load_plain(raw)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
