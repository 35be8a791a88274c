"""RL on the tiny base really learns: a few GRPO steps on one domain raise its reward."""

import pytest
import torch

from megatron_sdpo import builders
from megatron_sdpo.config import load_config
from megatron_sdpo.continual import step_seed, train_batch
from megatron_sdpo.data import synthetic
from megatron_sdpo.evaluation import evaluate
from megatron_sdpo.trainer import Trainer

STEPS = 30


@pytest.mark.slow
def test_grpo_steps_raise_reward_on_math(tmp_path):
    torch.set_num_threads(1)  # the same arithmetic on every machine: the run is deterministic
    cfg = load_config("tiny", ["rollout.engine=hf", "diagnostics.enabled=false"])
    model_path = builders.resolve_model_path(cfg)
    tok = builders.load_tokenizer(model_path)
    backend = builders.make_backend(cfg, model_path, tok)
    engine = builders.make_rollout(cfg, model_path, tok, str(tmp_path))
    trainer = Trainer(cfg, backend, engine, tok)
    records = synthetic.generate("math", "train", 512, seed=0)
    held_out = {"math/id": synthetic.generate("math", "id", 64, seed=1)}

    def accuracy():
        accs, _ = evaluate(
            engine, tok, held_out, greedy=True, avg_k=0, max_new_tokens=32, temperature=1.0, batch_size=64, seed=0
        )
        return accs["math/id"]

    before = accuracy()
    rewards = []
    for step in range(STEPS):
        batch = train_batch(records, seed=0, stage=0, step=step, size=cfg.algorithm.prompts_per_step)
        out = trainer.step("math", batch, seed=step_seed(0, 0, step))
        rewards.append(out.metrics["reward_mean"])
    after = accuracy()
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.05, (rewards, before, after)
    assert after > before, (rewards, before, after)
