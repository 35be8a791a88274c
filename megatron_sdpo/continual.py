"""The continual post-training loop: stages of RL, an eval row after each, diagnostics, report.

Read top to bottom, this file is the experiment; the maths lives in algorithms/, the engines in
backends/ and rollout/, the measurements in diagnostics/.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from pathlib import Path

import torch

from megatron_sdpo import IMPORTED_AT, builders, ranks
from megatron_sdpo.algorithms.teacher import TeacherController
from megatron_sdpo.chat import set_template_kwargs
from megatron_sdpo.config import dump_yaml, load_config
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.data.sources import load_source
from megatron_sdpo.evaluation import evaluate_config, load_eval_sets
from megatron_sdpo.interfaces.blend import TeacherBlend
from megatron_sdpo.outputs.drift_jobs import DriftJobs
from megatron_sdpo.outputs.monitor import RunMonitor
from megatron_sdpo.outputs.run_dir import RunDir
from megatron_sdpo.stop_request import StepAbandoned, StopRequest, StopRequested, StopWindow
from megatron_sdpo.stopwatch import RunClock
from megatron_sdpo.trainer import Trainer


def step_seed(seed: int, stage: int, step: int) -> int:
    """Seed of one step's sampling: a pure function of the position, so a resumed run repeats it."""
    return (seed * 1_000_003 + stage * 10_007 + step) % (2**31 - 1)


def train_batch(records: list[dict], *, seed: int, stage: int, step: int, size: int, round_: int = 0) -> list[dict]:
    """Records for (stage, step): epochs over a seeded permutation; the data position is the step.
    Extra generation round `round_` >= 1 (dynamic sampling) draws from its own seeded permutation
    of (stage, step, round), so a resumed run draws the same prompts."""
    n = len(records)
    if round_:
        perm = list(range(n))
        random.Random(step_seed(seed, stage, 2_000_000 + 1_000 * step + round_)).shuffle(perm)
        return [records[perm[k % n]] for k in range(size)]
    out = []
    for k in range(step * size, (step + 1) * size):
        epoch, idx = divmod(k, n)
        perm = list(range(n))
        random.Random(step_seed(seed, stage, 1_000_000 + epoch)).shuffle(perm)
        out.append(records[perm[idx]])
    return out


_clock_started = False


def _run_clock_start() -> float:
    """Where a run's clock starts: the package's import for the process's first run (its
    imports are part of what the run costs), the run's construction for any later one."""
    global _clock_started
    first, _clock_started = not _clock_started, True
    return IMPORTED_AT if first else time.perf_counter()


def check_data_files(cfg: RunConfig) -> None:
    """Fail before anything is written when a configured data file does not exist."""
    from megatron_sdpo.errors import DataError

    for domain, dcfg in cfg.domains.items():
        for where, src in [("train", dcfg.train), *((f"eval.{k}", v) for k, v in dcfg.eval.items())]:
            for path in src.files():
                if not Path(path).is_file():
                    key = "source" if path == src.source else "extra_files"
                    raise DataError(f"domains.{domain}.{where}.{key}: data file not found: {path}")


