"""Rewards scored once across the launch: at 2 ranks each item reaches the verifier on one rank
only, and every rank gets every result, equal to a single process's."""

import pytest

pytestmark = pytest.mark.distributed


def _items():
    from megatron_sdpo.data import synthetic

    records = synthetic.generate("code", "train", 5, 0, None)
    texts = [r["solution"] if i % 2 else "print(0)" for i, r in enumerate(records)]
    return texts, records


def _rank_scores():
    import megatron_sdpo.rewards as rewards
    from megatron_sdpo.rollout.scoring import score_shared

    seen = []
    real = rewards.score_batch

    def counting(domain, texts, records, **kw):
        seen.extend(r["id"] for r in records)
        return real(domain, texts, records, **kw)

    rewards.score_batch = counting
    texts, records = _items()
    results = score_shared("code", texts, records, batched_code=True)
    return seen, [(r.score, r.feedback) for r in results]


def test_each_item_is_scored_on_one_rank_and_every_rank_gets_all_results():
    from megatron_sdpo.backends.megatron.launch import spawn
    from megatron_sdpo.rewards import score_batch

    (seen0, res0), (seen1, res1) = spawn(_rank_scores, 2, timeout_s=300)
    texts, records = _items()
    assert sorted(seen0 + seen1) == sorted(r["id"] for r in records)  # once each, 5 items over 2 ranks
    assert len(seen0) == 3 and len(seen1) == 2
    alone = [(r.score, r.feedback) for r in score_batch("code", texts, records, batched_code=True)]
    assert res0 == res1 == alone
    assert {s for s, _ in alone} == {0.0, 1.0}  # both outcomes present: the order of results matters
