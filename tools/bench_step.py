"""RL step time and peak memory: this project's trainer vs TRL on one workload, side by side.

    python tools/bench_step.py --rounds 3 --out bench_step.csv [--arms ours_grpo_hf,trl_grpo,...]

The workload (issue 13's table): the shipped tiny base, the synthetic math train set (512
prompts), P prompts x G samples per step, 32 new tokens, temperature 1, teacher feedback off,
`--threads` torch threads. Arms:

    ours_grpo_hf, ours_sdpo_hf, ours_grpo_vllm, ours_sdpo_vllm  this project (ContinualRun, one
        math stage, diagnostics and checkpoints off), HF generate or colocated vLLM rollout
    ours_grpo_vllmeager, ours_sdpo_vllmeager  vLLM with rollout.enforce_eager=true (the vLLM
        arms above run the default, a compiled decoder)
    trl_grpo, trl_sdpo  TRL's GRPOTrainer / trl.experimental.sdpo.SDPOTrainer (HF generate)

SDPO everywhere: EMA teacher (rate 0.05), alpha 0.5, full-vocabulary logit distillation.
Each arm runs in its own subprocess (fresh interpreter, fresh allocator; bench_harness.run_child),
arms interleaved within each round in an order rotated every round (bench_harness.Bench.run) so
load drifts on a shared machine hit every arm alike. A step's time is the wall time between two
consecutive end-of-step callbacks (everything the loop does per step, including the EMA teacher
update); steps after `--warmup` are timed and their median is the round's s_per_step. Peak RSS
is the largest resident set of any process of the arm (`wait4`'s ru_maxrss); `peak_tree_rss_mb`
is the sampled peak of the arm's whole process tree (bench_harness.TreeRSS, every 0.2 s). Phase
times are the medians of whatever timing keys the trainers log (ours: `*_time` and `time/*` in
metrics.jsonl; TRL: `profiling/*`). The CSV is bench_harness's schema (one row per arm, round
and metric; params: the workload; also wall_s, steps_timed, load_avg: the machine's 1-minute
load when the arm started); its .summary.csv has the medians over rounds and each of our arms'
ratio to the TRL arm of its algorithm, paired by round.

TRL arms need `pip install trl` (not a dependency of this project); without it they are
reported as skipped with that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_harness import Bench, NoResult, TreeRSS, median, print_summary, run_child, write_result

OURS = ("ours_grpo_hf", "ours_sdpo_hf", "ours_grpo_vllm", "ours_sdpo_vllm")
EAGER = ("ours_grpo_vllmeager", "ours_sdpo_vllmeager")  # on request only (not in the default list)
TRL = ("trl_grpo", "trl_sdpo")
DEFAULT_ARMS = OURS + TRL
ARMS = OURS + EAGER + TRL
LR, CLIP_LOW, CLIP_HIGH, EMA_RATE, ALPHA = 1e-4, 0.2, 0.28, 0.05, 0.5
UNITS = {
    "s_per_step": "s",
    "ms_per_token": "ms",
    "rows_skipped_frac": "ratio",
    "steps_timed": "steps",
    "peak_rss_mb": "MiB",
    "peak_tree_rss_mb": "MiB",
    "wall_s": "s",
}
WORKLOAD = ("steps", "warmup", "prompts", "samples", "new_tokens", "threads", "dataset", "micro_batch")


def arm_parts(arm: str) -> tuple[str, str, str]:
    """(framework, algorithm, rollout engine) of an arm name."""
    parts = arm.split("_")
    return parts[0], parts[1], parts[2] if len(parts) > 2 else "hf"


def trl_missing() -> str | None:
    """Why the TRL arms cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return "TRL is not installed (pip install trl, or pip install -e .[bench])"
    return None


# -- workers (one arm, in its own process) ------------------------------------------------------
def step_times(stamps: list[float]) -> list[float]:
    """Per-step seconds from [start, end of step 1, end of step 2, ...]."""
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def phase_medians(records: list[dict], keep) -> dict[str, float]:
    """Median over `records` of every numeric key `keep(key)` accepts."""
    keys = sorted({k for r in records for k, v in r.items() if keep(k) and isinstance(v, (int, float))})
    return {k: median(r[k] for r in records if isinstance(r.get(k), (int, float))) for k in keys}


