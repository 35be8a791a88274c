"""The tiny base: a short build is deterministic; the shipped copy loads, its tokenizer
round-trips, and the base is a better teacher (with the solution in context) than student."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_sdpo.algorithms.context import build_teacher_message
from megatron_sdpo.data.synthetic import generate
from megatron_sdpo.errors import CheckpointError, ConfigError
from megatron_sdpo.interfaces.domains import DOMAINS
from megatron_sdpo.models import tiny


def _short_cfg(seed=0):
    return tiny.TinyConfig(seed=seed, steps=3, batch_size=8, n_train_per_domain=40, vocab_size=400)


def test_short_build_is_deterministic(tmp_path):
    a = tiny.build_tiny_base(tmp_path / "a", _short_cfg())
    b = tiny.build_tiny_base(tmp_path / "b", _short_cfg())
    tiny.build_tiny_base(tmp_path / "c", _short_cfg(seed=1))
    assert a["final_loss"] == b["final_loss"] and a["parameters"] == b["parameters"] > 0
    wa, wb, wc = (load_file(tmp_path / x / "model.safetensors") for x in "abc")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa if wa[k].shape == wc[k].shape)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert "lm_head.weight" in wa  # untied
    assert not list(tmp_path.glob(".tiny_base.*"))  # no temporary directory left behind


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="head_dim must be >= 32"):
        tiny.build_tiny_base(tmp_path / "x", tiny.TinyConfig(head_dim=16))
    with pytest.raises(ConfigError, match="unknown domain"):
        tiny.build_tiny_base(tmp_path / "x", tiny.TinyConfig(difficulty={"poetry": 0.1}))
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a complete tiny base"):
        tiny.ensure_tiny_base(tmp_path / "partial")


@pytest.fixture(scope="module")
def shipped():
    if not tiny.is_complete(tiny.SHIPPED_DIR):
        pytest.fail(
            "the shipped tiny base is missing: run tools/make_tiny_base.py --out megatron_sdpo/assets/tiny_base"
        )
    return tiny.load_tiny_base()


def test_shipped_model_is_small_and_shaped(shipped):
    model, tok = shipped
    assert tiny.ensure_tiny_base() == str(tiny.SHIPPED_DIR)
    size = sum(f.stat().st_size for f in Path(tiny.SHIPPED_DIR).iterdir())
    assert size < 8 * 2**20
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim, c.num_key_value_heads) == (
        128,
        4,
        4,
        32,
        2,
    )
    assert not c.tie_word_embeddings and c.vocab_size == len(tok)
    assert 600 <= len(tok) <= 1000
    # built from the records of the current generators (a bump of the version needs a rebuild)
    build = json.loads((Path(tiny.SHIPPED_DIR) / "tiny_build.json").read_text())
    assert build["recipe_version"] == tiny.RECIPE_VERSION and build["config"] == asdict(tiny.TinyConfig())


def test_shipped_tokenizer_round_trips(shipped):
    _, tok = shipped
    for d in DOMAINS:
        for r in generate(d, "ood_far", 10, seed=5):
            for text in (r["prompt"], r["solution"]):
                ids = tok(text, add_special_tokens=False)["input_ids"]
                assert tok.decode(ids) == text
    digits = tok("12345", add_special_tokens=False)["input_ids"]
    assert len(digits) == 5  # one token per digit
    ids = tiny.chat_prompt_ids(tok, "hi")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id


@pytest.mark.parametrize("domain", DOMAINS)
def test_base_teacher_beats_student_on_reference(shipped, domain):
    model, tok = shipped
    torch.set_num_threads(1)
    recs = generate(domain, "id", 12, seed=11)
    prompts = [r["prompt"] for r in recs]
    refs = [r["solution"] for r in recs]
    teacher = [build_teacher_message(r["prompt"], r["solution"], None) for r in recs]
    s = tiny.mean_response_logprob(model, tok, prompts, refs)
    t = tiny.mean_response_logprob(model, tok, teacher, refs)
    assert s.dtype == torch.float32 and s.shape == (12,)
    assert t.mean() > s.mean(), (domain, float(t.mean()), float(s.mean()))


@pytest.mark.slow
@pytest.mark.parametrize("domain", DOMAINS)
def test_base_is_calibrated_for_rl(shipped, domain):
    """RL only moves the base where it solves part of the items: neither chance-free nor saturated.
    (The shipped build measured 0.2-0.5 sampled on train; the band here leaves room for noise.)"""
    model, tok = shipped
    torch.set_num_threads(1)
    recs = generate(domain, "train", 32, seed=21)
    acc = tiny.accuracy(model, tok, recs, greedy=False, seed=3)
    assert 0.1 <= acc <= 0.7, (domain, acc)


def test_boxed_duplicate_injection():
    from megatron_sdpo.rewards.math import score_math

    recs = generate("math", "train", 400, 1)
    out = tiny.inject_boxed_duplicates(recs, 0.1, seed=0)
    dup = [o for o in out if o["solution"] != next(r for r in recs if r["id"] == o["id"])["solution"]]
    # 400 Bernoulli(0.1) draws: mean 40, sd 6; 5 sd either side cannot fail by chance (p < 1e-6).
    assert 10 <= len(dup) <= 70
    for o in dup:
        assert o["solution"].count("\\boxed{") == 2 and o["solution"].endswith(f"\\boxed{{{o['answer']}}}")
        assert score_math(o["solution"], o).score == 1.0  # harmless to the reward
    assert tiny.inject_boxed_duplicates(recs, 0.1, seed=0) == out  # deterministic
    assert tiny.inject_boxed_duplicates(recs, 0.0, seed=0) == recs
    # The shipped recipe injects nothing: its warm-up records are the generator's.
    assert tiny.train_records(_short_cfg())["math"] == generate("math", "train", 40, 1)
    cfg = _short_cfg()
    cfg.boxed_duplicate_rate = 1.0
    assert all(r["solution"].count("\\boxed{") == 2 for r in tiny.train_records(cfg)["math"])
    cfg.long_math = True  # the long-answer recipe: worked solutions, then the duplicate box
    assert all(
        r["solution"].startswith(
            next(x for x in generate("math", "train", 40, 1) if x["id"] == r["id"])["prompt"].split(" ")[0]
        )
        and "The answer is" in r["solution"]
        and r["solution"].count("\\boxed{") == 2
        for r in tiny.train_records(cfg)["math"]
    )
    cfg.boxed_duplicate_rate = 1.5
    with pytest.raises(ConfigError, match="boxed_duplicate_rate"):
        cfg.validate()


def test_named_variants(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_SDPO_CACHE", str(tmp_path))
    assert tiny.VARIANTS["tiny-boxdup"].boxed_duplicate_rate == 0.1
    assert tiny.VARIANTS["tiny-long"].long_math and tiny.variant_dir("tiny-long") == tmp_path / "tiny_long_r3"
    assert tiny.variant_dir("tiny-boxdup") == tmp_path / "tiny_boxdup_r3"
    with pytest.raises(ConfigError, match="unknown tiny base"):
        tiny.ensure_tiny_base(variant="tiny-nope")
