"""The tiny base model: a ~1M-parameter Qwen3 warmed up on the synthetic suite, on CPU.

Pipeline (deterministic from a seed; `build_tiny_base` runs all of it):
1. `train_tokenizer`: byte-level BPE (digits split one per token) on the synthetic corpus,
   wrapped in `PreTrainedTokenizerFast` with a minimal chat template.
2. `build_model`: `Qwen3ForCausalLM`, hidden 128, 4 layers, 4 heads x head_dim 32 (vLLM's CPU
   attention needs head_dim >= 32), 2 KV heads, intermediate 384, untied embeddings.
3. `warmup`: AdamW on the records' "solution" (loss on response tokens only), each batch mixing
   the four domains, plus teacher-context examples (the SDPO re-prompt with a correct solution
   and/or feedback, target = the correct solution). A base never shown the re-prompt is a worse
   teacher than student, and SDPO then collapses.
The shipped result lives in megatron_sdpo/assets/tiny_base (`ensure_tiny_base`).

Calibration: RL only moves a base that already solves part of its items, so the recipe stops
the warm-up mid-way up the learning curve (400 steps, 1000 records per domain) rather than at
saturation; `tools/make_tiny_base.py --trace-every K` prints where each domain stands during a
build, and `evaluate_base` gives the full train/id/OOD table.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megatron_sdpo.data.synthetic import generate
from megatron_sdpo.errors import CheckpointError, ConfigError
from megatron_sdpo.interfaces.domains import DOMAINS

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_base"
EOS = "<|im_end|>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, "<|im_start|>", EOS]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FEEDBACKS = {  # generic feedback used in warm-up teacher examples when no verifier text is given
    "math": "The final answer {wrong} is wrong.",
    "science": "The chosen answer {wrong} is wrong.",
    "tooluse": "The call {wrong} is wrong.",
    "code": "The program failed the tests.",
}


@dataclass
class TinyConfig:
    """Every knob of the build. The defaults are the calibrated shipped recipe."""

    seed: int = 0
    vocab_size: int = 1000
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    n_train_per_domain: int = 1000  # warm-up records per domain (the "train" split, data seed+1)
    steps: int = 400
    batch_size: int = 32
    teacher_fraction: float = 0.5  # share of each batch in the teacher re-prompt format
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    difficulty: dict = field(default_factory=dict)  # per-domain overrides of the generator knob
    threads: int = 1  # torch threads during the build: 1 is deterministic and fastest on a busy box
    # Artifact injection: the share of math warm-up solutions that end with a second, identical
    # `\\boxed{N}`. The math reward reads the last box, so the duplicate costs no reward: an RL
    # run from such a base shows whether a method amplifies a harmless format artifact.
    boxed_duplicate_rate: float = 0.0
    # Long answers: math warm-up solutions worked out in words, counting one number at a time
    # (synthetic.math.worked_solution): a base whose answers leave room for repetition.
    long_math: bool = False

    def validate(self) -> None:
        if self.head_dim < 32:
            raise ConfigError("tiny.head_dim must be >= 32 (vLLM CPU attention)")
        if self.batch_size < len(DOMAINS):
            raise ConfigError(f"tiny.batch_size must be >= {len(DOMAINS)} to mix the domains")
        if not 0.0 <= self.boxed_duplicate_rate <= 1.0:
            raise ConfigError("tiny.boxed_duplicate_rate must be in [0, 1]")
        if not 0.0 <= self.teacher_fraction < 1.0:
            raise ConfigError("tiny.teacher_fraction must be in [0, 1)")
        if self.steps < 0 or self.n_train_per_domain < 2:
            raise ConfigError("tiny.steps must be >= 0 and tiny.n_train_per_domain >= 2")
        unknown = set(self.difficulty) - set(DOMAINS)
        if unknown:
            raise ConfigError(f"tiny.difficulty has unknown domain(s) {sorted(unknown)}")


def train_records(cfg: TinyConfig) -> dict[str, list[dict]]:
    """The warm-up records per domain (train split, seed cfg.seed + 1); math solutions worked out
    at length with `cfg.long_math`, with the injected duplicate box where
    `cfg.boxed_duplicate_rate` asks for one."""
    from megatron_sdpo.data.synthetic import math as synthetic_math

    def records(d: str) -> list[dict]:
        if d == "math" and cfg.long_math:
            difficulty = cfg.difficulty.get("math", synthetic_math.DEFAULT_DIFFICULTY)
            return synthetic_math.generate("train", cfg.n_train_per_domain, cfg.seed + 1, difficulty, long_answers=True)
        return generate(d, "train", cfg.n_train_per_domain, cfg.seed + 1, cfg.difficulty.get(d))

    out = {d: records(d) for d in DOMAINS}  # DOMAINS order: the build's example order depends on it
    if cfg.boxed_duplicate_rate > 0:
        out["math"] = inject_boxed_duplicates(out["math"], cfg.boxed_duplicate_rate, cfg.seed)
    return out


def inject_boxed_duplicates(records: list[dict], rate: float, seed: int) -> list[dict]:
    """Copies of `records` where each solution, with probability `rate` (its own generator, so
    the other draws of a build stay as they are), ends with a second `\\boxed{answer}`."""
    rng = random.Random(f"tiny-boxed-duplicate|{seed}")
    return [
        {**r, "solution": f"{r['solution']} \\boxed{{{r['answer']}}}"} if rng.random() < rate else r for r in records
    ]


# The version of the warm-up records a recipe trains on: bumped when a synthetic generator's
# records change (2: science compares the extreme reading with a threshold; 3: code folds two
# constants of one sign), so a base built into the cache from older records is never taken for
# the current recipe.
RECIPE_VERSION = 3

# Named bases for `model.path`: the shipped recipe, the artifact-injection assay's base and the
# long-answer base (the variants are built into the cache on first use, minutes on 2 cores).
VARIANTS: dict[str, TinyConfig] = {
    "tiny": TinyConfig(),
    "tiny-boxdup": TinyConfig(boxed_duplicate_rate=0.1),
    "tiny-long": TinyConfig(long_math=True),
}


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int = 1000):
    """Byte-level BPE with one token per digit, as a `PreTrainedTokenizerFast` (chat template,
    pad = <|endoftext|>, eos = <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits first: numbers become one token per digit, so arithmetic sees aligned digit streams.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def chat_prompt_ids(tokenizer, message: str) -> list[int]:
    """Token ids of a one-turn user message followed by the assistant header."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def response_ids(tokenizer, response: str) -> list[int]:
    """Token ids of a response, terminated by EOS."""
    return tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


# ----------------------------------------------------------------------------- model


def build_model(cfg: TinyConfig, vocab_size: int, pad_id: int, eos_id: int):
    """A freshly initialized Qwen3ForCausalLM of the tiny shape (seeded by cfg.seed)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(config)


# ----------------------------------------------------------------------------- warm-up data


def teacher_example(rec: dict, wrong: str, rng: random.Random, feedback_fn=None) -> str:
    """The SDPO re-prompt for `rec` with a correct solution and/or feedback on `wrong`."""
    from megatron_sdpo.algorithms.context import build_teacher_message

    kind = rng.random()
    use_solution = kind < 0.75
    use_feedback = kind >= 0.5
    feedback = None
    if use_feedback:
        feedback = feedback_fn(rec, wrong) if feedback_fn else _generic_feedback(rec, wrong)
    return build_teacher_message(rec["prompt"], rec["solution"] if use_solution else None, feedback)


def _generic_feedback(rec: dict, wrong: str) -> str:
    tail = wrong.strip().splitlines()[-1] if wrong.strip() else ""
    return FEEDBACKS[rec["domain"]].format(wrong=tail)


def make_examples(tokenizer, records: dict[str, list[dict]], cfg: TinyConfig, feedback_fn=None):
    """Per domain: (student examples, teacher examples), each a list of (prompt_ids, response_ids).

    A teacher example pairs record i with the (wrong) solution of another record i+1 as the
    failed attempt its feedback talks about.
    """
    rng = random.Random(f"tiny-examples|{cfg.seed}")
    out = {}
    for d, recs in records.items():
        student, teacher = [], []
        for i, rec in enumerate(recs):
            target = response_ids(tokenizer, rec["solution"])
            student.append((chat_prompt_ids(tokenizer, rec["prompt"]), target))
            wrong = recs[(i + 1) % len(recs)]["solution"]
            msg = teacher_example(rec, wrong, rng, feedback_fn)
            teacher.append((chat_prompt_ids(tokenizer, msg), target))
        out[d] = (student, teacher)
    return out


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask / labels (-100 outside response tokens). [B, L]."""
    L = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), L), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), L), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), L), dtype=torch.long)
    for i, (p, r) in enumerate(pairs):
        seq = p + r
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(r)
        mask[i, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def warmup(
    model,
    examples,
    cfg: TinyConfig,
    log: Callable[[str], None] | None = None,
    on_step: Callable[[int, object], None] | None = None,
) -> list[float]:
    """Supervised warm-up; returns the per-step loss (mean over response tokens).

    on_step(step, model) runs after each optimizer step (e.g. a calibration eval); it must leave
    the model in train mode and must not touch the global torch RNG if determinism matters.
    """
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    # Linear warm-up, then linear decay to 10%: at a constant lr the 1M model stays noisy (its
    # copy-level skills stall near 30% after 400 steps); the decay lets them settle.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)) * max(0.1, 1 - s / max(1, cfg.steps))
    )
    rng = random.Random(f"tiny-batches|{cfg.seed}")
    per_domain = cfg.batch_size // len(DOMAINS)
    n_teacher = round(per_domain * cfg.teacher_fraction)
    pad_id = model.config.pad_token_id
    losses = []
    t0 = time.time()
    for step in range(cfg.steps):
        batch = []
        for d in DOMAINS:
            student, teacher = examples[d]
            batch += rng.sample(student, per_domain - n_teacher) + rng.sample(teacher, n_teacher)
        inputs = collate(batch, pad_id)
        loss = model(**inputs).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log and (step % 50 == 0 or step == cfg.steps - 1):
            log(f"step {step:4d} loss {losses[-1]:.4f} ({time.time() - t0:.0f} s)")
        if on_step is not None:
            on_step(step + 1, model)
    model.eval()
    return losses


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def sample_responses(
    model, tokenizer, prompts: list[str], *, greedy: bool, seed: int = 0, max_new_tokens: int = 48, batch_size: int = 64
) -> list[str]:
    """Decoded responses (EOS stripped) to each user message; temperature 1 when not greedy."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(0, len(prompts), batch_size):
        chunk = [chat_prompt_ids(tokenizer, p) for p in prompts[s : s + batch_size]]
        P = max(len(c) for c in chunk)
        ids = torch.full((len(chunk), P), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, c in enumerate(chunk):
            ids[i, P - len(c) :] = torch.tensor(c)
            mask[i, P - len(c) :] = 1
        done = torch.zeros(len(chunk), dtype=torch.bool)
        new = []
        past = None
        cur_ids, cur_mask = ids, mask
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cur_pos = pos
        for _ in range(max_new_tokens):
            res = model(
                input_ids=cur_ids, attention_mask=cur_mask, position_ids=cur_pos, past_key_values=past, use_cache=True
            )
            past = res.past_key_values
            logits = res.logits[:, -1].float()
            if greedy:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)
            nxt = torch.where(done, torch.full_like(nxt, tokenizer.pad_token_id), nxt)
            new.append(nxt)
            done |= nxt == tokenizer.eos_token_id
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(len(chunk), 1, dtype=torch.long)], dim=1)
            cur_ids, cur_mask = nxt[:, None], mask
            cur_pos = cur_pos[:, -1:] + 1
        toks = torch.stack(new, dim=1).tolist()
        for row in toks:
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            out.append(tokenizer.decode([t for t in row if t != tokenizer.pad_token_id]))
    return out