class ContinualRun:
    """One run of `cfg` into `out_dir` (fresh, or resumed from its last complete checkpoint)."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path, *, resume: bool = False, quiet: bool = False):
        self.clock = RunClock(started=_run_clock_start())
        self.clock.add("start/imports_and_config", time.perf_counter() - self.clock.started)
        with self.clock.phase("start/run_dir"):
            self._init(cfg, out_dir, resume=resume, quiet=quiet)

    def _init(self, cfg: RunConfig, out_dir: str | Path, *, resume: bool, quiet: bool) -> None:
        check_data_files(cfg)
        # A missing or corrupt model fails before anything is written; _setup loads this path.
        self.model_path = builders.resolve_model_path(cfg)
        ranks.init_if_launched(cfg.launch.distributed_timeout_minutes)
        self.main = ranks.is_main()
        self.run_dir = RunDir(out_dir)
        self.training_stage = 0  # the stage whose steps run now (refill reads it)
        if self.main:
            self.run_dir.prepare(resume=resume)
            if not resume:
                self.run_dir.config.write_text(dump_yaml(cfg))
        ranks.barrier()
        if resume:  # the run continues with the configuration it started with
            saved = load_config(str(self.run_dir.config))
            if saved.model.path != cfg.model.path:
                self.model_path = builders.resolve_model_path(saved)
            cfg = saved
        self.cfg = cfg
        self.resume = resume
        self.monitor = RunMonitor(self.run_dir, cfg, quiet=quiet, write=self.main)
        self.drift_jobs = DriftJobs(self.run_dir, threads=cfg.diagnostics.threads or None, log=self.monitor.log)
        self.last_saved: tuple[str, int, int] | None = None  # (name, stage, steps done) of the last save

    # -- set-up -----------------------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        with self.clock.phase("start/data"):
            self.tokenizer = set_template_kwargs(
                builders.load_tokenizer(self.model_path), cfg.model.chat_template_kwargs
            )
            self.train_sets = {
                s.domain: load_source(
                    cfg.domains[s.domain].train, s.domain, "train", seed=cfg.seed, shots=cfg.domains[s.domain].shots
                )
                for s in cfg.stages
            }
            self.eval_sets = load_eval_sets(cfg)
        with self.clock.phase("start/backend"):
            self.backend = builders.make_backend(cfg, self.model_path, self.tokenizer)
            if cfg.backend.offload_training_state:
                # The grad buffer and main params off the device before the engine takes its share:
                # the base eval and the first rollout run as every later one (memory_ledger.py, "start").
                self.backend.offload_training_state()
        self.clock.device = self.backend.device
        with self.clock.phase("start/engine"):
            self.engine = builders.make_rollout(
                cfg, self.model_path, self.tokenizer, str(self.run_dir.root / ".rollout")
            )
        self.trainer = Trainer(cfg, self.backend, self.engine, self.tokenizer)
        self.teacher = TeacherController(
            mode=cfg.teacher.mode,
            ema_rate=cfg.teacher.ema_rate,
            freeze_fraction=cfg.teacher.freeze_fraction,
            stage_steps=max(cfg.stages[0].steps, 1),
            reset_at_stage=cfg.teacher.reset_at_stage,
            init_teacher=cfg.teacher.init_path is not None,
        )
        self.stage_cfg = cfg

    def _stage_settings(self, k: int) -> None:
        """Run stage k with its configuration: the run's, with the stage's overrides
        (config/stages.py) for the loss, the teacher schedule and the optimizer."""
        from megatron_sdpo.config.stages import stage_config

        eff = stage_config(self.cfg, k)
        self.stage_cfg = eff
        self.trainer.configure(eff)
        t, b = eff.teacher, eff.backend
        self.teacher.configure(ema_rate=t.ema_rate, freeze_fraction=t.freeze_fraction, reset_at_stage=t.reset_at_stage)
        self.backend.configure_optimizer(
            lr=b.lr, weight_decay=b.weight_decay, grad_clip=b.grad_clip, lr_schedule=builders.lr_schedule(eff)
        )

    def _evaluate(self, label: str, checkpoint: str | None) -> dict[str, float]:
        """One eval-matrix row; a stop signal is honoured between its sets (`checkpoint` is what
        a resumed run starts from, None before the first save: it redoes this row)."""
        return self._keep_row(label, *self._eval_row(checkpoint))

    def _eval_row(self, checkpoint: str | None) -> tuple[dict[str, float], dict[str, list[dict]]]:
        with self.clock.phase("eval/row_other"):  # what the splits' own phases do not cover
            self.engine.wake()
            return evaluate_config(
                self.engine,
                self.tokenizer,
                self.eval_sets,
                self.cfg,
                seed=step_seed(self.cfg.seed, 99, 0),
                between=lambda: self._stop_if_asked(checkpoint),
                clock=self.clock,
            )

    def _keep_row(self, label: str, accs: dict[str, float], samples: dict[str, list[dict]]) -> dict[str, float]:
        if self.main:
            (self.run_dir.eval_samples / f"{label}.json").write_text(json.dumps(samples, indent=1))
        ranks.barrier()  # the stage diagnostics of every rank read these samples back
        return accs

    def _base_row(self) -> dict[str, float]:
        """The base model's row: from `eval.base_row_cache` where a run with the same model,
        items and settings left it (the main rank decides for all), else evaluated (and left
        there)."""
        from megatron_sdpo.outputs.base_rows import BaseRows, row_key

        if not self.cfg.eval.base_row_cache:
            return self._evaluate("base", None)
        cache, key = BaseRows(self.cfg.eval.base_row_cache), row_key(self.cfg, self.model_path, self.eval_sets)
        row = ranks.from_main(cache.load(key) if self.main else None)
        if row is None:
            row = self._eval_row(None)
            if self.main:
                cache.store(key, *row)
        elif self.main:
            self.monitor.log(f"base eval row from {self.cfg.eval.base_row_cache} (key {key})")
        return self._keep_row("base", *row)

    def _mid_stage_eval(self, domain: str) -> dict[str, float]:
        """eval.at_steps: the stage domain's in-domain accuracy now (every rank, as `_evaluate`;
        the engine holds this step's weights)."""
        column = f"{domain}/id"
        if column not in self.eval_sets:
            return {}
        with self.clock.phase("eval/mid_stage"):
            accs, _ = evaluate_config(
                self.engine,
                self.tokenizer,
                {column: self.eval_sets[column]},
                self.cfg,
                seed=step_seed(self.cfg.seed, 99, 0),
            )
        return {f"eval/{column}": accs[column]}

    # -- checkpoints --------------------------------------------------------------------------
    def _save(self, name: str, stage: int, step: int) -> Path:
        path = self.run_dir.checkpoints / name
        extra = {"stage": stage, "step": step, "teacher": self.teacher.state_dict(), "name": name}
        start = time.perf_counter()
        with self.clock.phase("save/step" if name.startswith("step_") else "save/stage"):
            with self.trainer.training_state_on_device():
                self.backend.save(str(path), extra=extra)
            if self.main:
                (self.run_dir.checkpoints / "latest").write_text(name)
                self._prune()
            ranks.barrier()
        self.window.observe_save(time.perf_counter() - start)
        self.last_saved = (name, stage, step)
        return path

    def _prune(self) -> None:
        """Keep the last `keep_last` step checkpoints; stage-final ones are kept for diagnostics."""
        steps = sorted(
            (p for p in self.run_dir.checkpoints.glob("step_*") if p.is_dir()), key=lambda p: p.stat().st_mtime
        )
        for old in steps[: max(len(steps) - self.cfg.checkpoint.keep_last, 0)]:
            shutil.rmtree(old, ignore_errors=True)

    def _restore(self) -> tuple[int, int]:
        """Load the latest checkpoint; returns (stage index, steps done in that stage)."""
        latest = self.run_dir.checkpoints / "latest"
        if not latest.exists():
            return 0, 0
        # With offload the engine sleeps through the load and the state goes off again before
        # the refit (memory_ledger.py, "resume"); without, the refit follows the load.
        with self.trainer.training_state_on_device():
            extra = self.backend.load(str(self.run_dir.checkpoints / latest.read_text().strip()))
        self._stage_settings(int(extra["stage"]))
        self.teacher.load_state_dict(extra["teacher"])
        stage, step = int(extra["stage"]), int(extra["step"])
        self.last_saved = (str(extra["name"]), stage, step)
        if self.main:
            self.run_dir.truncate_metrics(lambda r: (r["stage"], r["step"]) <= (stage, step))
        if not self.cfg.backend.offload_training_state:
            self.engine.update_weights(self.backend.export_weights(model="policy"))
        self.monitor.log(f"resumed from {extra['name']} (stage {stage}, step {step})")
        return stage, step

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> RunDir:
        """The whole run; StopRequested after saving when the scheduler asked it to stop
        (stop_request.py)."""
        self.stop = StopRequest()
        self.window = StopWindow.from_env()
        try:
            return self._run()
        finally:
            self.stop.uninstall()

    def _run(self) -> RunDir:
        t_start = time.perf_counter()
        self._setup()
        # After the engines start (a library may install handlers of its own); a signal before
        # this point finds nothing to save yet and ends the process as usual.
        self.stop.install()
        cfg = self.cfg
        if self.resume:
            with self.clock.phase("start/resume"):
                start_stage, start_step = self._restore()
        else:
            # The engine loaded the checkpoint's own tensors; the trainer holds them in its
            # params dtype (bf16 params from an fp32 checkpoint round them): the base eval and
            # the first rollout sample from the weights the trainer will update.
            with self.clock.phase("start/refit"):
                self.engine.update_weights(self.backend.export_weights(model="policy"))
            start_stage, start_step = 0, 0
        rows = self.run_dir.read_eval_matrix() if self.resume else []
        if self.resume and self.main:
            self.drift_jobs.resume_pending()
        rows = rows[: start_stage + 1]
        if not rows:
            rows.append(("base", self._base_row()))
            self._write_matrix(rows)
        self._base_checkpoint()
        for k in range(start_stage, len(cfg.stages)):
            stage = cfg.stages[k]
            first = start_step if k == start_stage else 0
            with self.clock.phase("stage/start"):
                self._stage_settings(k)
                if first == 0:
                    self._stage_start(k)
            if first < stage.steps:
                self._train_stage(k, first)
            if first < stage.steps or stage.steps == 0:
                # A stage of 0 steps keeps the model it starts from: its checkpoint still marks the
                # stage done, and the stage diagnostics read its policy.
                self._save(self._stage_label(k), k, stage.steps)
            # The stage's checkpoint holds everything up to here; a resumed run redoes the rest.
            self._stop_if_asked(self._stage_label(k))
            if len(rows) <= k + 1:
                rows.append((stage.domain, self._evaluate(self._stage_label(k), self._stage_label(k))))
                self._write_matrix(rows)
            with self.clock.phase("diagnostics/stage_probes"):
                self._stage_diagnostics(k)
            self._stop_if_asked(self._stage_label(k))
        self._finish(time.perf_counter() - t_start)
        return self.run_dir

    def _write_matrix(self, rows: list) -> None:
        if self.main:
            self.run_dir.write_eval_matrix(rows)

    def _stage_start(self, k: int) -> None:
        stage, cfg = self.cfg.stages[k], self.stage_cfg
        with self.trainer.training_state_on_device():
            if k > 0 and cfg.backend.stage_start == "weights_only":
                self.backend.reset_optimizer()
            # The schedule counts optimizer steps: mini_batches per rollout step.
            self.backend.set_lr_schedule(stage.steps * cfg.algorithm.grpo.mini_batches)
            self._teacher_update(self.teacher.on_stage_start(max(stage.steps, 1)))

    def _stop_if_asked(self, checkpoint: str | None) -> None:
        """Stop when a rank received a stop signal (`checkpoint` holds the run so far); one
        small collective."""
        signum = self.stop.agreed()
        if signum:
            self._stopped(signum, checkpoint)

    def _stopped(self, signum: int, checkpoint: str | None) -> None:
        self.drift_jobs.stop()
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint yet"
        self.monitor.log(f"stop requested ({signal.Signals(signum).name}): {where}; resume with --resume")
        self.monitor.close()
        raise StopRequested(signum, checkpoint)

    # The step's hooks (trainer.StepHooks): after_train, refill, between_phases.

    def between_phases(self, left: tuple[str, ...]) -> None:
        """Inside a step: abandon it when the ranks agree to stop and it cannot finish within the
        job's lead (stop_request.StopWindow); one small collective, only under such a job."""
        if not self.window.active:
            return
        vote = bool(self.stop.received) and self.window.abandon(self.stop.since_signal_s(), left)
        signum, abandon = self.stop.agreed_with(vote)
        if signum and abandon:
            raise StepAbandoned(signum)

    def _abandoned(self, signum: int, k: int, step: int) -> None:
        """Stop at the last completed step: its state is the one in memory (the abandoned step
        changed nothing yet); at a stage's first step that is the checkpoint already written."""
        if step == 0:
            name = self.last_saved[0] if self.last_saved else None
        elif self.last_saved is not None and self.last_saved[1:] == (k, step):
            name = self.last_saved[0]
        else:
            name = f"step_{k}_{step:06d}"
            self._save(name, k, step)
        self.monitor.log(f"stop: stage {k + 1} step {step + 1} abandoned, it could not finish within the lead")
        self._stopped(signum, name)

    def _teacher_update(self, blend: TeacherBlend) -> None:
        if self.trainer.uses_teacher and not blend.is_identity:
            self.backend.blend_teacher(blend)

    def after_train(self, step: int) -> None:
        """After the optimizer step of (0-based) step `step`: the teacher's per-step update."""
        self._teacher_update(self.teacher.after_step(step + 1))

    def refill(self, step: int, round_: int) -> list[dict]:
        """The prompts of extra generation round `round_` of `step` of the stage in training
        (dynamic sampling)."""
        k = self.training_stage
        records = self.train_sets[self.cfg.stages[k].domain]
        size = self.stage_cfg.algorithm.prompts_per_step
        return train_batch(records, seed=self.stage_cfg.seed, stage=k, step=step, size=size, round_=round_)

    def _train_stage(self, k: int, first: int) -> None:
        cfg, stage = self.stage_cfg, self.cfg.stages[k]
        self.training_stage = k
        records = self.train_sets[stage.domain]
        self.monitor.stage_start(f"stage {k + 1}/{len(cfg.stages)} {stage.domain}", stage.steps, first)
        from megatron_sdpo.diagnostics.artifacts import CollapseConfig, CollapseMonitor, artifact_stats

        collapse = CollapseMonitor(
            CollapseConfig(
                max_format_repeat_rate=cfg.diagnostics.collapse_repeat_threshold,
                min_length_ratio=cfg.diagnostics.collapse_min_length_ratio,
                min_reward_ratio=cfg.diagnostics.collapse_min_reward_ratio,
                stop=cfg.diagnostics.stop_on_collapse,
            ),
            # Written by the main rank only; every stage's alarms stay in the one file.
            marker_path=self.run_dir.root / "collapse_alarms.json" if self.main else None,
            label=self._stage_label(k),
        )
        for step in range(first, stage.steps):
            batch = train_batch(records, seed=cfg.seed, stage=k, step=step, size=cfg.algorithm.prompts_per_step)
            try:
                with self.clock.phase("steps"):
                    out = self.trainer.step(
                        stage.domain,
                        batch,
                        seed=step_seed(cfg.seed, k, step),
                        step=step,
                        label=f"stage {k + 1} step {step + 1}",
                        hooks=self,
                    )
            except StepAbandoned as exc:
                self._abandoned(exc.signum, k, step)
            late = self.window.observe_step(out.metrics)
            if late:
                self.monitor.log(late)
            stats = artifact_stats(
                out.responses,
                truncated=out.truncated,
                token_lengths=out.token_lengths,
                teacher_mask=out.has_context if self.trainer.uses_teacher else None,
            )
            alarm = collapse.update(stats, step=step + 1, reward=out.metrics.get("reward_mean"))
            record = {
                "stage": k,
                "stage_domain": stage.domain,
                "step": step + 1,
                "algorithm": cfg.algorithm.name,
                **out.metrics,
                **{f"artifacts/{key}": v for key, v in stats.items()},
                "collapse_alarm": bool(alarm),
            }
            if step + 1 in cfg.eval.at_steps and step + 1 < stage.steps:
                record.update(self._mid_stage_eval(stage.domain))
            self.monitor.step(record)
            every = cfg.checkpoint.save_every
            saved = bool(every) and (step + 1) % every == 0 and step + 1 < stage.steps
            if saved:
                self._save(f"step_{k}_{step + 1:06d}", k, step + 1)
            every = cfg.diagnostics.drift_every
            if cfg.diagnostics.enabled and every and ((step + 1) % every == 0 or step + 1 == stage.steps):
                with self.clock.phase("diagnostics/step_drift"):
                    self._step_drift(k, step + 1)
            signum = self.stop.agreed() if step + 1 < stage.steps else 0
            if signum:
                # Honoured at the step's end on every rank at once: this step is the checkpoint.
                name = f"step_{k}_{step + 1:06d}"
                if not saved:
                    self._save(name, k, step + 1)
                self._stopped(signum, name)
            if alarm and collapse.should_stop:
                self.monitor.log(
                    f"collapse alarm at stage {k + 1} step {step + 1}: {'; '.join(alarm.reasons)}; stopping the stage"
                )
                break
        self.monitor.stage_end()

    def _base_checkpoint(self) -> None:
        """The stage-0 reference for drift: the base model's HF directory."""
        self.base_dir = self.model_path

    def _stage_label(self, k: int) -> str:
        return f"stage_{k + 1}_{self.cfg.stages[k].domain}"

    def _stage_policies(self, k: int):
        """The HF policy directories diagnostics compare around stage k (the base model's own
        directory before the first stage)."""
        from megatron_sdpo.diagnostics.stage import StagePolicies

        def policy(j: int) -> Path:
            return Path(self.base_dir) if j < 0 else self.run_dir.checkpoints / self._stage_label(j) / "policy"

        return StagePolicies(
            base=Path(self.base_dir), prev=policy(k - 1), cur=policy(k), before_prev=policy(k - 2) if k >= 1 else None
        )

    def _step_drift(self, k: int, step: int) -> None:
        """diagnostics.drift_every: the policy's relative parameter change against the stage's
        start and the base (norms only, no SVD), one line of drift/steps.jsonl. The export is a
        collective: every rank reads all of it; the main rank measures."""
        stream = iter(self.backend.export_weights(model="policy"))
        if not self.main:
            for _ in stream:
                pass
            return
        from megatron_sdpo.diagnostics.param_drift import norm_drift
        from megatron_sdpo.outputs import report

        p = self._stage_policies(k)
        same = p.prev is p.base or (isinstance(p.prev, Path) and p.prev == p.base)  # the first stage
        refs = {"base": p.base} if same else {"stage_start": p.prev, "base": p.base}
        try:
            drift = norm_drift(refs, stream)
        except Exception as exc:  # a diagnostic: log it and train on
            for _ in stream:  # the other ranks are still in the export's collectives
                pass
            self.monitor.log(f"parameter drift at stage {k + 1} step {step} not measured: {' '.join(str(exc).split())}")
            return
        report.write_step_drift(
            self.run_dir,
            {
                "stage": k + 1,
                "domain": self.cfg.stages[k].domain,
                "step": step,
                "vs_stage_start": drift.get("stage_start", drift["base"]),
                "vs_base": drift["base"],
            },
        )

    def _stage_diagnostics(self, k: int) -> None:
        """Drift of stage k's policy against the previous stage and the base, written to
        drift/stage_<k+1>.json by a detached job (drift_jobs.py). Every rank scores the probes
        (a collective forward); the main rank hands them with the stage's inputs to the job and
        goes on: the SVDs over two checkpoints and the embedder run off the critical path."""
        cfg = self.cfg
        if not cfg.diagnostics.enabled:
            return
        from megatron_sdpo.diagnostics.stage import ProbeLogprobs, probe_batches
        from megatron_sdpo.outputs import report

        d = cfg.diagnostics
        label = self._stage_label(k)
        cur = report.read_eval_samples(self.run_dir, label)
        # The policy's own eval answers, scored by the policy and by the frozen base.
        probes = {}
        for key, b in probe_batches(self.tokenizer, cur, self.eval_sets, d.probe_n).items():
            policy, base = (self.backend.logprobs(b, model=m) for m in ("policy", "reference"))
            ids = [list(r) for r in b.response_ids]
            pieces = [[self.tokenizer.decode([t]) for t in r] for r in ids]  # token-level artifacts
            probes[key] = ProbeLogprobs(policy, base, b.response_mask(), ids, pieces)
        if self.main:
            inputs = {
                "stage": k,
                "domain": cfg.stages[k].domain,
                "algorithm": cfg.algorithm.name,
                "policies": self._stage_policies(k),
                "base_label": "base",
                "cur_label": label,
                "probes": probes,
                "svd_rank": d.svd_rank,
                "seed": cfg.seed,
                "probe_n": d.probe_n,
                "response_drift": d.response_drift,
                "principal_overlap": d.principal_overlap,
            }
            if k == 0 and d.ood_distance_n and d.response_drift:
                # Once per run: the prompts of every stage's training set and every eval set.
                inputs["ood_prompts"] = {
                    "train": {dom: [r["prompt"] for r in recs] for dom, recs in self.train_sets.items()},
                    "eval": {key: [r["prompt"] for r in recs] for key, recs in self.eval_sets.items()},
                    "n": d.ood_distance_n,
                }
            self.drift_jobs.submit(k + 1, inputs)

    def _finish(self, seconds: float) -> None:
        from megatron_sdpo.outputs.report import write_report

        if self.main:
            # Only the main rank waits here, so the stop is its own flag, not an agreed one.
            with self.clock.phase("diagnostics/drift_jobs_wait"):
                self.drift_jobs.wait(interrupt=lambda: bool(self.stop.received))
            if self.stop.received:
                self._stopped(self.stop.received, self._stage_label(len(self.cfg.stages) - 1))
            timings = self.clock.breakdown()
            self.run_dir.write_timings(timings)
            write_report(self.run_dir, self.cfg, wall_seconds=seconds, timings=timings)
        self.monitor.log(f"done in {seconds:.0f}s: {self.run_dir.root}")
        self.monitor.close()
