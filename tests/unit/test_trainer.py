"""Trainer pieces that need no model: the teacher-signal diagnostic."""
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
