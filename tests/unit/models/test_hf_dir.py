"""check_hf_model_dir: a corrupt or incomplete HF model directory fails with one line, cheaply."""

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from megatron_sdpo.errors import CheckpointError
from megatron_sdpo.models.hf_dir import check_hf_model_dir, safetensors_header


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    save_file({"a": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(d / "model.safetensors"))
    return d


@pytest.fixture
def sharded_dir(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file({"a": torch.ones(2)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2)}, str(d / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def test_intact_directories_pass(model_dir, sharded_dir):
    assert check_hf_model_dir(model_dir) == model_dir
    assert check_hf_model_dir(sharded_dir) == sharded_dir
    assert set(safetensors_header(model_dir / "model.safetensors")) == {"a", "b"}


def test_the_shipped_tiny_base_passes():
    from megatron_sdpo.models.tiny import SHIPPED_DIR

    check_hf_model_dir(SHIPPED_DIR)


@pytest.mark.parametrize("cut", [1, 7, 100])
def test_truncated_weights(model_dir, cut):
    f = model_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - cut] if cut < len(data) else data[:4])
    with pytest.raises(CheckpointError, match="truncated|corrupt safetensors header"):
        check_hf_model_dir(model_dir)


def test_trailing_bytes(model_dir):
    f = model_dir / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"\0" * 16)
    with pytest.raises(CheckpointError, match="16 bytes after the last tensor"):
        check_hf_model_dir(model_dir)


@pytest.mark.parametrize(
    "payload, needle",
    [
        (b"\xff" * 64, "corrupt safetensors header \\(length field"),  # a huge length field
        (struct.pack("<Q", 10) + b"not json!!" + b"\0" * 8, "corrupt safetensors header"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (b"abc", "no header"),
    ],
)
def test_garbage_header(model_dir, payload, needle):
    (model_dir / "model.safetensors").write_bytes(payload)
    with pytest.raises(CheckpointError, match=needle):
        check_hf_model_dir(model_dir)


def test_entry_whose_size_disagrees_with_its_shape(model_dir):
    header = json.dumps({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    (model_dir / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match="spans 8 bytes, expected 12"):
        check_hf_model_dir(model_dir)


def test_missing_shard_and_missing_tensor(sharded_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(sharded_dir, other)
    (sharded_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors named by .* is missing"):
        check_hf_model_dir(sharded_dir)
    index = json.loads((other / "model.safetensors.index.json").read_text())
    index["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="1 tensor\\(s\\) named by the index are absent \\(first: c\\)"):
        check_hf_model_dir(other)
    (other / "model.safetensors.index.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="corrupt shard index"):
        check_hf_model_dir(other)


def test_config_and_weights_presence(model_dir, tmp_path):
    with pytest.raises(CheckpointError, match="is not a local directory"):
        check_hf_model_dir(tmp_path / "nope")
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt config"):
        check_hf_model_dir(model_dir)
    (model_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        check_hf_model_dir(model_dir)
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").unlink()
    assert check_hf_model_dir(model_dir, weights=False) == model_dir  # config-only callers
    with pytest.raises(CheckpointError, match="has no weights"):
        check_hf_model_dir(model_dir)
