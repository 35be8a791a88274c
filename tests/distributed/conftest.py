"""Fixtures of the multi-rank tests."""

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen3 checkpoint (HF directory) the megatron tests load on every rank."""
    from test_megatron_convert import tiny_hf

    d = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_hf("qwen3", False).save_pretrained(str(d))
    return str(d)
