"""HF generate engine: sampling logprobs agree with the trainer, weight sync, grouping, stops."""

import pytest
import torch

from megatron_sdpo.backends.hf import HFBackend
from megatron_sdpo.errors import ConfigError, DataError, MissingDependencyError
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3
from megatron_sdpo.rollout import SamplingConfig, make_engine
from megatron_sdpo.rollout.hf import HFRolloutEngine, sample_from_logprobs, top_p_logprobs

from backend_losses import ResponseNLL

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14], [9], [200, 201]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=7)


def reference_sampling_logprobs(logits: torch.Tensor, token: int, temperature: float, top_p: float) -> float:
    """Independent top-p: keep the most probable tokens until their mass reaches top_p."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(probs, descending=True)
    kept, mass = [], 0.0
    for t in order.tolist():
        kept.append(t)
        mass += float(probs[t])
        if mass >= top_p:
            break
    if token not in kept:
        return float("-inf")
    return float(torch.log(probs[token] / probs[kept].sum()))


def trainer_logits(backend: HFBackend, completions, prompts) -> tuple[SequenceBatch, torch.Tensor]:
    batch = SequenceBatch([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions])
    return batch, backend.compute(batch, {"logits"})["logits"]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.85)])
def test_sampling_logprobs_match_backend(model_dir, temperature, top_p):
    """The engine reports the log-probs of the distribution it sampled from; a backend at the
    rollout temperature (its logits divided by it) computes the same ones."""
    engine = HFRolloutEngine(model_dir, seed=0, max_batch_size=5)  # 3 chunks of rows
    backend = HFBackend(model_dir, lr=1e-3, micro_batch_size=4)
    comps = engine.generate(PROMPTS, SamplingConfig(n=3, temperature=temperature, top_p=top_p, max_new_tokens=10))
    assert [c.prompt_index for c in comps] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    batch, logits = trainer_logits(backend, comps, PROMPTS)
    if top_p == 1.0:
        tempered = HFBackend(model_dir, lr=1e-3, micro_batch_size=4, logit_temperature=temperature)
        lp = tempered.logprobs(batch)
        if temperature != 1.0:  # the untempered trainer is measurably off: the guard would see it
            assert (lp - backend.logprobs(batch)).abs().max() > 1e-2
        for i, c in enumerate(comps):
            torch.testing.assert_close(torch.tensor(c.logprobs), lp[i, : len(c.token_ids)], atol=1e-4, rtol=0)
    for i, c in enumerate(comps):
        assert len(c.logprobs) == len(c.token_ids) >= 1
        for j, tok in enumerate(c.token_ids):
            ref = reference_sampling_logprobs(logits[i, j], tok, temperature, top_p)
            assert c.logprobs[j] == pytest.approx(ref, abs=1e-4)


def test_logprobs_match_after_weight_update(model_dir):
    engine = make_engine("hf", model_path=model_dir, seed=1, max_model_len=64)
    backend = HFBackend(model_dir, lr=5e-2, micro_batch_size=4)

    backend.train_step(SequenceBatch(PROMPTS, [[3, 4, 5]] * 4), ResponseNLL())
    cfg = SamplingConfig(n=2, max_new_tokens=8)
    before = engine.generate(PROMPTS, cfg)
    batch, _ = trainer_logits(backend, before, PROMPTS)
    stale = backend.logprobs(batch)
    assert max(abs(c.logprobs[0] - float(stale[i, 0])) for i, c in enumerate(before)) > 1e-3
    engine.update_weights(backend.export_weights())
    after = engine.generate(PROMPTS, cfg)
    batch, _ = trainer_logits(backend, after, PROMPTS)
    lp = backend.logprobs(batch)
    for i, c in enumerate(after):
        torch.testing.assert_close(torch.tensor(c.logprobs), lp[i, : len(c.token_ids)], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="not sent"):
        engine.update_weights(list(backend.export_weights())[:-1])
    with pytest.raises(ValueError, match="unknown tensor"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))])


def test_seeded_reproducible_eos_and_truncation(model_dir):
    cfg = SamplingConfig(n=4, max_new_tokens=12)
    a = HFRolloutEngine(model_dir, seed=3).generate(PROMPTS, cfg)
    b = HFRolloutEngine(model_dir, seed=3).generate(PROMPTS, cfg)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.token_ids for c in a] != [c.token_ids for c in HFRolloutEngine(model_dir, seed=4).generate(PROMPTS, cfg)]
    # Make a frequent token the EOS: rows stop right after it, others run to the limit.
    common = max(set(t for c in a for t in c.token_ids), key=lambda t: sum(t in c.token_ids for c in a))
    stopped = HFRolloutEngine(model_dir, seed=3, eos_token_ids=[common]).generate(PROMPTS, cfg)
    assert any(not c.truncated for c in stopped)
    for c in stopped:
        if c.truncated:
            assert len(c.token_ids) == 12 and common not in c.token_ids
        else:
            assert c.token_ids[-1] == common and common not in c.token_ids[:-1]
    capped = HFRolloutEngine(model_dir, seed=3, max_model_len=8, eos_token_ids=[]).generate(PROMPTS, cfg)
    for c in capped:
        assert len(c.token_ids) == min(12, 8 - len(PROMPTS[c.prompt_index])) and c.truncated


def test_greedy_is_argmax(model_dir):
    engine = HFRolloutEngine(model_dir, seed=0, eos_token_ids=[])
    backend = HFBackend(model_dir, lr=1e-3, micro_batch_size=8)
    comps = engine.generate(PROMPTS, SamplingConfig(n=2, greedy=True, max_new_tokens=6))
    assert comps[0].token_ids == comps[1].token_ids
    batch, logits = trainer_logits(backend, comps, PROMPTS)
    for i, c in enumerate(comps):
        assert c.token_ids == logits[i, : len(c.token_ids)].argmax(-1).tolist()


def test_engine_errors(model_dir, monkeypatch):
    engine = HFRolloutEngine(model_dir, max_model_len=16)
    with pytest.raises(ConfigError, match="temperature"):
        engine.generate(PROMPTS, SamplingConfig(temperature=0.0))
    with pytest.raises(ConfigError, match="top_p"):
        engine.generate(PROMPTS, SamplingConfig(top_p=0.0))
    with pytest.raises(DataError, match="empty"):
        engine.generate([[]], SamplingConfig())
    with pytest.raises(DataError, match="max_model_len"):
        engine.generate([list(range(3, 20))], SamplingConfig())
    with pytest.raises(ConfigError, match="tokenizer"):
        HFRolloutEngine(model_dir, detokenize=True)
    with pytest.raises(ConfigError, match="'auto', 'vllm' or 'hf'"):
        make_engine("sglang", model_path=model_dir)
    import megatron_sdpo.rollout as rollout

    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    with pytest.raises(MissingDependencyError, match=r"\.\[cpu\]"):
        make_engine("vllm", model_path=model_dir)
    assert isinstance(make_engine("auto", model_path=model_dir), HFRolloutEngine)


def test_top_p_logprobs_keeps_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = top_p_logprobs(logits, 1.0, 0.8)
    assert torch.isinf(lp[0, 2:]).all()
    torch.testing.assert_close(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))


def test_inverse_cdf_sampler_draws_the_distribution_and_never_a_zero_probability_id():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    N = 200_000
    logp = torch.log(probs).expand(N, -1)
    ids = sample_from_logprobs(logp, torch.Generator().manual_seed(0))
    freq = torch.bincount(ids, minlength=len(probs)).double() / N
    # Each frequency is a mean of N Bernoulli(p) draws: 6 standard deviations is a bound a
    # correct sampler crosses with probability ~2e-9 per id.
    bound = 6 * torch.sqrt(probs.double() * (1 - probs.double()) / N)
    assert torch.all((freq - probs.double()).abs() <= bound + 1e-12), (freq, probs)
    assert freq[probs == 0].sum() == 0


def test_inverse_cdf_sampler_clamps_a_uniform_at_the_top_to_the_last_id_with_mass(monkeypatch):
    logp = torch.log(torch.tensor([[0.25, 0.75, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    monkeypatch.setattr(torch, "rand", lambda n, _, **kw: torch.full((n, 1), 1.0 - 2.0**-24, dtype=kw["dtype"]))
    assert sample_from_logprobs(logp, torch.Generator()).tolist() == [1, 0]


def test_generation_threads_are_set_for_the_call_and_restored(model_dir, monkeypatch):
    """rollout.threads: the engine generates with that many torch threads, the same samples,
    and leaves the trainer's count as it was."""
    seen = []
    real_chunk = HFRolloutEngine._generate_chunk
    monkeypatch.setattr(
        HFRolloutEngine,
        "_generate_chunk",
        lambda self, *a: (seen.append(torch.get_num_threads()), real_chunk(self, *a))[1],
    )
    cfg = SamplingConfig(n=2, max_new_tokens=6, seed=5)
    before = torch.get_num_threads()
    one = HFRolloutEngine(model_dir, seed=0, threads=1).generate(PROMPTS, cfg)
    default = HFRolloutEngine(model_dir, seed=0).generate(PROMPTS, cfg)
    assert seen == [1, before] and torch.get_num_threads() == before
    assert [c.token_ids for c in one] == [c.token_ids for c in default]
    with pytest.raises(ConfigError, match="threads"):
        HFRolloutEngine(model_dir, threads=0)


