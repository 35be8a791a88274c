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


@pytest.mark.parametrize(
    "impl, gpu, have_te, want",
    [
        ("auto", False, False, None),  # CPU: the local layers, as every CPU test builds them
        ("auto", True, True, None),  # TE where it is
        ("auto", True, False, "error"),  # a GPU without TE: refused, not a silent fallback
        ("local", True, False, False),  # asked for
        ("transformer_engine", True, True, True),
        ("transformer_engine", False, False, "error"),
    ],
)
def test_transformer_impl_refuses_a_silent_fallback(impl, gpu, have_te, want):
    from megatron_sdpo.builders import transformer_engine_wanted
    from megatron_sdpo.errors import ConfigError

    if want == "error":
        with pytest.raises(ConfigError) as err:
            transformer_engine_wanted(impl, gpu=gpu, have_te=have_te)
        msg = str(err.value)
        assert "Transformer Engine is not installed" in msg and "transformer_impl=local" in msg and "\n" not in msg
    else:
        assert transformer_engine_wanted(impl, gpu=gpu, have_te=have_te) is want


def test_local_layers_and_fp8_do_not_go_together():
    from megatron_sdpo.config import load_config
    from megatron_sdpo.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8.recipe runs through Transformer Engine"):
        load_config(
            "tiny",
            ["backend.name=megatron", "backend.megatron.transformer_impl=local", "backend.megatron.fp8.recipe=delayed"],
        )