def ours_config(args, algorithm: str, engine: str):
    """The tiny preset narrowed to the workload: one math stage, no eval beyond a token set."""
    from megatron_sdpo.config.construction import build, to_dict
    from megatron_sdpo.config.presets import deep_merge, load_raw
    from megatron_sdpo.config.schema import RunConfig
    from megatron_sdpo.config.validation import validate

    data = deep_merge(to_dict(RunConfig()), load_raw("tiny"))
    math = data["domains"]["math"]
    math["train"]["n"] = args.dataset
    # The base eval and the stage's eval row run outside the timed steps; keep them small.
    math["eval"] = {"id": {**math["eval"]["id"], "n": 4}}
    data["domains"] = {"math": math}
    data["stages"] = [{"domain": "math", "steps": args.steps, "algorithm": {}, "teacher": {}, "backend": {}}]
    a = data["algorithm"]
    a.update(name=algorithm, prompts_per_step=args.prompts, group_size=args.samples)
    a["grpo"].update(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=0.0)
    a["sdpo"].update(alpha=ALPHA, topk=None)
    a["sdpo"]["context"]["use_feedback"] = False
    data["teacher"].update(mode="ema", ema_rate=EMA_RATE)
    eager = engine == "vllmeager"
    data["rollout"].update(engine="vllm" if eager else engine, enforce_eager=eager, max_new_tokens=args.new_tokens)
    data["backend"].update(lr=LR)
    data["diagnostics"]["enabled"] = False
    data["checkpoint"]["save_every"] = 0
    data["logging"].update(plots=False, quiet=True, wandb=False)
    data["eval"]["max_new_tokens"] = args.new_tokens
    return validate(build(RunConfig, data))


def run_ours(args, arm: str, work: Path) -> dict:
    from megatron_sdpo.continual import ContinualRun

    _, algorithm, engine = arm_parts(arm)
    run = ContinualRun(ours_config(args, algorithm, engine), work / "run", quiet=True)
    stamps: list[float] = []
    monitor = run.monitor
    stage_start, step = monitor.stage_start, monitor.step

    def on_stage_start(*a, **k):
        stamps.append(time.perf_counter())
        return stage_start(*a, **k)

    def on_step(record):
        stamps.append(time.perf_counter())
        return step(record)

    # The loop's only per-step callback; wrapping it times whole steps without touching the loop.
    monitor.stage_start, monitor.step = on_stage_start, on_step
    run.run()
    records = [json.loads(line) for line in run.run_dir.metrics.read_text().splitlines() if line.strip()]
    timed = records[args.warmup :]
    phases = phase_medians(timed, lambda k: k.startswith("time/") or (k.endswith("_time") and k != "step_time"))
    # The rollout phase's time depends on the longest answer of the step, so its distribution
    # is skewed: the mean (the phase's share of the run's wall time) next to the median.
    rollouts = [r["time/rollout"] for r in timed if isinstance(r.get("time/rollout"), (int, float))]
    if rollouts:
        phases["time/rollout_mean"] = sum(rollouts) / len(rollouts)
    # Completion tokens per step (the samples' mean length x samples) and rows left out of the
    # train step (algorithms/signal_rows.py), step by step.
    tokens = [r["response_len"] * args.prompts * args.samples for r in records]
    skipped = [r.get("train/rows_skipped", 0.0) / r["samples"] for r in records if r.get("samples")]
    return {"times": step_times(stamps), "phases": phases, "tokens": tokens, "rows_skipped": skipped}


def trl_dataset(args):
    from datasets import Dataset

    from megatron_sdpo.data.synthetic import generate

    rows = generate("math", "train", args.dataset, 0)
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "record": json.dumps(r)} for r in rows]
    )


def math_reward(prompts, completions, record, **_):
    """This project's math verifier as a TRL reward function (same scores as our arms)."""
    from megatron_sdpo.rewards import score_batch

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [r.score for r in score_batch("math", texts, [json.loads(x) for x in record])]


def run_trl(args, arm: str, work: Path) -> dict:
    from transformers import TrainerCallback

    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.models.tiny import ensure_tiny_base

    _, algorithm, _ = arm_parts(arm)
    model = str(ensure_tiny_base())
    batch = args.prompts * args.samples
    micro = min(args.micro_batch, batch)
    common = dict(
        output_dir=str(work / "trl"),
        use_cpu=True,
        bf16=False,
        seed=0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=args.steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        warmup_steps=0,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_generations=args.samples,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        scale_rewards="none",
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if algorithm == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    else:
        from trl.experimental.sdpo import SDPOConfig as Config
        from trl.experimental.sdpo import SDPOTrainer as Trainer

        common.update(
            distillation_mode="full_logits",
            distillation_alpha=ALPHA,
            distillation_weight=1.0,
            teacher_model_kind="ema",
            teacher_update_rate=EMA_RATE,
            teacher_sync_steps=1,
            include_environment_feedback=False,
        )
    stamps: list[float] = []
    per_step: list[dict] = []
    tokens: list[float] = []
    current: dict[str, float] = {}
    from trl.extras import profiling

    def capture(self, duration: float) -> None:
        # TRL times its phases (generation, reward, loss) but reports them only to wandb /
        # mlflow / trackio; summed per step here instead.
        key = f"profiling/{self.name}"
        current[key] = current.get(key, 0.0) + duration

    profiling.ProfilingContext._log_metrics = capture

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            stamps.append(time.perf_counter())
            current.clear()

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())
            per_step.append(dict(current))
            current.clear()

        def on_log(self, args_, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * batch)

    trainer = Trainer(
        model=model,
        reward_funcs=math_reward,
        args=Config(**common),
        train_dataset=trl_dataset(args),
        processing_class=load_tokenizer(model),
        callbacks=[Clock()],
    )
    trainer.train()
    phases = phase_medians(per_step[args.warmup :], lambda k: k.startswith("profiling/"))
    return {"times": step_times(stamps), "phases": phases, "tokens": tokens}


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    tree = TreeRSS()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"bench_step_{args.worker}_") as work:
        out = (run_trl if args.worker.startswith("trl_") else run_ours)(args, args.worker, Path(work))
    out["wall_s"] = time.perf_counter() - t0
    out["peak_tree_rss_mb"] = tree.stop() / 2**20
    write_result(args.result, out)


