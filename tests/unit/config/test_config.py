import dataclasses
from pathlib import Path

import pytest
import yaml

from megatron_sdpo.config import RunConfig, list_presets, load_config, to_dict
from megatron_sdpo.config.presets import load_raw
from megatron_sdpo.errors import ConfigError


@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_loads(preset):
    cfg = load_config(preset)
    assert isinstance(cfg, RunConfig)
    assert cfg.stages and all(s.domain in cfg.domains for s in cfg.stages)


def test_presets_include_the_documented_ones():
    assert {"tiny", "tiny_grpo", "tiny_sdpo", "tiny_stable_sdpo", "qwen3_4b", "olmo3_7b"} <= set(list_presets())


def test_base_preset_equals_dataclass_defaults():
    assert load_raw("base") == to_dict(RunConfig())


def test_defaults_inheritance_and_overrides():
    cfg = load_config("tiny_stable_sdpo", ["algorithm.sdpo.alpha=1", "stages.1.steps=7", "seed=3"])
    assert cfg.algorithm.name == "stable_sdpo"  # from itself
    assert cfg.backend.lr == pytest.approx(1e-4)  # from tiny_sdpo
    assert cfg.rollout.max_model_len == 384  # from tiny
    assert cfg.algorithm.sdpo.alpha == 1.0 and isinstance(cfg.algorithm.sdpo.alpha, float)
    assert cfg.stages[1].steps == 7 and cfg.seed == 3


def test_a_section_given_by_name_keeps_its_other_keys(tmp_path):
    cfg = load_config("tiny", ["backend=megatron", "backend.lr=3e-4"])
    assert cfg.backend.name == "megatron" and cfg.backend.lr == pytest.approx(3e-4)
    assert cfg.backend.micro_batch_size == load_config("tiny").backend.micro_batch_size
    f = tmp_path / "run.yaml"
    f.write_text("defaults: tiny\nbackend: megatron\n")
    assert load_config(str(f)).backend == cfg.backend.__class__(
        **{**vars(load_config("tiny").backend), "name": "megatron"}
    )


