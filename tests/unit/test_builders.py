"""builders.make_backend: backend.packing reaches the HF backend (null means on there)."""
from types import SimpleNamespace

import pytest

from megatron_sdpo import builders
from megatron_sdpo.backends.tiny import save_tiny_qwen3
from megatron_sdpo.config.loader import load_config


@pytest.mark.parametrize("override, packing", [(None, True), ("backend.packing=false", False), ("backend.packing=true", True)])
def test_hf_backend_gets_the_packing_keys(tmp_path, override, packing):
    cfg = load_config("tiny", ["backend.pack_row_tokens=64"] + ([override] if override else []))
    backend = builders.make_backend(cfg, save_tiny_qwen3(tmp_path / "m"), SimpleNamespace(pad_token_id=0))
    assert (backend.packing, backend.pack_row_tokens) == (packing, 64)
