"""builders.make_backend: backend.packing and share_prompts reach the HF backend (null means on
there; shared prompts only with packing)."""

from types import SimpleNamespace

import pytest

from megatron_sdpo import builders
from megatron_sdpo.config.loader import load_config
from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3


@pytest.mark.parametrize(
    "override, packing, share",
    [
        (None, True, True),
        ("backend.packing=false", False, False),
        ("backend.packing=true", True, True),
        ("backend.share_prompts=false", True, False),
        ("backend.packing=false backend.share_prompts=null", False, False),
    ],
)
def test_hf_backend_gets_the_packing_keys(tmp_path, override, packing, share):
    cfg = load_config("tiny", ["backend.pack_row_tokens=64"] + (override.split(" ") if override else []))
    backend = builders.make_backend(cfg, save_tiny_qwen3(tmp_path / "m"), SimpleNamespace(pad_token_id=0))
    assert (backend.packing, backend.pack_row_tokens, backend.share_prompts) == (packing, 64, share)


@pytest.mark.megatron
@pytest.mark.parametrize(
    "override, packing", [(None, None), ("backend.packing=false", False), ("backend.packing=true", True)]
)
def test_megatron_backend_gets_packing_unresolved(monkeypatch, override, packing):
    """null reaches the megatron backend as None: it packs wherever the model's layers take
    packed rows (not Olmo's), which only the model's config tells."""
    import megatron_sdpo.backends.megatron as mb

    seen = {}
    monkeypatch.setattr(mb, "MegatronBackend", lambda path, **kw: seen.update(kw) or SimpleNamespace(**kw))
    cfg = load_config("tiny", ["backend.name=megatron"] + (override.split(" ") if override else []))
    builders._megatron_backend(cfg, "unused", {})
    assert seen["packing"] is packing
