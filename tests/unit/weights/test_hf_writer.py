"""The streaming HF export: tensors written one at a time in their own dtype, sharded, loadable
by transformers, no exported tensor kept alive by the writer, names checked against the source."""

import gc
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file

from megatron_sdpo.errors import CheckpointError
from megatron_sdpo.models.tiny import ensure_tiny_base
from megatron_sdpo.weights.hf_writer import INDEX_FILE, HFDirWriter, write_hf_dir


@pytest.fixture(scope="module")
def source():
    from pathlib import Path

    d = Path(ensure_tiny_base())
    return d, load_file(str(d / "model.safetensors"))


def test_a_bf16_stream_becomes_a_sharded_bf16_directory_transformers_loads(source, tmp_path):
    from transformers import AutoModelForCausalLM

    src_dir, tensors = source
    bf16 = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    shard = max(v.numel() * 2 for v in bf16.values())  # the largest tensor fills a shard: several shards
    written = write_hf_dir(iter(bf16.items()), src_dir, tmp_path / "out", tied=False, shard_bytes=shard)
    assert sorted(written) == sorted(bf16)
    out = tmp_path / "out"
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in bf16.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(out))
    loaded = model.state_dict()
    assert loaded[next(iter(bf16))].dtype == torch.bfloat16
    for name, t in bf16.items():
        assert torch.equal(loaded[name], t), name


def test_the_writer_holds_at_most_the_tensor_in_hand(source, tmp_path):
    src_dir, tensors = source
    alive = []

    def export():
        for name, t in tensors.items():
            # What an exporter yields: a fresh tensor per name (a gathered shard on a device).
            fresh = t.clone()
            alive.append(weakref.ref(fresh))
            yield name, fresh
            del fresh
            gc.collect()
            # The consumer's loop variable still names the last one until the next arrives.
            assert sum(r() is not None for r in alive) <= 1, "the writer holds exported tensors"

    written = write_hf_dir(export(), src_dir, tmp_path / "out", tied=False)
    gc.collect()
    assert len(alive) == len(tensors) and all(r() is None for r in alive)
    assert len(written) == len(tensors) and (tmp_path / "out" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"


def test_missing_or_repeated_tensors_are_checkpoint_errors(source, tmp_path):
    src_dir, tensors = source
    names = sorted(tensors)
    with pytest.raises(CheckpointError, match=f"missing \\['{names[0]}'\\]"):
        write_hf_dir(((n, tensors[n]) for n in names[1:]), src_dir, tmp_path / "a", tied=False)
    writer = HFDirWriter(tmp_path / "b", src_dir, tied=False)
    writer.add(names[0], tensors[names[0]])
    with pytest.raises(CheckpointError, match="sent twice"):
        writer.add(names[0], tensors[names[0]])
