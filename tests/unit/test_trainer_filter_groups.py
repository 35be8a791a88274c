"""The trainer's step under DAPO's dynamic sampling (rollout/group_filter.py): rounds, seeds,
the cap, the batch's shape, and the same rounds again for a repeated (resumed) step."""

import pytest
from test_trainer import CapturingBackend

from megatron_sdpo.rollout.base import Completion


@pytest.fixture(scope="module")
def tok():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.models.tiny import ensure_tiny_base

    return load_tokenizer(ensure_tiny_base())


class RoundEngine:
    """Answers every sample of a prompt whose record says `solved` correctly (an all-1 group),
    of `mixed` half correctly, of the others wrongly; records each round's prompts and seed."""

    def __init__(self, records_by_prompt):
        self.by_prompt, self.rounds, self.sleeps = records_by_prompt, [], 0
        self.last_sync, self.sent_checksums, self.received_checksums = {}, {}, {}

    def generate(self, prompt_ids, sampling):
        self.rounds.append(([tuple(p) for p in prompt_ids], sampling.seed))
        out = []
        for i, p in enumerate(prompt_ids):
            rec = self.by_prompt[tuple(p)]
            for j in range(sampling.n):
                right = rec["kind"] == "solved" or (rec["kind"] == "mixed" and j % 2 == 0)
                out.append(
                    Completion(i, [10 + j, 11], [-0.5, -0.5], "\\boxed{%s}" % (rec["answer"] if right else "-7"), False)
                )
        return out

    def sleep(self):
        self.sleeps += 1

    def wake(self, tags=None):
        pass

    def update_weights(self, named_tensors):
        list(named_tensors)


def _records(kinds, start=0):
    from megatron_sdpo.data.synthetic import generate

    recs = generate("math", "id", start + len(kinds), 0)[start:]
    return [dict(r, kind=k) for r, k in zip(recs, kinds, strict=True)]


def _trainer(tok, records, extra_rounds, skip=True):
    from megatron_sdpo.chat import record_prompts
    from megatron_sdpo.config import load_config
    from megatron_sdpo.trainer import Trainer

    cfg = load_config(
        "tiny",
        [
            "algorithm.prompts_per_step=2",
            "algorithm.group_size=4",
            "algorithm.filter_groups.enabled=true",
            f"algorithm.filter_groups.max_extra_rounds={extra_rounds}",
            f"algorithm.skip_zero_signal={str(skip).lower()}",
        ],
    )
    engine = RoundEngine({tuple(p): r for p, r in zip(record_prompts(tok, records), records, strict=True)})
    backend = CapturingBackend()
    return Trainer(cfg, backend, engine, tok), engine, backend


class Refills:
    """trainer.StepHooks with extra generation rounds from `prompts(round_)` only."""

    def __init__(self, prompts):
        self.prompts = prompts

    def after_train(self, step: int) -> None:
        pass

    def refill(self, step: int, round_: int) -> list[dict]:
        return self.prompts(round_)

    def between_phases(self, left: tuple[str, ...]) -> None:
        pass


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("extra_rounds", [0, 1, 3])
def test_the_step_refills_until_full_or_the_cap(tok, extra_rounds, skip):
    from megatron_sdpo.trainer import extra_round_seed

    first = _records(["mixed", "solved"])
    refills = {
        1: _records(["wrong", "wrong"], 2),
        2: _records(["solved", "mixed"], 4),
        3: _records(["mixed", "mixed"], 6),
    }
    trainer, engine, backend = _trainer(tok, first + [r for rs in refills.values() for r in rs], extra_rounds, skip)
    asked = []
    out = trainer.step("math", first, seed=11, hooks=Refills(lambda r: asked.append(r) or refills[r]))
    rounds = min(extra_rounds, 2) + 1  # the second extra round completes the batch
    assert asked == list(range(1, rounds)) and len(engine.rounds) == rounds and engine.sleeps == 1
    assert [seed for _, seed in engine.rounds] == [extra_round_seed(11, r) for r in range(rounds)]
    m = out.metrics
    assert m["dynamic/rounds"] == rounds and m["dynamic/extra_rollouts"] == 8.0 * (rounds - 1)
    ((batch, _),) = backend.trained
    assert len(batch) == 8 or m["samples"] == 8.0  # the batch keeps its shape
    filled = rounds < 3
    assert m["dynamic/kept_groups"] == 2.0 - filled and m["dynamic/filled_groups"] == float(filled)
    if not skip:
        # first's mixed group, then refill 2's mixed one; or one, filled with the latest
        # filtered-out group
        assert (batch.tensors["advantages"].reshape(2, 4) != 0).any(1).tolist() == [True, not filled]
    else:  # the filling group leaves the train step at no cost
        assert len(batch) == 8 - 4 * filled and m["train/rows_skipped"] == 4.0 * filled


def test_a_repeated_step_draws_the_same_rounds(tok):
    """What a resumed run relies on: the same step (records, seed, refill) generates the same."""
    first = _records(["wrong", "solved"])
    refills = {1: _records(["mixed", "wrong"], 2), 2: _records(["mixed", "solved"], 4)}
    seen = []
    for _ in range(2):
        trainer, engine, backend = _trainer(tok, first + refills[1] + refills[2], 2)
        trainer.step("math", first, seed=5, hooks=Refills(refills.__getitem__))
        seen.append((engine.rounds, backend.trained[0][0].response_ids, backend.trained[0][0].prompt_ids))
    assert seen[0] == seen[1] and len(seen[0][0]) == 3