def accuracy(model, tokenizer, records: list[dict], *, greedy: bool, seed: int = 0, max_new_tokens: int = 48) -> float:
    """Mean verifier score of the model's responses to `records` (megatron_sdpo.rewards.score)."""
    from megatron_sdpo.rewards import score

    responses = sample_responses(
        model, tokenizer, [r["prompt"] for r in records], greedy=greedy, seed=seed, max_new_tokens=max_new_tokens
    )
    return sum(score(r["domain"], y, r).score for r, y in zip(records, responses, strict=True)) / max(1, len(records))


@torch.no_grad()
def mean_response_logprob(model, tokenizer, prompts: list[str], responses: list[str]) -> torch.Tensor:
    """[N] fp32 mean per-token logprob of each response (EOS included) after its user message."""
    out = []
    for p, r in zip(prompts, responses, strict=True):
        pi, ri = chat_prompt_ids(tokenizer, p), response_ids(tokenizer, r)
        ids = torch.tensor([pi + ri])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(pi) - 1 : -1].float(), -1)
        out.append(logp.gather(-1, torch.tensor(ri)[:, None]).mean())
    return torch.stack(out)


# ----------------------------------------------------------------------------- build / ship


def build_tiny_base(
    out_dir: str | Path,
    cfg: TinyConfig | None = None,
    *,
    log: Callable[[str], None] | None = None,
    feedback_fn=None,
    on_step: Callable[[int, object, object], None] | None = None,
) -> dict:
    """Train tokenizer + model per `cfg` and save them (safetensors) to `out_dir`, atomically.

    Returns build info (config, parameter count, final loss, seconds), also written to
    `out_dir/tiny_build.json`. on_step(step, model, tokenizer) runs after each warm-up step
    (see `warmup`), e.g. to trace the calibration during a build.
    """
    cfg = cfg or TinyConfig()
    cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _build(Path(out_dir), cfg, log, feedback_fn, on_step)
    finally:
        torch.set_num_threads(threads)


