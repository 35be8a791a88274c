"""Hugging Face hub ids in `model.path`: fetched once per node into the HF cache, else read from it.

Every rank of a node resolves the id under one file lock in the cache: the first downloads, the
others wait and find the snapshot there (with `HF_HUB_OFFLINE=1`, the cache alone). The
preflight (`run --dry-run --strict`) asks whether a job could do so, without downloading.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_sdpo.errors import UserError

# owner/name as the hub spells them; a path that exists on disk is never a hub id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# What a model directory needs: config, tokenizer, safetensors weights (no .bin / .pt / GGUF copies).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def is_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and not Path(path).exists()


def cached_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory of `repo_id` in the local HF cache, None when not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def _cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def fetch(repo_id: str) -> Path:
    """The local snapshot of `repo_id`: from the cache, else downloaded once per node."""
    from filelock import FileLock
    from huggingface_hub import snapshot_download

    cache = _cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"model.path {repo_id!r}: HF cache {cache} is not writable: {exc.strerror}") from None
    with FileLock(str(cache / f".megatron_sdpo.{repo_id.replace('/', '--')}.lock")):
        found = cached_snapshot(repo_id)
        if found is not None:
            return found
        try:
            return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS))
        except Exception as exc:  # offline, gated, unknown id: one line that names the cache
            raise UserError(f"model.path {repo_id!r}: {unreachable(repo_id, exc)}") from None


def unreachable(repo_id: str, exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"not in the HF cache ({_cache_dir()}) and not downloadable here ({type(exc).__name__}: {first}); "
        f"download it where the hub is reachable (`huggingface-cli download {repo_id}`) into this cache, "
        "or set model.path to a local HF directory"
    )


def check_reachable(repo_id: str) -> str:
    """Where a job would take `repo_id` from ("HF cache" / "hub"); UserError when neither."""
    if cached_snapshot(repo_id) is not None:
        return "HF cache"
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(repo_id, timeout=20)
    except Exception as exc:  # offline mode, no network, gated without a token, unknown id
        raise UserError(f"model.path {repo_id!r}: {unreachable(repo_id, exc)}") from None
    return "hub"