@pytest.mark.parametrize(
    "override, needle",
    [
        ("backend=tpu", "backend.name"),
        ("rollout=vllm", "rollout.name"),
        ("algorithm.sdpo.alpah=0.5", "algorithm.sdpo.alpah"),
        ("backend.lr=fast", "backend.lr"),
        ("algorithm.name=ppo", "algorithm.name"),
        ("eval.greedy=3", "eval.greedy"),
        ("stages.9.steps=1", "stages.9"),
        ("nokey", "key.path=value"),
        ("algorithm.sdpo.alpha=1.5", "alpha"),
        ("stages.0.domain=poetry", "stages.0.domain"),
        ("backend.megatron.tensor_parallel=1.5", "tensor_parallel"),
        ("rollout.tensor_parallel_size=0", "rollout.tensor_parallel_size"),
        ("rollout.bucket_bytes=0", "rollout.bucket_bytes"),
        ("rollout.guard.max_mismatch=0", "rollout.guard.max_mismatch"),
        ("rollout.top_p=0.9", "rollout.guard.max_mismatch=null"),
        ("stages.3.algorithm.sdpo.context.use_fedback=true", "stages.3.algorithm.sdpo.context.use_fedback"),
        ("stages.3.teacher.ema_rate=fast", "stages.3.teacher.ema_rate"),
        ("stages.3.teacher.mode=frozen", "stages.3.teacher.mode"),
        ("stages.3.algorithm.name=sdpo", "stages.3.algorithm.name"),
        ("stages.3.backend.megatron.tensor_parallel=2", "stages.3.backend.megatron"),
        ("stages.3.algorithm.sdpo.alpha=1.5", "stages.3"),
        ("algorithm.grpo.mini_batches=3", "mini_batches"),
        ("algorithm.grpo.dual_clip=0.5", "dual_clip"),
        ("algorithm.sdpo.context.feedback_domains=[poetry]", "feedback_domains.0"),
        ("teacher.reset_at_stage=always", "teacher.reset_at_stage"),
        ("backend.pack_row_tokens=-1", "backend.pack_row_tokens"),
        ("backend.share_prompts=true backend.packing=false", "backend.share_prompts"),
        ("backend.share_prompts=true backend.name=megatron", "backend.share_prompts"),
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", override.split(" "))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*tiny"):
        load_config("nope")


def test_yaml_file_with_defaults_and_unknown_key(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("defaults: tiny\nname: mine\nbackend: {lr: 0.001}\n")
    cfg = load_config(str(good))
    assert cfg.name == "mine" and cfg.backend.lr == 0.001 and cfg.algorithm.group_size == 8
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: tiny\nrollout: {temprature: 0.7}\n")
    with pytest.raises(ConfigError, match="rollout.temprature"):
        load_config(str(bad))
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml:.*invalid YAML"):
        load_config(str(broken))


def test_defaults_cycle_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(str(tmp_path / "a.yaml"))


def test_stable_sdpo_requires_restart_freeze():
    with pytest.raises(ConfigError, match="restart_freeze"):
        load_config("tiny_stable_sdpo", ["teacher.mode=ema"])


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config("qwen3_4b")
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    again = load_config(str(path))
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_yaml_12_numbers_in_overrides_and_files(tmp_path):
    cfg = load_config("tiny", ["backend.lr=2e-6", "launch.time=24:00:00", "teacher.ema_rate=.5"])
    assert cfg.backend.lr == 2e-6 and cfg.launch.time == "24:00:00" and cfg.teacher.ema_rate == 0.5
    f = tmp_path / "c.yaml"
    f.write_text("defaults: tiny\nbackend: {lr: 3e-5}\nlaunch: {time: 12:30:00}\n")
    cfg = load_config(str(f))
    assert cfg.backend.lr == 3e-5 and cfg.launch.time == "12:30:00"


def test_megatron_tp_sdpo_needs_the_fused_kernel():
    with pytest.raises(ConfigError, match="kernel.fused_kl=true"):
        load_config("qwen3_4b", ["algorithm.sdpo.topk=null"])
    with pytest.raises(ConfigError, match="topk=null"):
        load_config("qwen3_4b", ["kernel.fused_kl=true"])  # the fused kernel is full-vocabulary
    # A stage's own top-k is checked against the run's kernel settings too.
    with pytest.raises(ConfigError, match="stages.3"):
        load_config("qwen3_4b", ["algorithm.sdpo.topk=null", "kernel.fused_kl=true", "stages.3.algorithm.sdpo.topk=20"])
    # Top-k under TP: the backend computes the k ids' log-probabilities from shards.
    cfg = load_config("qwen3_4b", ["algorithm.sdpo.topk=100", "kernel.fused_kl=false"])
    from megatron_sdpo.algorithms.registry import build_loss
    from megatron_sdpo.backends.megatron import MegatronBackend

    loss = build_loss(cfg, topk_source=MegatronBackend.topk_source)
    assert loss.distillation.topk_source == "shards" and loss.distillation.topk == 100
    assert loss.requires == {"topk_logprobs", "teacher_topk_logprobs", "logprobs"}
    # A backend that hands the loss full logits gets the loss that picks the ids itself.
    from megatron_sdpo.backends.hf import HFBackend

    loss = build_loss(cfg, topk_source=HFBackend.topk_source)
    assert loss.distillation.topk_source == "logits" and loss.requires == {"logits", "teacher_logits", "logprobs"}
    assert load_config(
        "qwen3_4b",
        [
            "backend.megatron.tensor_parallel=1",
            "backend.megatron.sequence_parallel=false",
            "algorithm.sdpo.topk=100",
            "kernel.fused_kl=false",
        ],
    )


def test_tempered_sampling_keeps_the_guard_and_top_p_turns_it_off():
    """The backends score at the rollout temperature, so the guard compares like with like;
    the top-p nucleus is the engine's alone."""
    from megatron_sdpo.backends.hf import HFBackend

    cfg = load_config("tiny", ["rollout.temperature=0.7"])
    assert cfg.rollout.guard.max_mismatch == 0.5
    cfg = load_config("tiny", ["rollout.top_p=0.9", "rollout.guard.max_mismatch=null"])
    assert cfg.rollout.guard.max_mismatch is None
    with pytest.raises(ConfigError, match="rollout.temperature must be > 0"):
        load_config("tiny", ["rollout.temperature=0"])
    with pytest.raises(ConfigError, match="logit_temperature must be > 0"):
        HFBackend("unused", lr=1e-3, micro_batch_size=1, logit_temperature=-1.0)


def test_rollout_threads_is_checked():
    assert load_config("tiny", ["rollout.threads=1"]).rollout.threads == 1
    with pytest.raises(ConfigError, match="rollout.threads must be >= 1"):
        load_config("tiny", ["rollout.threads=0"])


def test_rollout_enforce_eager_reaches_the_vllm_engine(monkeypatch, tmp_path):
    """Runs compile vLLM's decoder unless rollout.enforce_eager=true (the engine class itself
    defaults to eager, for the many short-lived engines of tests and tools)."""
    import megatron_sdpo.rollout as rollout
    from megatron_sdpo import builders

    seen = []
    monkeypatch.setattr(rollout, "make_engine", lambda kind, **kw: seen.append((kind, kw.get("enforce_eager"))))
    tok = type("Tok", (), {"eos_token_id": 0, "pad_token_id": 0})()
    for overrides, eager in (([], False), (["rollout.enforce_eager=true"], True)):
        cfg = load_config("tiny", ["rollout.engine=vllm", *overrides])
        builders.make_rollout(cfg, "unused", tok, str(tmp_path))
        assert seen[-1] == ("vllm", eager)


def test_rollout_dtype_reaches_either_engine_and_megatron_keeps_the_planned_one(monkeypatch, tmp_path):
    """rollout.dtype is the engine's (auto: the model's); the megatron memory plan counts the
    engine in model.dtype, so another one there is refused before anything loads."""
    import megatron_sdpo.rollout as rollout
    from megatron_sdpo import builders

    seen = []
    monkeypatch.setattr(rollout, "make_engine", lambda kind, **kw: seen.append((kind, kw["dtype"])))
    tok = type("Tok", (), {"eos_token_id": 0, "pad_token_id": 0})()
    for engine in ("hf", "vllm"):
        for dtype, expected in (("auto", "float32"), ("bfloat16", "bfloat16")):
            cfg = load_config("tiny", [f"rollout.engine={engine}", f"rollout.dtype={dtype}"])
            builders.make_rollout(cfg, "unused", tok, str(tmp_path))
            assert seen[-1] == (engine, expected)
    assert load_config("qwen3_4b", ["rollout.dtype=bfloat16"]).rollout.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"^rollout.dtype=float32 with backend megatron: .*model.dtype \(bfloat16\)"):
        load_config("qwen3_4b", ["rollout.dtype=float32"])


def test_rollout_tensor_parallel_size_checks_the_launch(monkeypatch, tmp_path):
    from megatron_sdpo.builders import make_rollout

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="needs rollout.engine=vllm"):  # the config gate says it
        load_config("tiny", ["rollout.engine=hf", "rollout.tensor_parallel_size=2"])
    pytest.importorskip("vllm")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 needs a launch of at least 2 ranks"):
        make_rollout(
            load_config("tiny", ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"]),
            "unused",
            None,
            str(tmp_path),
        )
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 must divide the number of ranks"):
        make_rollout(
            load_config("tiny", ["rollout.engine=vllm", "rollout.tensor_parallel_size=3"]),
            "unused",
            None,
            str(tmp_path),
        )


def test_stage_overrides_are_merged_into_the_stage_config_and_recorded(tmp_path):
    from megatron_sdpo.config import dump_yaml
    from megatron_sdpo.config.stages import stage_config

    cfg = load_config(
        "tiny_sdpo",
        [
            "stages.3.algorithm.sdpo.context.use_feedback=false",
            "stages.3.teacher.ema_rate=0.01",
            "stages.3.algorithm.sdpo.alpha=1.0",
            "stages.1.backend.lr=2e-5",
        ],
    )
    code = stage_config(cfg, 3)
    assert not code.algorithm.sdpo.context.use_feedback and code.teacher.ema_rate == 0.01
    assert code.algorithm.sdpo.alpha == 1.0 and code.algorithm.sdpo.topk == cfg.algorithm.sdpo.topk
    assert code.backend.lr == cfg.backend.lr and stage_config(cfg, 1).backend.lr == 2e-5
    assert stage_config(cfg, 0) is cfg  # a stage without overrides runs the run's config
    assert cfg.teacher.ema_rate == 0.05 and cfg.algorithm.sdpo.context.use_feedback  # run's own unchanged
    # The resolved config keeps the overrides and loads back to the same thing.
    f = tmp_path / "resolved.yaml"
    f.write_text(dump_yaml(cfg))
    again = load_config(str(f))
    assert again == cfg and again.stages[3].teacher == {"ema_rate": 0.01}


def test_stage_overrides_in_yaml(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        "defaults: tiny_sdpo\nstages:\n- {domain: math, steps: 2}\n"
        "- {domain: code, steps: 2, teacher: {ema_rate: 0.01}, algorithm: {sdpo: {topk: 20}}}\n"
    )
    from megatron_sdpo.config.stages import stage_config

    cfg = load_config(str(f))
    assert stage_config(cfg, 1).algorithm.sdpo.topk == 20 and stage_config(cfg, 1).teacher.ema_rate == 0.01
    f.write_text("defaults: tiny_sdpo\nstages:\n- {domain: code, steps: 2, teacher: {ema_rat: 0.01}}\n")
    with pytest.raises(ConfigError, match="stages.0.teacher.ema_rat"):
        load_config(str(f))


@pytest.mark.parametrize("name", ["qwen3_4b", "olmo3_7b"])
def test_paper_presets_carry_the_paper_settings(name):
    from megatron_sdpo.config.stages import stage_config

    cfg = load_config(name)
    a, b = cfg.algorithm, cfg.backend
    assert (a.name, a.prompts_per_step, a.group_size) == ("sdpo", 32, 8)
    assert (a.sdpo.alpha, a.sdpo.topk, a.sdpo.add_tail, a.sdpo.is_clip) == (0.5, 100, True, 2.0)
    assert a.sdpo.context.feedback_domains == ["code"] and a.sdpo.context.feedback_only_without_solution
    assert (a.sdpo.context.max_context_tokens, a.sdpo.context.truncation) == (10240, "right")
    assert (cfg.teacher.mode, cfg.teacher.ema_rate, cfg.teacher.reset_at_stage) == ("ema", 0.05, "stage_start")
    assert (b.lr, b.weight_decay, b.lr_schedule.warmup_steps) == (1e-5, 0.01, 10)
    assert b.megatron.params_dtype == "bfloat16"
    # Stage lengths of the paper's figures; the code stage takes none of the rich-feedback recipe.
    assert [(s.domain, s.steps) for s in cfg.stages] == [("math", 50), ("science", 50), ("tooluse", 50), ("code", 20)]
    assert stage_config(cfg, 3) is cfg
    # Validation sampling of the reference: 4 samples per item at 0.6 / 0.95.
    e = cfg.eval
    assert (e.greedy, e.avg_k, e.temperature, e.top_p) == (False, 4, 0.6, 0.95)
    aime = cfg.domains["math"].eval["id"]
    assert (aime.source, aime.schema, aime.extra_files) == ("data/aime24.jsonl", "aime", ["data/aime25.jsonl"])
    grpo = load_config(name + "_grpo")
    g = grpo.algorithm.grpo
    assert grpo.algorithm.name == "grpo" and (g.mini_batches, g.dual_clip, g.norm_by_std, g.tis_cap, g.kl_coef) == (
        4,
        3.0,
        False,
        2.0,
        0.0,
    )
    assert (grpo.backend.weight_decay, grpo.backend.lr_schedule.warmup_steps) == (0.01, 40)  # 10 rollout steps
    assert grpo.domains == cfg.domains and grpo.backend.megatron == cfg.backend.megatron


def test_a_domain_set_to_null_is_dropped():
    cfg = load_config("smollm2_135m")
    assert list(cfg.domains) == ["math", "tooluse"] and [s.domain for s in cfg.stages] == ["math", "tooluse"]
    assert list(load_config("tiny", ["stages=[{domain: math, steps: 1}]", "domains.code=null"]).domains) == [
        "math",
        "science",
        "tooluse",
    ]
    with pytest.raises(ConfigError, match=r"stages.3.domain: unknown domain 'code'"):
        load_config("tiny", ["domains.code=null"])


def test_data_instruction_is_for_synthetic_sources_only():
    cfg = load_config("tiny", ["domains.math.train.instruction=Box it."])
    assert cfg.domains["math"].train.instruction == "Box it."
    with pytest.raises(ConfigError, match=r"domains.math.eval.id.instruction applies to synthetic sources only"):
        load_config("tiny", ["domains.math.eval.id.source=x.jsonl", "domains.math.eval.id.instruction=Box it."])
    with pytest.raises(ConfigError, match=r"domains.math.train.instruction must be non-empty"):
        load_config("tiny", ["domains.math.train.instruction=' '"])


def test_data_difficulty_is_for_synthetic_sources_in_unit_range():
    from megatron_sdpo.data.sources import load_source

    cfg = load_config("tiny", ["domains.tooluse.train.difficulty=0"])
    src = cfg.domains["tooluse"].train
    assert src.difficulty == 0.0 and cfg.domains["tooluse"].eval["id"].difficulty is None
    # Difficulty 0 of the tool-use generator: every argument is copied from the request, none
    # computed; the default (0.8) computes most of them, so the two draws differ.
    easy = load_source(src, "tooluse", "train", seed=0)
    assert easy != load_source(cfg.domains["tooluse"].eval["id"], "tooluse", "train", seed=0)
    assert all(("adults" not in r["prompt"]) and ("hour" not in r["prompt"]) for r in easy)
    with pytest.raises(ConfigError, match=r"domains.math.eval.id.difficulty applies to synthetic sources only"):
        load_config("tiny", ["domains.math.eval.id.source=x.jsonl", "domains.math.eval.id.difficulty=0.5"])
    with pytest.raises(ConfigError, match=r"domains.math.train.difficulty must be in \[0, 1\]"):
        load_config("tiny", ["domains.math.train.difficulty=1.5"])


def test_domain_shots_become_every_record_history_in_training_and_evaluation(tmp_path):
    from megatron_sdpo.data.sources import load_source
    from megatron_sdpo.evaluation import load_eval_sets

    path = tmp_path / "shots.yaml"
    path.write_text(
        "defaults: tiny\n"
        "domains:\n"
        "  math:\n"
        "    shots:\n"
        "      - {user: 'Tom has 2 pens and gets 3 more. How many pens now?', assistant: '2 + 3 = \\boxed{5}'}\n"
        "      - {user: 'Sue had 7 cards and lost 4. How many remain?', assistant: '7 - 4 = \\boxed{3}'}\n"
    )
    cfg = load_config(str(path))
    shots = cfg.domains["math"].shots
    assert [s.assistant for s in shots] == ["2 + 3 = \\boxed{5}", "7 - 4 = \\boxed{3}"]
    assert cfg.domains["science"].shots == [] and load_config("tiny").domains["math"].shots == []
    turns = [
        {"role": "user", "content": shots[0].user},
        {"role": "assistant", "content": shots[0].assistant},
        {"role": "user", "content": shots[1].user},
        {"role": "assistant", "content": shots[1].assistant},
    ]
    train = load_source(cfg.domains["math"].train, "math", "train", seed=0, shots=shots)
    plain = load_source(cfg.domains["math"].train, "math", "train", seed=0)
    assert all(r["history"] == turns for r in train) and all("history" not in r for r in plain)
    assert [{k: v for k, v in r.items() if k != "history"} for r in train] == plain  # nothing else changes
    evals = load_eval_sets(cfg)
    assert all(r["history"] == turns for r in evals["math/ood_far"])
    assert all("history" not in r for r in evals["science/id"])


def test_domain_shots_need_both_turns(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("defaults: tiny\ndomains:\n  math:\n    shots:\n      - {user: 'q', assistant: ' '}\n")
    with pytest.raises(ConfigError, match=r"domains.math.shots.0.assistant must be non-empty text"):
        load_config(str(path))
    path.write_text("defaults: tiny\ndomains:\n  math:\n    shots:\n      - {user: 'q', answer: 'a'}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'domains.math.shots.0.answer'"):
        load_config(str(path))


@pytest.mark.parametrize(
    "preset",
    sorted(
        p.stem for p in (Path(__file__).resolve().parents[3] / "megatron_sdpo" / "config" / "presets").glob("*.yaml")
    ),
)
def test_every_presets_resolved_config_loads_back_the_same(preset, tmp_path):
    # A run's resolved_config.yaml is what --resume continues with: it must be the run's config,
    # including the domains a preset removed (smollm2_135m: science and code set to null).
    from megatron_sdpo.config import dump_yaml

    cfg = load_config(preset)
    f = tmp_path / "resolved_config.yaml"
    f.write_text(dump_yaml(cfg))
    assert load_config(str(f)) == cfg
