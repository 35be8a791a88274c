"""The drift command on tiny random HF Qwen3 checkpoints, and its one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_sdpo.cli import main as cli_main
from megatron_sdpo.diagnostics.drift import checkpoint_drift
from megatron_sdpo.models.random_qwen3 import hf_shape


def main(argv):
    """`megatron-sdpo drift ARGS`."""
    return cli_main(["drift", *argv])


TINY = dict(
    hf_shape(vocab=96, hidden=64, ffn=96, layers=2, heads=2, kv=1, head_dim=32),
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def _tiny_pair(tmp_path: Path, *, scale: float = 0.05, vocab_size: int = 96, tokenizer=None):
    """Two tiny Qwen3 checkpoints: `a` random, `b` = `a` plus noise on the layer-1 MLP and q_proj."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**{**TINY, "vocab_size": vocab_size})
    model = Qwen3ForCausalLM(cfg).float()
    paths = []
    for name in ("a", "b"):
        if name == "b":
            with torch.no_grad():
                layer = model.model.layers[1]
                for w in (layer.mlp.up_proj.weight, layer.mlp.down_proj.weight, layer.self_attn.q_proj.weight):
                    w.add_(scale * torch.randn_like(w) * w.abs().mean())
        out = tmp_path / name
        model.save_pretrained(str(out))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
        paths.append(out)
    return paths


def test_cli_writes_drift_json_and_pngs(tmp_path, capsys):
    a, b = _tiny_pair(tmp_path)
    out = tmp_path / "drift"
    rc = main([str(a), str(b), "--out", str(out), "--rank", "4", "--overlap-with", str(a), str(b)])
    assert rc == 0
    assert "drift.json" in capsys.readouterr().out
    res = json.loads((out / "drift.json").read_text())
    changed = {r["name"]: r for r in res["matrices"] if r["rel_frob"] > 0}
    assert sorted(changed) == [
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    assert res["by_layer"]["0"]["all"]["rel_frob_pooled"] == 0.0
    assert res["by_layer"]["1"]["up_proj"]["mean_spectral_shift"] > 0
    assert res["by_type"]["k_proj"]["mean_angle_max_deg"] < 1e-3
    assert set(res["by_type"]) >= {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "embed",
        "lm_head",
    }
    assert res["vectors_by_type"]["norm"]["rel_frob_pooled"] == 0.0
    assert res["mask_overlap"]["summary"]["jaccard_pooled"] == 1.0  # an update against itself
    for png in res["plots"]:
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert set(res["plots"]) == {
        "rel_frob_per_layer.png",
        "spectral_shift_per_layer.png",
        "angle_per_layer.png",
        "drift_by_type.png",
    }


def test_library_call_matches_cli_and_grows_with_noise(tmp_path):
    small = checkpoint_drift(*_tiny_pair(tmp_path / "s", scale=0.01), out_dir=tmp_path / "o1", plots=False)
    large = checkpoint_drift(*_tiny_pair(tmp_path / "l", scale=0.2), out_dir=tmp_path / "o2", plots=False)
    assert small["plots"] == [] and (tmp_path / "o1" / "drift.json").exists()
    lo, hi = small["by_type"]["up_proj"], large["by_type"]["up_proj"]
    assert hi["rel_frob_pooled"] > 5 * lo["rel_frob_pooled"] > 0
    assert hi["mean_spectral_shift"] > lo["mean_spectral_shift"] > 0
    assert hi["mean_angle_mean_deg"] > lo["mean_angle_mean_deg"] > 0


def _one_line_error(capsys):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_missing_checkpoint_one_line_error(tmp_path, capsys):
    a, _ = _tiny_pair(tmp_path)
    capsys.readouterr()  # drop save_pretrained's progress bar
    assert main([str(a), str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "checkpoint not found" in _one_line_error(capsys)
    assert not (tmp_path / "o" / "drift.json").exists()


def test_truncated_safetensors_one_line_error(tmp_path, capsys):
    a, b = _tiny_pair(tmp_path)
    f = b / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    capsys.readouterr()
    assert main([str(a), str(b), "--out", str(tmp_path / "o")]) == 2
    assert "corrupt checkpoint shard" in _one_line_error(capsys)


def test_drift_command_runs_as_subprocess(tmp_path):
    a, _ = _tiny_pair(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_sdpo",
            "drift",
            str(a),
            str(tmp_path / "missing"),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: checkpoint not found") and proc.stderr.count("\n") == 1


def _tokenizer():
    """A byte-level BPE tokenizer trained in milliseconds on synthetic probe prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_sdpo.data.synthetic import generate

    corpus = [r["prompt"] + "\n" + r["solution"] for d in ("math", "science") for r in generate(d, "train", 20, 0)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def test_probe_response_drift_identical_and_perturbed(tmp_path):
    from test_response_drift import CharHistogramEmbedder

    from megatron_sdpo.diagnostics.probes import probe_drift

    tok = _tokenizer()
    a, b = _tiny_pair(tmp_path, scale=3.0, vocab_size=len(tok), tokenizer=tok)
    kw = dict(domains=["math", "science"], n=2, seed=0, max_new_tokens=8, embedder=CharHistogramEmbedder())
    same = probe_drift(a, a, **kw)
    assert same["math"]["cosine_mean"] == pytest.approx(1.0, abs=1e-6) and same["all"]["mmd"] < 1e-6
    assert same["all"]["kl_k1"] == 0.0 and same["all"]["kl_k3"] == 0.0 and same["all"]["kl_tokens"] > 0
    moved = probe_drift(a, b, **kw)
    assert moved["all"]["kl_k3"] > 0 and moved["all"]["cosine_mean"] < 1.0
    assert moved["science"]["n"] == 2


def test_cli_responses_flag_with_minilm(tmp_path):
    tok = _tokenizer()
    a, b = _tiny_pair(tmp_path, scale=3.0, vocab_size=len(tok), tokenizer=tok)
    out = tmp_path / "o"
    rc = main(
        [
            str(a),
            str(b),
            "--out",
            str(out),
            "--no-plots",
            "--responses",
            "--domains",
            "math",
            "--probes",
            "2",
            "--max-new-tokens",
            "8",
        ]
    )
    assert rc == 0
    res = json.loads((out / "drift.json").read_text())
    assert set(res["responses"]) == {"math"} and 0.0 < res["responses"]["math"]["kl_tokens"]
    assert -1.0 <= res["responses"]["math"]["cosine_mean"] <= 1.0
