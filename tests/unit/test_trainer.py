"""Trainer pieces that need no model: the teacher-signal diagnostic and its endorsement of
artifact tokens."""

import time
from types import SimpleNamespace

import pytest
import torch

from megatron_sdpo.config import load_config
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.rollout.base import RolloutEngine
from megatron_sdpo.trainer import Trainer
from megatron_sdpo.trainer.teacher import SelfTeacher


class FixedTeacher:
    """A backend whose teacher logprobs are given."""

    def __init__(self, teacher_lp: torch.Tensor):
        self.teacher_lp = teacher_lp
        self.calls = []

    def logprobs(self, batch, *, model="policy"):
        self.calls.append(model)
        return self.teacher_lp


class PieceTokenizer:
    """Decodes token ids through a table (5: an answer, 6 and 7: a box each)."""

    PIECES = {1: "Q", 5: "1+2=3", 6: " \\boxed{3}", 7: " \\boxed{3}"}

    def decode(self, ids):
        return "".join(self.PIECES[i] for i in ids)


def _batch(mask_key="loss_mask"):
    b = SequenceBatch([[1]] * 4, [[5, 6, 7], [5, 6], [5, 6, 7], [5]], [[1, 2]] * 3 + [None], {})
    mask = b.response_mask()
    mask[3] = 0.0  # no teacher context: not distilled
    b.tensors[mask_key] = mask
    b.tensors["rollout_logprobs"] = torch.full(mask.shape, -2.0) * b.response_mask()
    return b