# -- driver -------------------------------------------------------------------------------------
def run_arm(args, arm: str) -> dict:
    """One arm in a subprocess: its metrics; NoResult when it is skipped or fails."""
    load = os.getloadavg()[0]  # the machine's 1-minute load when the arm started
    if arm.startswith("trl_") and (why := trl_missing()):
        raise NoResult("skipped", why)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", arm]
    for name in WORKLOAD:
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    out, peak_rss = run_child(cmd, env=env)
    timed = out["times"][args.warmup :]
    extra = {}
    tokens = out.get("tokens", [])[args.warmup :]
    if len(tokens) == len(timed) and sum(tokens) > 0:
        # Whole timed steps over the completion tokens they generated: a step that samples
        # shorter answers is cheaper for that reason alone.
        extra["ms_per_token"] = 1000 * sum(timed) / sum(tokens)
    skipped = out.get("rows_skipped", [])[args.warmup :]
    if skipped:
        extra["rows_skipped_frac"] = sum(skipped) / len(skipped)
    return {
        "s_per_step": median(timed),
        "steps_timed": len(timed),
        "peak_rss_mb": peak_rss / 2**20,
        "peak_tree_rss_mb": out["peak_tree_rss_mb"],
        "wall_s": out["wall_s"],
        "load_avg": load,
        **extra,
        **out["phases"],
    }


def trl_peer(arm: str) -> str:
    """The arm an arm's ratios are taken against: the TRL arm of its algorithm."""
    return f"trl_{arm_parts(arm)[1]}"


def measure(args) -> Bench:
    """Every arm of args.arm_list for args.rounds rounds, written to args.out as it goes."""
    bench = Bench("step", units=UNITS, out=args.out, baseline=trl_peer)

    def arm(name: str):
        def run() -> dict:
            metrics = run_arm(args, name)
            # The phase keys are whatever the trainers log; all are seconds.
            bench.units.update({k: "s" for k in metrics if k not in UNITS and k != "load_avg"})
            return metrics

        return run

    bench.run(
        {name: arm(name) for name in args.arm_list},
        rounds=args.rounds,
        params={name: getattr(args, name) for name in WORKLOAD},
    )
    return bench


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="steps per arm and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dataset", type=int, default=512, help="math train prompts")
    ap.add_argument("--micro-batch", type=int, default=64, help="sequences per forward/backward (both frameworks)")
    ap.add_argument("--out", default="bench_step.csv")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        ap.error(f"--arms: unknown arm(s) {', '.join(bad) or '(none)'}; choose from {', '.join(ARMS)}")
    for name in ("rounds", "steps", "prompts", "samples", "new_tokens", "threads", "dataset", "micro_batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup must be in [0, --steps) (got {args.warmup} with --steps {args.steps})")
    if args.samples < 2:
        ap.error("--samples must be >= 2 (group-relative advantages need a group)")
    batch = args.prompts * args.samples
    if batch % min(args.micro_batch, batch) or min(args.micro_batch, batch) % args.samples:
        ap.error("--micro-batch must divide --prompts x --samples and be a multiple of --samples (TRL's rule)")
    args.arm_list = arms
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    arms = args.arm_list
    if any(a.startswith("trl_") for a in arms) and (why := trl_missing()):
        print(f"TRL arms skipped: {why}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"bench_step: {len(arms)} arms x {args.rounds} rounds, {args.prompts} prompts x {args.samples} samples, "
        f"{args.new_tokens} new tokens, {args.threads} threads, steps {args.warmup + 1}-{args.steps} timed; "
        f"load average {load:.1f} on {os.cpu_count()} CPUs"
    )
    bench = measure(args)
    print_summary(
        bench.write(),
        metrics=("s_per_step", "ms_per_token", "rows_skipped_frac", "peak_rss_mb", "peak_tree_rss_mb", "load_avg"),
    )
    print(f"wrote {args.out}")
    if not any(r["metric"] == "s_per_step" for r in bench.rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