def test_finished_rows_leave_the_decoding_batch_with_the_same_samples(model_dir, monkeypatch):
    """Rows whose answer ended leave the forward batch (compact_below): the same tokens as
    decoding every row to the end, and the same log-probs to fp32 round-off. The uniforms are
    drawn per chunk row whatever the batch holds, so a token could only differ where a uniform
    lies within round-off (~1e-6) of a cumulative-probability boundary: ~1e-4 over these ~100
    tokens, and fixed for a given machine (a seeded draw)."""
    from transformers import DynamicCache

    cfg = SamplingConfig(n=4, max_new_tokens=12, seed=5)
    probe = HFRolloutEngine(model_dir, seed=3).generate(PROMPTS, cfg)
    common = max(set(t for c in probe for t in c.token_ids), key=lambda t: sum(t in c.token_ids for c in probe))
    selections = []
    real_select = DynamicCache.batch_select_indices
    monkeypatch.setattr(
        DynamicCache, "batch_select_indices", lambda self, idx: (selections.append(len(idx)), real_select(self, idx))[1]
    )
    runs = {}
    for share in (0.0, 0.75, 1.0):  # never, at a quarter finished, at every finished row
        engine = HFRolloutEngine(model_dir, seed=3, eos_token_ids=[common])
        engine.compact_below = share
        selections.clear()
        runs[share] = (engine.generate(PROMPTS, cfg), list(selections))
    never, _ = runs[0.0]
    lengths = sorted({len(c.token_ids) for c in never})
    assert len(lengths) >= 3 and any(c.truncated for c in never) and any(not c.truncated for c in never)
    # The prefill's expansion to one row per sample is the only selection without compaction.
    assert runs[0.0][1] == [len(PROMPTS) * 4]
    assert len(runs[1.0][1]) > len(runs[0.75][1]) > 1
    assert runs[0.75][1] == sorted(runs[0.75][1], reverse=True)
    for share in (0.75, 1.0):
        comps, _ = runs[share]
        assert [c.token_ids for c in comps] == [c.token_ids for c in never]
        assert [c.truncated for c in comps] == [c.truncated for c in never]
        for a, b in zip(comps, never, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_decoding_attention_reads_grouped_heads_in_place():
    """decode_sdpa equals transformers' SDPA attention (which repeats the KV heads) on one query
    token per row with a padding mask, and is transformers' own path for longer queries."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from megatron_sdpo.rollout.decoding import decode_sdpa

    g = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    for q_len in (1, 5):
        q = torch.randn(6, 6, q_len, 16, generator=g)
        k, v = torch.randn(6, 2, 9, 16, generator=g), torch.randn(6, 2, 9, 16, generator=g)
        mask = torch.ones(6, 1, q_len, 9, dtype=torch.bool)
        for row in range(6):
            mask[row, :, :, :row] = False  # left padding of `row` tokens
        mask = mask & torch.ones(q_len, 9, dtype=torch.bool).tril(9 - q_len)
        ours, _ = decode_sdpa(module, q, k, v, mask, scaling=0.25)
        ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
        assert ours.shape == ref.shape == (6, q_len, 6, 16)
        # Softmax-weighted sums of the same fp32 values in another order: a few ulps of |v| ~ 3.
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_the_engine_decodes_with_the_grouped_head_attention_on_cpu_only(model_dir):
    from megatron_sdpo.rollout.decoding import NAME, use_decode_sdpa

    engine = HFRolloutEngine(model_dir, seed=0)
    assert engine.model.config._attn_implementation == NAME
    engine.model.set_attn_implementation("eager")
    assert not use_decode_sdpa(engine.model)  # eager stays eager
    assert engine.model.config._attn_implementation == "eager"