def test_teacher_signal_splits_the_gain_by_reward():
    cfg = load_config("tiny_sdpo")
    # The teacher likes response 0 (rewarded) by +1 nat per token, response 1 (unrewarded) by
    # +0.25, response 2 (unrewarded) by -0.5; response 3 has no context and must not count.
    t = torch.tensor([[-1.0, -1.0, -1.0], [-1.75, -1.75, 0.0], [-2.5, -2.5, -2.5], [9.0, 0.0, 0.0]])
    backend = FixedTeacher(t)
    teacher = SelfTeacher(cfg, backend, PieceTokenizer())
    PieceTokenizer.PIECES[7] = " done"  # no repeated box: no endorsement keys
    out = teacher.signal(_batch(), torch.tensor([1.0, 0.0, 0.5, 1.0]))
    PieceTokenizer.PIECES[7] = " \\boxed{3}"
    assert backend.calls == ["teacher"]
    assert set(out) == {"teacher/gain_rewarded", "teacher/gain_unrewarded", "teacher/gain_gap"}
    assert out["teacher/gain_rewarded"] == pytest.approx(1.0)
    assert out["teacher/gain_unrewarded"] == pytest.approx((0.25 - 0.5) / 2)
    assert out["teacher/gain_gap"] == pytest.approx(1.125)
    # Hybrid runs keep the distillation mask under "sdpo_mask"; only one side present: no gap.
    teacher = SelfTeacher(load_config("tiny_sdpo", ["algorithm.name=hybrid"]), backend, PieceTokenizer())
    b = _batch("sdpo_mask")
    b.tensors["loss_mask"] = b.response_mask()
    only = teacher.signal(b, torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert {k for k in only if k.startswith("teacher/gain")} == {"teacher/gain_unrewarded"}


def test_teacher_endorsement_of_repeated_box_tokens():
    # Responses 0 and 2 end with a second box (token 7); response 1 has one box, response 3 no
    # context. Gains over the student (-2 per token): 0.5 everywhere except on the repeated
    # boxes: +2.0 (response 0) and +1.0 (response 2).
    t = torch.tensor([[-1.5, -1.5, 0.0], [-1.5, -1.5, 0.0], [-1.5, -1.5, -1.0], [9.0, 0.0, 0.0]])
    teacher = SelfTeacher(load_config("tiny_sdpo"), FixedTeacher(t), PieceTokenizer())
    out = teacher.signal(_batch(), torch.tensor([1.0, 0.0, 0.5, 1.0]))
    assert out["teacher/artifact_tokens"] == 2.0
    assert out["teacher/artifact_gain"] == pytest.approx(1.5)
    assert out["teacher/artifact_endorsement"] == pytest.approx(1.5 - 0.5)


class RecordingEngine(RolloutEngine):
    """A rollout engine that records the order of calls and what is asleep (sleep/wake are
    no-ops on CPU vLLM, so the order is what can be checked here)."""

    def __init__(self, log):
        self.log = log
        self.asleep = set()
        self.last_sync, self.sent_checksums, self.received_checksums = {}, {}, {}

    def generate(self, prompt_ids, sampling):
        from megatron_sdpo.rollout.base import Completion

        assert not self.asleep, f"generate on a sleeping engine ({self.asleep})"
        self.log.append("generate")
        return [
            Completion(i // sampling.n, [7, 8], [-1.0, -2.0], "x", False) for i in range(len(prompt_ids) * sampling.n)
        ]

    def sleep(self):
        self.log.append("sleep")
        self.asleep = {"weights", "kv_cache"}

    def wake(self, tags=None):
        tags = tuple(tags or ("weights", "kv_cache"))
        self.log.append(f"wake({','.join(tags)})")
        self.asleep -= set(tags)

    def update_weights(self, named_tensors):
        assert "weights" not in self.asleep, "weights written into a sleeping engine"
        assert "kv_cache" in self.asleep, "the KV cache woke before the refit"
        self.log.append("refit")
        for _ in named_tensors:
            self.log.append("tensor")


class RecordingBackend:
    topk_source = "logits"  # the Backend capability the trainer builds its loss for
    device = torch.device("cpu")
    dp_size = 1

    def __init__(self, log):
        self.log = log

    def train_step(self, batch, loss_fn):
        self.log.append("train")
        assert "logprobs" in loss_fn.requires  # the guard reads the loss's own logprobs
        return {"loss": 0.0, "refit/logprob_diff_mean": 0.0}

    def export_weights(self, *, model="policy"):
        self.log.append("export")
        yield "w", torch.zeros(2)


def test_step_order_sleep_wake_weights_refit_wake_kv_cache():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.data.synthetic import generate
    from megatron_sdpo.models.tiny import ensure_tiny_base

    cfg = load_config("tiny")
    log = []
    tok = load_tokenizer(ensure_tiny_base())
    trainer = Trainer(cfg, RecordingBackend(log), RecordingEngine(log), tok)
    records = generate("math", "id", 2, 0)
    engine = trainer.engine

    class Hooks:  # trainer.StepHooks: the teacher update only
        def after_train(self, step: int) -> None:
            assert engine.asleep == {"weights", "kv_cache"}, "the teacher update ran next to an awake engine"
            log.append("teacher_update")

        def refill(self, step: int, round_: int) -> list[dict]:
            raise AssertionError("no extra generation round is configured")

        def between_phases(self, left: tuple[str, ...]) -> None:
            pass

    for step in range(2):
        trainer.step("math", records, seed=step, step=step, hooks=Hooks())
    one = [
        "generate",
        "sleep",
        "train",
        "teacher_update",
        "wake(weights)",
        "refit",
        "export",
        "tensor",
        "wake(kv_cache)",
    ]
    assert log == one + one


class OffloadingBackend(RecordingBackend):
    """Records offload / reload and checks the engine sleeps whenever the state is on device."""

    def __init__(self, log, engine_state):
        super().__init__(log)
        self.engine_state = engine_state
        self.offloaded = False

    def train_step(self, batch, loss_fn):
        self.reload_training_state()
        return super().train_step(batch, loss_fn)

    def offload_training_state(self):
        self.log.append("offload")
        self.offloaded = True
        return 1

    def reload_training_state(self):
        if self.offloaded:
            assert self.engine_state() == {"weights", "kv_cache"}, "training state back next to an awake engine"
            self.log.append("reload")
            self.offloaded = False

    def save(self, path, *, extra=None):
        self.reload_training_state()
        self.log.append("save")


def test_offloaded_training_state_never_shares_the_device_with_the_engine():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.data.synthetic import generate
    from megatron_sdpo.models.tiny import ensure_tiny_base

    cfg = load_config("tiny", ["backend.offload_training_state=true"])
    log = []
    engine = RecordingEngine(log)
    backend = OffloadingBackend(log, lambda: engine.asleep)
    trainer = Trainer(cfg, backend, engine, load_tokenizer(ensure_tiny_base()))
    records = generate("math", "id", 2, 0)
    for step in range(2):
        trainer.step("math", records, seed=step, step=step)
    with trainer.training_state_on_device():  # a checkpoint between steps
        backend.save("x")
    step = ["generate", "sleep", "train", "offload", "wake(weights)", "refit", "export", "tensor", "wake(kv_cache)"]
    first = [x for x in step if x != "reload"]
    later = ["generate", "sleep", "reload", "train", *step[3:]]
    save = ["sleep", "reload", "save", "offload", "wake(weights)", "refit", "export", "tensor", "wake(kv_cache)"]
    assert log == first + later + save


class TimedBackend(RecordingBackend):
    """A train step that takes 30 ms, 10 of them (it says) in the teacher's forward."""

    def train_step(self, batch, loss_fn):
        time.sleep(0.03)
        return {**super().train_step(batch, loss_fn), "time/teacher_forward": 0.01}

    def logprobs(self, batch, *, model="policy"):  # the teacher-signal diagnostic's forward
        return torch.zeros(len(batch), batch.max_response_len)


def test_step_reports_disjoint_phase_times():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.data.synthetic import generate
    from megatron_sdpo.models.tiny import ensure_tiny_base
    from megatron_sdpo.stopwatch import PHASES

    tok = load_tokenizer(ensure_tiny_base())
    records = generate("math", "id", 2, 0)
    for name in ("tiny", "tiny_sdpo"):
        trainer = Trainer(load_config(name), TimedBackend([]), RecordingEngine([]), tok)
        m = trainer.step("math", records, seed=0).metrics
        parts = [m[f"time/{p}"] for p in PHASES]
        assert all(v >= 0.0 for v in parts) and m["time/other"] >= 0.0
        assert sum(parts) <= m["time/step"] and sum(parts) + m["time/other"] == pytest.approx(m["time/step"])
        # The backend's teacher forward is booked as teacher time, not train time.
        assert m["time/teacher"] >= 0.01 and 0.02 <= m["time/train"] < m["time/step"]
        assert "time/teacher_forward" not in m


def test_attach_teacher_follows_the_domain_feedback_policy_and_the_token_cap():
    from types import SimpleNamespace

    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.models.tiny import ensure_tiny_base

    tok = load_tokenizer(ensure_tiny_base())
    # One group of two failed samples with feedback: feedback is their only possible context.
    records = [{"prompt": "Compute 2+2."}] * 2
    texts = ["5", "6"]
    results = [SimpleNamespace(feedback="wrong answer " * 5)] * 2

    def attach(domain, *overrides):
        teacher = SelfTeacher(load_config("tiny_sdpo", ["algorithm.group_size=2", *overrides]), None, tok)
        teacher.reasoning_end_ids = None
        b = SequenceBatch([[1, 2]] * 2, [[5], [6]])
        b.tensors["loss_mask"] = b.response_mask()
        has, _ = teacher.attach(b, records, texts, torch.zeros(2), results, 0, domain=domain)
        return has, b

    assert attach("math")[0] == [False, False]  # the reference's policy: no feedback outside code
    has, b = attach("code")
    assert has == [True, True] and float(b.tensors["loss_mask"].sum()) == 2.0
    full = b.teacher_prompt_ids[0]
    has, b = attach("code", "algorithm.sdpo.context.max_context_tokens=7")
    assert len(full) > 7 and b.teacher_prompt_ids[0] == full[-7:]  # the end is kept
    assert attach("math", "algorithm.sdpo.context.feedback_domains=[math]")[0] == [True, True]


def _attach(trainer, preset_overrides, domain, results, *, truncated=None, rewards=None, texts=("5", "6")):
    teacher = SelfTeacher(
        load_config("tiny_sdpo", ["algorithm.group_size=2", *preset_overrides]), None, trainer.tokenizer
    )
    teacher.reasoning_end_ids = None
    b = SequenceBatch([[1, 2]] * 2, [[5, 6, 7], [6, 7, 8]])
    b.tensors["loss_mask"] = b.response_mask()
    rewards = torch.zeros(2) if rewards is None else rewards
    has, _ = teacher.attach(
        b, [{"prompt": "Compute 2+2."}] * 2, list(texts), rewards, results, 7, domain=domain, truncated=truncated
    )
    return has, b


@pytest.fixture(scope="module")
def bare_trainer():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.models.tiny import ensure_tiny_base

    return SimpleNamespace(tokenizer=load_tokenizer(ensure_tiny_base()))


def test_math_format_feedback_uses_the_reference_words_only_for_format_errors(bare_trainer):
    from megatron_sdpo.rewards.math import FORMAT_FEEDBACK, TRUNCATED_FEEDBACK
    from megatron_sdpo.rewards.result import RewardResult

    on = ["algorithm.sdpo.context.feedback_domains=[math]", "algorithm.sdpo.context.math_feedback=format"]
    no_box = RewardResult(0.0, "No \\boxed{} answer found.", {"error": "no_box"})
    wrong = RewardResult(0.0, "Your final answer 6 is incorrect.", {"answer": "6", "error": None})
    # A wrong answer in the right format gets no feedback; a missing box gets the reference's sentence.
    has, b = _attach(bare_trainer, on, "math", [no_box, wrong])
    assert has == [True, False]
    assert FORMAT_FEEDBACK in bare_trainer.tokenizer.decode(b.teacher_prompt_ids[0])
    # A truncated response gets the truncation sentence whatever its box.
    has, b = _attach(bare_trainer, on, "math", [wrong, wrong], truncated=[False, True])
    assert has == [False, True] and TRUNCATED_FEEDBACK in bare_trainer.tokenizer.decode(b.teacher_prompt_ids[1])
    # "all" keeps the verifier's own feedback.
    has, _ = _attach(bare_trainer, on[:1], "math", [no_box, wrong])
    assert has == [True, True]


def test_mask_ratio_and_right_truncation_in_the_teacher_batch(bare_trainer):
    from megatron_sdpo.algorithms.sdpo import random_token_keep
    from megatron_sdpo.rewards.result import RewardResult

    fb = [RewardResult(0.0, "wrong answer " * 5, {})] * 2
    _, full = _attach(bare_trainer, [], "code", fb)
    assert torch.equal(full.tensors["loss_mask"], full.response_mask())  # mask_ratio 0: unchanged
    _, cut = _attach(
        bare_trainer,
        ["algorithm.sdpo.context.max_context_tokens=7", "algorithm.sdpo.context.truncation=right"],
        "code",
        fb,
    )
    assert cut.teacher_prompt_ids[0] == full.teacher_prompt_ids[0][:7]  # the start is kept
    _, masked = _attach(bare_trainer, ["algorithm.sdpo.mask_ratio=0.5"], "code", fb)
    keep = random_token_keep(tuple(full.response_mask().shape), 0.5, 7)  # the step's seed
    assert 0 < float(keep.sum()) < keep.numel()
    assert torch.equal(masked.tensors["loss_mask"], full.response_mask() * keep)


class MiniBatchBackend(RecordingBackend):
    """Trains in mini-batches; its policy (before any update) is off the engine by `shift` nats
    per token, and it moves by a further 1 nat per optimizer step (which must not count)."""

    def __init__(self, log, shift):
        super().__init__(log)
        self.shift, self.updates = shift, 0

    def logprobs(self, batch, *, model="policy"):
        return (batch.tensors["rollout_logprobs"] + self.shift + self.updates) * batch.response_mask()

    def train_step(self, batch, loss_fn):
        self.log.append("train")
        assert "old_logprobs" in batch.tensors
        self.updates += 1
        return {"loss": 0.0, "refit/logprob_diff_mean": 99.0}


def test_with_mini_batches_the_guard_reads_the_rollout_time_policy():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.data.synthetic import generate
    from megatron_sdpo.errors import RefitError
    from megatron_sdpo.models.tiny import ensure_tiny_base

    tok = load_tokenizer(ensure_tiny_base())
    records = generate("math", "id", 4, 0)
    # Every reward is 0 here: skipping would leave no row for the guard to measure.
    cfg = load_config(
        "tiny", ["algorithm.prompts_per_step=4", "algorithm.grpo.mini_batches=2", "algorithm.skip_zero_signal=false"]
    )
    log = []
    trainer = Trainer(cfg, MiniBatchBackend(log, shift=0.25), RecordingEngine(log), tok)
    out = trainer.step("math", records, seed=0).metrics
    assert log.count("train") == 2 and out["optimizer_steps"] == 2.0
    # The mean over the whole batch of the pre-update mismatch; not the steps' partial shares.
    assert out["refit/logprob_diff_mean"] == pytest.approx(0.25)
    assert out["refit/logprob_diff_max"] == pytest.approx(0.25)
    trainer = Trainer(cfg, MiniBatchBackend([], shift=0.75), RecordingEngine([]), tok)
    with pytest.raises(RefitError, match="mean .* 0.75 > rollout.guard.max_mismatch 0.5"):
        trainer.step("math", records, seed=0)


class ScriptedEngine(RolloutEngine):
    """Answers sample j of prompt p with the text answer(p, j), j + 1 tokens of id 10 + j at
    sampling logprob -(j + 1) / 2 each (ragged: the batch must pad them), truncated for j == 0;
    records what the trainer hands it."""

    def __init__(self, answer):
        self.answer = answer
        self.calls = {}
        self.last_sync, self.sent_checksums, self.received_checksums = {}, {}, {}

    def generate(self, prompt_ids, sampling):
        from megatron_sdpo.rollout.base import Completion

        self.calls["generate"] = (prompt_ids, sampling)
        return [
            Completion(p, [10 + j] * (j + 1), [-0.5 * (j + 1)] * (j + 1), self.answer(p, j), j == 0)
            for p in range(len(prompt_ids))
            for j in range(sampling.n)
        ]

    def sleep(self):
        pass

    def wake(self, tags=None):
        pass

    def update_weights(self, named_tensors):
        self.calls["refit"] = list(named_tensors)


class CapturingBackend:
    """Records the batch and loss of each train_step and returns fixed step metrics; scores every
    response token at log-prob -1/4."""

    topk_source = "logits"  # the Backend protocol: where a top-k loss gets its top-k
    device = torch.device("cpu")
    dp_size = 1

    def __init__(self):
        self.trained, self.scored = [], []
        self.weights = [("w", torch.ones(3))]

    def logprobs(self, batch, *, model="policy"):
        self.scored.append(model)
        return -0.25 * batch.response_mask()

    def train_step(self, batch, loss_fn):
        self.trained.append((batch, loss_fn))
        return {"loss": 0.125, "grad_norm": 2.0, "refit/logprob_diff_mean": 0.0}

    def export_weights(self, *, model="policy"):
        assert model == "policy"
        yield from self.weights


@pytest.fixture(scope="module")
def tok():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.models.tiny import ensure_tiny_base

    return load_tokenizer(ensure_tiny_base())


def _boxed(record) -> str:
    return f"\\boxed{{{record['answer']}}}"


def test_step_passes_rollout_rewards_and_advantages_to_the_backend(tok):
    """GRPO: what step hands from the engine to the verifier, the advantages, the backend's
    train_step and back to the engine, and the metrics it reports."""
    from megatron_sdpo.chat import encode_prompts
    from megatron_sdpo.data.synthetic import generate
    from megatron_sdpo.rollout.guard import SEQ_WEIGHT, TOKEN_WEIGHT, GuardedLoss

    cfg = load_config(
        "tiny", ["algorithm.prompts_per_step=2", "algorithm.group_size=4", "algorithm.grpo.norm_by_std=true"]
    )
    records = generate("math", "id", 2, 0)
    # Sample 0 of each prompt answers it (reward 1), the others do not (reward 0).
    wrong = ["no idea", "\\boxed{-7}", ""]
    engine = ScriptedEngine(lambda p, j: _boxed(records[p]) if j == 0 else wrong[j - 1])
    backend = CapturingBackend()
    trainer = Trainer(cfg, backend, engine, tok)
    out = trainer.step("math", records, seed=17, step=0)

    prompts, sampling = engine.calls["generate"]
    assert prompts == encode_prompts(tok, [r["prompt"] for r in records])
    assert (sampling.n, sampling.seed, sampling.max_new_tokens) == (4, 17, cfg.rollout.max_new_tokens)
    assert (sampling.temperature, sampling.top_p) == (cfg.rollout.temperature, cfg.rollout.top_p)

    ((batch, loss_fn),) = backend.trained
    assert loss_fn is trainer.loss_fn and isinstance(loss_fn, GuardedLoss)
    assert batch.prompt_ids == [prompts[0]] * 4 + [prompts[1]] * 4
    assert batch.response_ids == [[10 + j] * (j + 1) for j in range(4)] * 2
    assert batch.teacher_prompt_ids is None
    t = batch.tensors
    mask = torch.tensor([[1.0] * (j + 1) + [0.0] * (3 - j) for j in range(4)] * 2)
    assert torch.equal(t["loss_mask"], mask)
    assert torch.equal(t["rollout_logprobs"], -0.5 * torch.tensor([1.0, 2.0, 3.0, 4.0] * 2)[:, None] * mask)
    assert torch.equal(t[TOKEN_WEIGHT], mask / 20.0) and torch.equal(t[SEQ_WEIGHT], torch.full((8,), 1 / 8))
    # Rewards [1, 0, 0, 0] in each group: mean 1/4, unbiased std 1/2, eps 1e-6.
    hi, lo = 0.75 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6)
    assert torch.allclose(t["advantages"], torch.tensor([hi, lo, lo, lo] * 2), rtol=1e-6, atol=0)

    m = out.metrics
    assert (m["reward_mean"], m["solve_rate"], m["response_len"], m["teacher_context_frac"]) == (0.25, 0.25, 2.5, 0.0)
    assert m["reward_std"] == pytest.approx(float(torch.tensor([1.0, 0, 0, 0] * 2).std()))
    assert (m["loss"], m["grad_norm"]) == (0.125, 2.0)  # the backend's step metrics, as returned
    assert out.responses[4] == _boxed(records[1]) and out.truncated == [True, False, False, False] * 2
    assert out.token_lengths == [1, 2, 3, 4] * 2 and out.has_context == [False] * 8
    assert engine.calls["refit"] == backend.weights  # the policy's weights, after the update


def test_shots_precede_the_student_and_the_teacher_prompts(tok):
    """A domain's worked examples (the records' history) come before the prompt for the engine
    and before the re-prompt for the teacher; only the last user turn differs between them."""
    from megatron_sdpo.chat import encode_prompt
    from megatron_sdpo.config.schema import Shot
    from megatron_sdpo.data.sources import with_shots
    from megatron_sdpo.data.synthetic import generate

    # The batch as the trainer builds it (no row left out: the rewarded sample has no context).
    cfg = load_config(
        "tiny_sdpo", ["algorithm.prompts_per_step=1", "algorithm.group_size=2", "algorithm.skip_zero_signal=false"]
    )
    shot = Shot(user="Zed has 2 pens and gets 3 more. How many pens now?", assistant="2 + 3 = \\boxed{5}")
    records = with_shots(generate("math", "id", 1, 0), [shot])
    engine = ScriptedEngine(lambda p, j: _boxed(records[p]) if j == 0 else "\\boxed{-7}")
    backend = CapturingBackend()
    Trainer(cfg, backend, engine, tok).step("math", records, seed=3, step=0)

    (prompts, _), ((batch, _),) = engine.calls["generate"], backend.trained
    assert prompts == [encode_prompt(tok, records[0]["prompt"], records[0]["history"])]
    teacher = batch.teacher_prompt_ids[1]
    # The shared head: everything up to the last user turn's text (chat header of that turn).
    head = encode_prompt(tok, "", records[0]["history"])
    k = next(i for i, (a, b) in enumerate(zip(head, prompts[0], strict=False)) if a != b)
    assert k > len(encode_prompt(tok, "")) and teacher[:k] == prompts[0][:k]
    assert "Zed has 2 pens" in tok.decode(teacher) and _boxed(records[0]) in tok.decode(teacher)


def test_sdpo_step_passes_the_teacher_prompts_and_the_distillation_mask(tok):
    from megatron_sdpo.algorithms.losses import SDPOLoss
    from megatron_sdpo.data.synthetic import generate

    cfg = load_config(
        "tiny_sdpo", ["algorithm.prompts_per_step=1", "algorithm.group_size=2", "algorithm.skip_zero_signal=false"]
    )
    records = generate("math", "id", 1, 0)
    engine = ScriptedEngine(lambda p, j: _boxed(records[p]) if j == 0 else "\\boxed{-7}")
    backend = CapturingBackend()
    trainer = Trainer(cfg, backend, engine, tok)
    out = trainer.step("math", records, seed=3, step=0)

    ((batch, loss_fn),) = backend.trained
    assert isinstance(loss_fn.inner, SDPOLoss) and "advantages" not in batch.tensors  # no GRPO term
    # The failed sample is re-prompted with its successful sibling; the teacher scores the
    # student's own answer tokens.
    assert out.has_context == [p is not None for p in batch.teacher_prompt_ids] and out.has_context[1]
    assert _boxed(records[0]) in tok.decode(batch.teacher_prompt_ids[1])
    # Distillation mask: the response tokens of the samples with a teacher context, nothing else.
    has = torch.tensor([[float(h)] for h in out.has_context])
    assert torch.equal(batch.tensors["loss_mask"], torch.tensor([[1.0, 0.0], [1.0, 1.0]]) * has)
    assert out.metrics["teacher_context_frac"] == sum(out.has_context) / 2
    # The teacher-signal diagnostic (due at step 0): the teacher's -1/4 per token against the
    # unrewarded sample's rollout log-prob of -1 per token.
    assert backend.scored == ["teacher"] and out.metrics["teacher/gain_unrewarded"] == 0.75


def test_rows_without_signal_leave_the_train_step(tok):
    """GRPO with one group all wrong: its rows never reach the backend; the loss keeps the whole
    batch's normalizer and the guard measures the trained rows."""
    from megatron_sdpo.algorithms.signal_rows import PresetNormalizer
    from megatron_sdpo.data.synthetic import generate
    from megatron_sdpo.rollout.guard import SEQ_WEIGHT, TOKEN_WEIGHT

    cfg = load_config("tiny", ["algorithm.prompts_per_step=2", "algorithm.group_size=4"])
    assert cfg.algorithm.skip_zero_signal  # the default
    records = generate("math", "id", 2, 0)
    engine = ScriptedEngine(lambda p, j: _boxed(records[p]) if p == 0 and j == 0 else "\\boxed{-7}")
    backend = CapturingBackend()
    out = Trainer(cfg, backend, engine, tok).step("math", records, seed=17, step=0)
    ((batch, loss_fn),) = backend.trained
    assert isinstance(loss_fn, PresetNormalizer) and len(batch) == 4  # the first prompt's group
    assert float(loss_fn.global_normalizer(batch.tensors)) == 20.0  # all 8 responses' tokens
    t = batch.tensors
    assert float(t[TOKEN_WEIGHT].sum()) == pytest.approx(1.0) and float(t[SEQ_WEIGHT].sum()) == pytest.approx(1.0)
    assert out.metrics["train/rows_skipped"] == 4.0 and out.metrics["samples"] == 8.0