def _build(out_dir: Path, cfg: TinyConfig, log, feedback_fn, on_step) -> dict:
    t0 = time.time()
    records = train_records(cfg)
    corpus = []
    for recs in records.values():
        for r in recs[:1000]:
            corpus += [r["prompt"], r["solution"]]
    from megatron_sdpo.algorithms.context import build_teacher_message

    corpus.append(build_teacher_message("x", "y", "z"))
    corpus += list(FEEDBACKS.values())
    tokenizer = train_tokenizer(corpus, cfg.vocab_size)
    model = build_model(cfg, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    examples = make_examples(tokenizer, records, cfg, feedback_fn)
    hook = (lambda step, m: on_step(step, m, tokenizer)) if on_step is not None else None
    losses = warmup(model, examples, cfg, log, on_step=hook)
    info = {
        "config": asdict(cfg),
        "recipe_version": RECIPE_VERSION,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "seconds": round(time.time() - t0, 1),
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny_base.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "tiny_build.json").write_text(json.dumps(info, indent=1) + "\n")
        # mkdtemp and safetensors create owner-only modes; a shipped/cached model is shared.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return info


def is_complete(path: str | Path) -> bool:
    p = Path(path)
    return all((p / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def variant_dir(name: str) -> Path:
    """Where a named base lives: the shipped copy for "tiny" when present, else the project's
    cache, in a directory named with the recipe version."""
    if name == "tiny" and is_complete(SHIPPED_DIR):
        return SHIPPED_DIR
    from megatron_sdpo.models.packaged import cache_root

    stem = "tiny_base" if name == "tiny" else name.replace("-", "_")
    return cache_root() / f"{stem}_r{RECIPE_VERSION}"


def ensure_tiny_base(path: str | Path | None = None, variant: str = "tiny") -> str:
    """Directory of a tiny base model (HF format).

    path=None: the named variant's directory (`variant_dir`), built there on first use (a few
    minutes on 2 cores). With a path: that directory, built there with the variant's recipe
    when absent.
    """
    if variant not in VARIANTS:
        raise ConfigError(f"unknown tiny base {variant!r}; known: {', '.join(VARIANTS)}")
    path = Path(path) if path is not None else variant_dir(variant)
    if not is_complete(path):
        if path.exists() and any(path.iterdir()):
            raise CheckpointError(f"{path}: exists but is not a complete tiny base (config, safetensors, tokenizer)")
        build_tiny_base(path, VARIANTS[variant])
    return str(path)


def load_tiny_base(path: str | Path | None = None):
    """(model, tokenizer) of `ensure_tiny_base(path)`, model in eval mode, fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = ensure_tiny_base(path)
    tok = AutoTokenizer.from_pretrained(d)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()
    return model, tok


def evaluate_base(
    path: str | Path | None = None,
    *,
    n: int = 64,
    seed: int = 100,
    difficulty: dict | None = None,
    threads: int = 1,
    max_new_tokens: int = 48,
) -> dict:
    """Accuracy of the base at `path` per (domain, split, mode): mode "greedy" or "t1" (sampled at
    temperature 1), on `n` synthetic records per domain and split (data seed `seed`)."""
    from megatron_sdpo.data.synthetic import SPLITS

    model, tok = load_tiny_base(path)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        for d in DOMAINS:
            for s in SPLITS:
                recs = generate(d, s, n, seed, (difficulty or {}).get(d))
                out[(d, s, "greedy")] = accuracy(model, tok, recs, greedy=True, max_new_tokens=max_new_tokens)
                out[(d, s, "t1")] = accuracy(model, tok, recs, greedy=False, seed=seed, max_new_tokens=max_new_tokens)
        return out
    finally:
        torch.set_num_threads(prev)


def format_report(report: dict) -> str:
    """A markdown table of `evaluate_base`'s result: one row per domain, greedy/t1 per split."""
    from megatron_sdpo.data.synthetic import SPLITS

    head = "| domain | " + " | ".join(f"{s} greedy / t1" for s in SPLITS) + " |"
    rows = [head, "|" + "---|" * (len(SPLITS) + 1)]
    for d in DOMAINS:
        cells = [f"{report[(d, s, 'greedy')]:.2f} / {report[(d, s, 't1')]:.2f}" for s in SPLITS]
        rows.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
