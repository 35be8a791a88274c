"""HF transformers generation engine: left-padded batched sampling with a KV cache.

It keeps its own copy of the model (the trainer's weights reach it through `update_weights`,
the same named-tensor path the vLLM engine uses) and its own seeded torch.Generator, so
sampling never consumes the trainer's global RNG stream.

Reported logprobs are those of the distribution actually sampled from: log-softmax of
logits / temperature, renormalized over the top-p nucleus. For greedy decoding they are the
model's temperature-1 logprobs of the argmax token.

Three things keep the per-step cost at what the samples need. A chunk's distinct prompts are
prefilled once and their KV cache rows copied to every sample of the prompt (a GRPO batch holds
each prompt n times; the n prefills would compute the same keys and values). A token is
drawn by inverse CDF (one uniform per row against the cumulative probabilities) instead of
torch.multinomial, which draws one exponential per vocabulary entry per row: at a 49k
vocabulary and 128 rows that was 6.3M random numbers per decoding step. And rows whose answer
has ended leave the decoding batch: a group's answers end at very different lengths (on the tiny
math workload a mean of 12 of 32 new tokens), and without it every row is decoded until the
longest answer of the chunk ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from megatron_sdpo.errors import ConfigError, DataError
from megatron_sdpo.interfaces.layout import left_pad, position_ids_from_mask
from megatron_sdpo.models.hf_model import load_causal_lm
from megatron_sdpo.rollout import base
from megatron_sdpo.rollout.base import Completion, RolloutEngine, SamplingConfig, torch_threads
from megatron_sdpo.rollout.decoding import use_decode_sdpa

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def top_p_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[N, V] logits -> [N, V] fp32 log-probs of the sampling distribution: temperature-scaled,
    tokens outside the smallest set with cumulative probability >= top_p set to -inf, and
    renormalized."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    cum = sorted_logp.exp().cumsum(-1)
    # Drop a token when the mass strictly before it already reaches top_p; the first always stays.
    drop_sorted = (cum - sorted_logp.exp()) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    logp = logp.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logp, dim=-1)


def sample_from_logprobs(
    logp: torch.Tensor, generator: torch.Generator | None = None, *, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, V] fp32 log-probs (each row normalized; -inf where excluded) -> [N] sampled ids, by
    inverse CDF: the first id whose cumulative probability exceeds u ~ U[0, total). Ids of
    probability 0 are never drawn: their cumulative value equals the previous one, and u
    rounding up to the total (u < 1 scaled in fp32) is clamped to the last id with mass.
    `uniform` ([N, 1] in [0, 1)) gives the draws instead of `generator`."""
    probs = logp.exp()
    cdf = probs.cumsum(-1)
    if uniform is None:
        uniform = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    u = uniform.to(cdf.dtype) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True)[:, 0]
    # argmax returns the first maximum: the position of the last nonzero probability.
    last = (probs > 0).cumsum(-1).argmax(-1)
    return torch.minimum(idx, last)


