"""One eval row: an out-of-domain set keeps its own scorer, and a set listed by several domains
is generated and scored once; a stop signal is honoured between the sets of a row."""

import pytest

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
        return [
            Completion(i // sampling.n, [1], [-1.0], "<answer>B</answer>", False)
            for i in range(len(prompt_ids) * sampling.n)
        ]


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


class SamplingEngine(CountingEngine):
    """Records the sampling settings it was asked to generate with."""

    def __init__(self):
        super().__init__()
        self.sampling = []

    def generate(self, prompt_ids, sampling):
        self.sampling.append(sampling)
        return super().generate(prompt_ids, sampling)


def test_paper_eval_samples_four_answers_per_item_at_the_reference_settings(monkeypatch):
    monkeypatch.setattr("megatron_sdpo.evaluation.record_prompts", lambda tok, recs: [[1, 2]] * len(recs))
    # The paper presets' eval section on the tiny preset's synthetic sets.
    cfg = load_config("tiny", ["eval.greedy=false", "eval.avg_k=4", "eval.temperature=0.6", "eval.top_p=0.95"])
    sets = load_eval_sets(cfg)
    engine = SamplingEngine()
    accs, samples = evaluate_config(engine, Tokenizer(), {"science/id": sets["science/id"]}, cfg, seed=0)
    s = engine.sampling[0]
    assert (s.n, s.temperature, s.top_p, s.greedy) == (4, 0.6, 0.95, False)
    assert len(samples["science/id"]) == 4 * len(sets["science/id"])
    # avg@4: the mean 0/1 accuracy over every sample (here all four answers of an item agree).
    per_item = sum(r["answer"] == "B" for r in sets["science/id"]) / len(sets["science/id"])
    assert accs["science/id"] == per_item
    # null temperature: the rollout's; the tiny preset's top-p stays 1.
    engine = SamplingEngine()
    evaluate_config(
        engine,
        Tokenizer(),
        {"science/id": sets["science/id"]},
        load_config("tiny", ["eval.greedy=false", "eval.avg_k=2"]),
        seed=0,
    )
    assert (engine.sampling[0].temperature, engine.sampling[0].top_p) == (cfg.rollout.temperature, 1.0)
    paper = load_config("qwen3_4b_frozen").eval
    assert (paper.greedy, paper.avg_k, paper.temperature, paper.top_p) == (False, 4, 0.6, 0.95)


def test_an_eval_split_holds_its_extra_files_after_its_source(tmp_path):
    import json

    a, b = tmp_path / "aime24.jsonl", tmp_path / "aime25.jsonl"
    a.write_text("\n".join(json.dumps({"ID": f"2024-I-{k}", "Problem": f"p{k}", "Answer": k}) for k in (1, 2)) + "\n")
    # The second file has no ids (row-index ids, no clash); the third repeats an id of the first.
    b.write_text("\n".join(json.dumps({"problem": f"q{k}", "answer": str(k)}) for k in (3, 4)) + "\n")
    b2 = tmp_path / "more.jsonl"
    b2.write_text(json.dumps({"ID": "2024-I-1", "Problem": "clash", "Answer": 9}) + "\n")
    src = f"{{source: {a}, schema: aime, n: 0, extra_files: [{b}, {b2}]}}"
    sets = load_eval_sets(load_config("tiny", [f"domains.math.eval.id={src}"]))
    recs = sets["math/id"]
    assert [r["answer"] for r in recs] == ["1", "2", "3", "4", "9"]
    ids = [r["id"] for r in recs]
    assert ids[:2] == ["2024-I-1", "2024-I-2"] and ids[4] == "more:2024-I-1" and len(set(ids)) == 5


def test_extra_files_are_for_file_backed_eval_splits():
    import pytest

    from megatron_sdpo.errors import ConfigError

    with pytest.raises(ConfigError, match="extra_files applies to file-backed eval splits only"):
        load_config("tiny", ["domains.math.eval.id.extra_files=[x.jsonl]"])
    with pytest.raises(ConfigError, match="eval.top_p must be in"):
        load_config("tiny", ["eval.top_p=0"])
    with pytest.raises(ConfigError, match="eval.temperature must be > 0"):
        load_config("tiny", ["eval.temperature=0"])


def test_between_runs_before_every_set_after_the_first_and_can_abandon_the_row(monkeypatch):
    monkeypatch.setattr("megatron_sdpo.evaluation.record_prompts", lambda tok, recs: [[1, 2]] * len(recs))
    cfg = load_config("tiny")
    sets = load_eval_sets(cfg)
    keys = ["math/id", "science/id", "tooluse/id"]
    seen = []
    engine = CountingEngine()
    evaluate_config(
        engine, Tokenizer(), {k: sets[k] for k in keys}, cfg, seed=0, between=lambda: seen.append(engine.prompts)
    )
    assert seen == [len(sets["math/id"]), len(sets["math/id"]) + len(sets["science/id"])]

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    engine = CountingEngine()
    with pytest.raises(Stop):
        evaluate_config(engine, Tokenizer(), {k: sets[k] for k in keys}, cfg, seed=0, between=stop)
    assert engine.prompts == len(sets["math/id"])  # nothing generated after the stop


def test_a_signal_during_an_eval_row_stops_the_run_between_sets(monkeypatch, tmp_path):
    import signal

    from megatron_sdpo.continual import ContinualRun
    from megatron_sdpo.stop_request import StopRequest, StopRequested
    from megatron_sdpo.stopwatch import RunClock

    monkeypatch.setattr("megatron_sdpo.evaluation.record_prompts", lambda tok, recs: [[1, 2]] * len(recs))
    cfg = load_config("tiny")
    sets = load_eval_sets(cfg)
    run = ContinualRun.__new__(ContinualRun)
    run.clock = RunClock()
    engine = CountingEngine()
    engine.wake = lambda: None
    logged = []
    run.engine, run.tokenizer, run.cfg, run.main = engine, Tokenizer(), cfg, False
    run.eval_sets = {k: sets[k] for k in ("math/id", "science/id")}
    run.stop = StopRequest()
    run.stop.received = signal.SIGTERM  # arrived while the first set was generated
    run.drift_jobs = type("Jobs", (), {"stop": lambda self: None})()
    run.monitor = type("Monitor", (), {"log": lambda self, m: logged.append(m), "close": lambda self: None})()
    with pytest.raises(StopRequested, match="nothing to save yet") as info:
        run._evaluate("base", None)
    assert info.value.checkpoint is None and engine.prompts == len(sets["math/id"])
    assert logged == ["stop requested (SIGTERM): no checkpoint yet; resume with --resume"]
    with pytest.raises(StopRequested, match="checkpoint stage_1_math written"):
        run._evaluate("stage_1_math", "stage_1_math")
