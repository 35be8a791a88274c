"""Loss inputs straight from final hidden states and the vocab-sharded LM head (no logits).

With `kernel.fused_kl=true` the last pipeline stage never runs `output_layer`: GPTModel's
forward returns the decoder's output (final norm applied) while its `post_process` flag is off
(`hidden_only`), and every per-token statistic the loss asks for comes from the fused kernels
of `megatron_sdpo_kernels` over this rank's vocabulary rows. So neither the student's nor the
teacher's `[tokens, V/tp]` logits are built; peak memory is the kernels' tiles.

The LM-head rows past the real vocabulary (padding to `vocab_divisor`) are cut off, as the
logits path cuts its logit columns: a padded row's logit would be 0, not -inf, and would enter
every normalizer. The kernels sum the hidden-state gradient over the TP group themselves, so
the hidden states enter them as they are (never through megatron's
`copy_to_tensor_model_parallel_region`); under sequence parallelism they are gathered with a
split (not reduce-scatter) backward for the same reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.distillation import DistillationSpec

# Outputs that need full-vocabulary logits in hand; the fused path cannot give them.
LOGIT_OUTPUTS = frozenset({"logits", "teacher_logits", "topk_logprobs", "teacher_topk_logprobs"})


def _gpt(model):
    return getattr(model, "module", model)


@contextlib.contextmanager
def hidden_only(*models) -> Iterator[None]:
    """Within the block, each GPTModel's forward returns its decoder output `[s, b, H]` (after
    the final norm) instead of logits. Only the last pipeline stage changes: the others return
    hidden states anyway."""
    gpts = [_gpt(m) for m in models]
    saved = [g.post_process for g in gpts]
    try:
        for g in gpts:
            g.post_process = False
        yield
    finally:
        for g, s in zip(gpts, saved, strict=True):
            g.post_process = s


def output_weight(model, width: int) -> torch.Tensor:
    """This rank's LM-head rows for real vocabulary ids, `[width, H]` (a view: gradients reach
    the parameter). Tied models read the embedding table, as GPTModel's own output layer does."""
    g = _gpt(model)
    if g.share_embeddings_and_output_weights:
        w = g.shared_embedding_or_output_weight()
    else:
        w = g.output_layer.weight
    return w[:width]


def response_hidden(hidden: torch.Tensor, rows, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """Decoder output `[s, r, H]` (s = S / tp under sequence parallelism) of `rows`
    (batching.Rows) -> the states that predict each response token, `[b * T, H]`."""
    if sequence_parallel:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # Split backward: the kernels already summed this gradient over the TP group.
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=tp_group)
    return rows.select(hidden.transpose(0, 1)).reshape(-1, hidden.shape[-1])


def check_requires(requires: frozenset) -> None:
    """ConfigError when the fused path cannot serve `requires`."""
    bad = requires & LOGIT_OUTPUTS
    if bad:
        raise ConfigError(
            f"kernel.fused_kl computes no logits, but the loss also requires {sorted(bad)}; "
            "use the top-k path (kernel.fused_kl=false) or a loss that needs only 'fused_kl' and logprobs"
        )


def fused_kl(
    h_s: torch.Tensor,
    h_t: torch.Tensor,
    w_s: torch.Tensor,
    w_t: torch.Tensor,
    spec: DistillationSpec,
    *,
    tp_group,
    logit_temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token distillation loss [N] from response hidden states [N, H] and this rank's LM-head
    rows [width, H] through the fused kernel, as `spec` says (no mask: the loss masks), on logits
    divided by `logit_temperature` (the rollout's) and then by the spec's. Gradients reach the
    student hidden states and weight only."""
    from megatron_sdpo_kernels import ChunkSizes, fused_linear_kl

    return fused_linear_kl(
        h_s,
        h_t,
        w_s,
        w_t,
        alpha=spec.alpha,
        temperature=spec.temperature * logit_temperature,
        mask=None,
        impl=spec.kernel_impl,
        tp_group=tp_group,
        chunk_sizes=ChunkSizes(tokens=spec.chunk_tokens, vocab=spec.chunk_vocab),
    )


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    start: int,
    vocab: int,
    tp_group,
    impl: str,
    want_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [b, T], entropy [b, T] or None) of `targets` [b, T] from hidden [b * T, H] and
    this rank's head rows [width, H] for ids [start, start + width), logits / `temperature`."""
    from megatron_sdpo_kernels import fused_linear_logprobs

    lp, ent = fused_linear_logprobs(
        hidden,
        weight,
        targets.reshape(-1),
        temperature=temperature,
        impl=impl,
        tp_group=tp_group,
        shard_start=start,
        vocab_size=vocab,
    )
    return lp.view(targets.shape), ent.view(targets.shape) if want_entropy else None
