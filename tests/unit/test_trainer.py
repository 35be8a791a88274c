"""Trainer pieces that need no model: the teacher-signal diagnostic."""
import time

import pytest
import torch

from megatron_sdpo.backends.base import SequenceBatch
from megatron_sdpo.config import load_config
from megatron_sdpo.trainer import Trainer


class FixedTeacher:
    """A backend whose teacher logprobs are given."""

    def __init__(self, teacher_lp: torch.Tensor):
        self.teacher_lp = teacher_lp
        self.calls = []

    def logprobs(self, batch, *, model="policy"):
        self.calls.append(model)
        return self.teacher_lp


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
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.backend = cfg, backend
    out = trainer._teacher_signal(_batch(), torch.tensor([1.0, 0.0, 0.5, 1.0]))
    assert backend.calls == ["teacher"]
    assert out["teacher/gain_rewarded"] == pytest.approx(1.0)
    assert out["teacher/gain_unrewarded"] == pytest.approx((0.25 - 0.5) / 2)
    assert out["teacher/gain_gap"] == pytest.approx(1.125)
    # Hybrid runs keep the distillation mask under "sdpo_mask"; only one side present: no gap.
    trainer.cfg = load_config("tiny_sdpo", ["algorithm.name=hybrid"])
    b = _batch("sdpo_mask")
    b.tensors["loss_mask"] = b.response_mask()
    only = trainer._teacher_signal(b, torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert set(only) == {"teacher/gain_unrewarded"}


class RecordingEngine:
    """A rollout engine that records the order of calls (sleep/wake are no-ops on CPU vLLM, so
    the order is what can be checked here)."""

    def __init__(self, log):
        self.log = log
        self.awake = True

    def generate(self, prompt_ids, sampling):
        from megatron_sdpo.rollout.base import Completion

        assert self.awake, "generate on a sleeping engine"
        self.log.append("generate")
        return [Completion(i // sampling.n, [7, 8], [-1.0, -2.0], "x", False) for i in range(len(prompt_ids) * sampling.n)]

    def sleep(self):
        self.log.append("sleep")
        self.awake = False

    def wake(self):
        self.log.append("wake")
        self.awake = True

    def update_weights(self, named_tensors):
        assert self.awake, "weights written into a sleeping engine"
        self.log.append("refit")
        for _ in named_tensors:
            self.log.append("tensor")


class RecordingBackend:
    def __init__(self, log):
        self.log = log

    def train_step(self, batch, loss_fn):
        self.log.append("train")
        assert "logprobs" in loss_fn.requires  # the guard reads the loss's own logprobs
        return {"loss": 0.0, "refit/logprob_diff_mean": 0.0}

    def export_weights(self, *, model="policy"):
        self.log.append("export")
        yield "w", torch.zeros(2)


def test_step_order_generate_sleep_train_wake_refit():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.data.synthetic import generate
    from megatron_sdpo.models.tiny import ensure_tiny_base

    cfg = load_config("tiny")
    log = []
    tok = load_tokenizer(ensure_tiny_base())
    trainer = Trainer(cfg, RecordingBackend(log), RecordingEngine(log), tok)
    records = generate("math", "id", 2, 0)
    for step in range(2):
        trainer.step("math", records, seed=step, step=step)
    one = ["generate", "sleep", "train", "wake", "refit", "export", "tensor"]
    assert log == one + one


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
    trainer = Trainer.__new__(Trainer)
    trainer.tokenizer, trainer._reasoning_end_ids = tok, None
    # One group of two failed samples with feedback: feedback is their only possible context.
    records = [{"prompt": "Compute 2+2."}] * 2
    texts = ["5", "6"]
    results = [SimpleNamespace(feedback="wrong answer " * 5)] * 2

    def attach(domain, *overrides):
        trainer.cfg = load_config("tiny_sdpo", ["algorithm.group_size=2", *overrides])
        b = SequenceBatch([[1, 2]] * 2, [[5], [6]])
        b.tensors["loss_mask"] = b.response_mask()
        has = trainer._attach_teacher(b, records, texts, torch.zeros(2), results, 0, domain=domain)
        return has, b

    assert attach("math")[0] == [False, False]  # the reference's policy: no feedback outside code
    has, b = attach("code")
    assert has == [True, True] and float(b.tensors["loss_mask"].sum()) == 2.0
    full = b.teacher_prompt_ids[0]
    has, b = attach("code", "algorithm.sdpo.context.max_context_tokens=7")
    assert len(full) > 7 and b.teacher_prompt_ids[0] == full[-7:]  # the end is kept
    assert attach("math", "algorithm.sdpo.context.feedback_domains=[math]")[0] == [True, True]


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
    cfg = load_config("tiny", ["algorithm.prompts_per_step=4", "algorithm.grpo.mini_batches=2"])
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
