"""One eval row: an out-of-domain set keeps its own scorer, and a set listed by several domains
is generated and scored once."""
from megatron_sdpo.config import load_config
from megatron_sdpo.evaluation import evaluate_config, load_eval_sets
from megatron_sdpo.rollout.base import Completion

MMLU = {"source": "tests/fixtures/data/mmlu_redux.jsonl", "schema": "mmlu_redux"}


class CountingEngine:
    """Answers every prompt with "<answer>B</answer>" and counts the prompts it was asked."""

    def __init__(self):
        self.prompts = 0

    def generate(self, prompt_ids, sampling):
        self.prompts += len(prompt_ids)
        return [Completion(i // sampling.n, [1], [-1.0], "<answer>B</answer>", False)
                for i in range(len(prompt_ids) * sampling.n)]


class Tokenizer:
    def apply_chat_template(self, messages, **_):
        return [len(m["content"]) for m in messages]


def _overrides():
    flat = "{" + ", ".join(f"{k}: {v}" for k, v in MMLU.items()) + "}"
    return [f"domains.math.eval.ood_far={flat}", f"domains.tooluse.eval.ood_far={flat}"]


def test_an_ood_set_listed_by_two_domains_loads_with_its_own_domain_and_is_scored_once(monkeypatch):
    cfg = load_config("tiny", _overrides())
    sets = load_eval_sets(cfg)
    assert sets["math/ood_far"] == sets["tooluse/ood_far"]
    assert {r["domain"] for r in sets["math/ood_far"]} == {"science"}  # MMLU keeps its own domain

    import megatron_sdpo.rewards as rewards

    calls = []
    real = rewards.score_batch

    def counting(domain, responses, records, **kw):
        calls.append((domain, len(responses)))
        return real(domain, responses, records, **kw)

    monkeypatch.setattr(rewards, "score_batch", counting)
    monkeypatch.setattr("megatron_sdpo.evaluation.record_prompts", lambda tok, recs: [[1, 2]] * len(recs))
    engine = CountingEngine()
    wanted = {key: sets[key] for key in ("math/id", "math/ood_far", "tooluse/ood_far")}
    accs, samples = evaluate_config(engine, Tokenizer(), wanted, cfg, seed=0)
    n_mmlu = len(sets["math/ood_far"])
    assert engine.prompts == len(sets["math/id"]) + n_mmlu  # the MMLU set once, not twice
    assert calls == [("math", len(sets["math/id"])), ("science", n_mmlu)]  # MMLU scored as multiple choice
    assert accs["math/ood_far"] == accs["tooluse/ood_far"]
    assert samples["math/ood_far"] == samples["tooluse/ood_far"]
    expected = sum(r["answer"] == "B" for r in sets["math/ood_far"]) / n_mmlu
    assert 0 < expected < 1
    assert accs["math/ood_far"] == expected