class HFRolloutEngine(RolloutEngine):
    """Batched sampling with transformers on CPU (or one GPU)."""

    # Finished rows leave the decoding batch when the unfinished ones are at most this share of
    # it: a geometric shrink, so at most log(N) / log(1 / 0.75) KV-cache selections per chunk.
    compact_below = 0.75

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_batch_size: int = 256,
        eos_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        detokenize: bool = False,
        device: str = "cpu",
        threads: int | None = None,
    ):
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if not Path(model_path, "config.json").is_file():
            raise ConfigError(f"model_path {model_path!r} is not a HF model directory (no config.json)")
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if threads is not None and threads < 1:
            raise ConfigError(f"threads must be >= 1 or None, got {threads}")
        self.threads = threads  # torch threads while generating (None: the process's)
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.model = load_causal_lm(self.model_path, _DTYPES[dtype]).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        use_decode_sdpa(self.model)
        cfg = self.model.config
        self.max_model_len = max_model_len or getattr(cfg, "max_position_embeddings", None)
        self.max_batch_size = max_batch_size
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else base.eos_ids_of(self.model_path)
        if pad_token_id is None:
            pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (self.eos_token_ids or [0])[0]
        self.pad_token_id = int(pad_token_id)
        self.tokenizer = base.load_tokenizer(self.model_path) if detokenize else None
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._params = dict(self.model.named_parameters())
        self._names = set(self.model.state_dict().keys())
        # Weights are copied in process: no sync timings, nothing for the refit guard to compare.
        self.last_sync: dict[str, float] = {}
        self.sent_checksums: dict[str, tuple[float, float]] = {}
        self.received_checksums: dict[str, tuple[float, float]] = {}

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        """n completions per prompt, grouped consecutively (prompt 0's n, then prompt 1's...)."""
        base.check_sampling(sampling)
        for i, p in enumerate(prompt_ids):
            if not p:
                raise DataError(f"prompt {i} is empty")
            if self.max_model_len is not None and len(p) >= self.max_model_len:
                raise DataError(f"prompt {i} has {len(p)} tokens; max_model_len is {self.max_model_len}")
        rows = [(i, p) for i, p in enumerate(prompt_ids) for _ in range(sampling.n)]
        out: list[Completion] = []
        if sampling.seed is not None:
            # A per-call seed makes the call reproducible whatever ran before (resume).
            self.generator.manual_seed(sampling.seed)
        with torch_threads(self.threads):
            for s in range(0, len(rows), self.max_batch_size):
                out.extend(self._generate_chunk(rows[s : s + self.max_batch_size], sampling))
        return out

    # inference_mode, not no_grad: the decoding loop's many small ops skip autograd's version and
    # view tracking (7% of the tiny model's rollout); nothing it creates reaches a backward.
    @torch.inference_mode()
    def _generate_chunk(self, rows: list[tuple[int, list[int]]], sampling: SamplingConfig) -> list[Completion]:
        from transformers import DynamicCache

        N = len(rows)
        # Distinct prompts of the chunk (rows of one prompt share its prefill), in order of first
        # appearance; `expand` maps each row to its prompt's row in the prefill batch.
        prompt_of = dict(rows)
        slot = {pi: k for k, pi in enumerate(prompt_of)}
        unique = list(prompt_of.values())
        expand = torch.tensor([slot[pi] for pi, _ in rows], device=self.device)
        ids, mask = left_pad(unique, self.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Each row may generate up to max_new_tokens, capped so prompt + response fits.
        budget = torch.tensor(
            [
                sampling.max_new_tokens
                if self.max_model_len is None
                else min(sampling.max_new_tokens, self.max_model_len - len(p))
                for _, p in rows
            ],
            device=self.device,
        )
        steps = int(budget.max())
        eos = torch.tensor(self.eos_token_ids or [-1], device=self.device)
        tokens = torch.full((N, steps), self.pad_token_id, dtype=torch.long, device=self.device)
        logps = torch.zeros((N, steps), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(N, dtype=torch.long, device=self.device)
        done = torch.zeros(N, dtype=torch.bool, device=self.device)
        hit_eos = torch.zeros(N, dtype=torch.bool, device=self.device)

        cache = DynamicCache()
        positions = position_ids_from_mask(mask)
        step_input = ids
        # `alive`: the chunk row of each row still in the forward batch. Finished rows leave it
        # once the unfinished ones are at most `compact_below` of it (the KV cache rows selected
        # like the prefill's), so the decoding steps after most answers ended cost what the long
        # answers need. Uniforms are drawn for every chunk row at every step: the samples do not
        # depend on when rows left.
        alive = torch.arange(N, device=self.device)
        for t in range(steps):
            logits = self.model(
                input_ids=step_input,
                attention_mask=mask,
                position_ids=positions[:, -step_input.shape[1] :],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            if t == 0:
                # From the prompts' prefill to one row per sample (without repeated prompts
                # `expand` is the identity and the cache stays as it is).
                if len(unique) < N:
                    cache.batch_select_indices(expand)
                logits, mask, positions = logits[expand], mask[expand], positions[expand]
            if sampling.greedy:
                tok = logits.argmax(-1)
                lp = torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None])[:, 0]
            else:
                dist_logp = top_p_logprobs(logits, sampling.temperature, sampling.top_p)
                uniform = torch.rand(N, 1, generator=self.generator, device=self.device, dtype=torch.float32)
                tok = sample_from_logprobs(dist_logp, uniform=uniform[alive])
                lp = dist_logp.gather(-1, tok[:, None])[:, 0]
            active = ~done[alive]
            tokens[alive, t] = torch.where(active, tok, tokens[alive, t])
            logps[alive, t] = torch.where(active, lp, logps[alive, t])
            lengths[alive] += active.long()
            is_eos = active & torch.isin(tok, eos)
            hit_eos[alive] |= is_eos
            done[alive] |= is_eos | (lengths[alive] >= budget[alive])
            if bool(done.all()):
                break
            finished = done[alive]
            keep = (~finished).nonzero()[:, 0]
            if keep.numel() <= self.compact_below * alive.numel():
                cache.batch_select_indices(keep)
                alive, tok, finished = alive[keep], tok[keep], finished[keep]
                mask, positions = mask[keep], positions[keep]
            step_input = torch.where(finished, torch.full_like(tok, self.pad_token_id), tok)[:, None]
            mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)

        tokens_l, logps_l, lengths_l, eos_l = tokens.tolist(), logps.tolist(), lengths.tolist(), hit_eos.tolist()
        result = []
        for r, (pi, _) in enumerate(rows):
            n = lengths_l[r]
            toks = tokens_l[r][:n]
            text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else ""
            result.append(Completion(pi, toks, logps_l[r][:n], text, truncated=not eos_l[r]))
        return result

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into the engine's model in place. Every parameter must be
        covered (tied weights count once); unknown names or wrong shapes raise ValueError."""
        own = self.model.state_dict()
        done_ptrs: set[int] = set()
        for name, t in named_tensors:
            if name not in own:
                raise ValueError(f"update_weights: unknown tensor {name!r}")
            if tuple(t.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(t.shape)}, expected {tuple(own[name].shape)}"
                )
            own[name].copy_(t)
            done_ptrs.add(own[name].untyped_storage().data_ptr())
        missing = [n for n, p in self._params.items() if p.untyped_storage().data_ptr() not in done_ptrs]
        if missing:
            raise ValueError(f"update_weights: {len(missing)} parameters not sent, e.g. {missing[:3]}")

    def sleep(self) -> None:
        """No-op: the HF engine's memory is a plain model copy."""

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """No-op (see sleep)."""
