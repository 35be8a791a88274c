"""What a run shows while it trains: a progress bar (or plain lines), metrics.jsonl and wandb."""

from __future__ import annotations

import os
import sys
from typing import Any

from megatron_sdpo.outputs.run_dir import RunDir


class RunMonitor:
    """Fans one metrics record out to metrics.jsonl, wandb (optional) and the terminal."""

    def __init__(self, run_dir: RunDir, cfg, *, quiet: bool = False, run_name: str = "", write: bool = True):
        self.run_dir = run_dir
        self.write = write  # only rank 0 of a launch writes and prints
        self.quiet = quiet or cfg.logging.quiet or not sys.stderr.isatty()
        self._wandb = None
        self._progress: Any = None  # rich.progress.Progress while a stage runs (imported then)
        self._task: Any = None
        if cfg.logging.wandb and write:
            self._wandb = self._init_wandb(cfg, run_name or cfg.name)

    def _init_wandb(self, cfg, name: str):
        from megatron_sdpo.errors import require

        # The config's mode (offline by default) unless WANDB_MODE is set in the environment: a
        # run must never hang waiting for a network it does not have.
        mode = os.environ.get("WANDB_MODE") or cfg.logging.wandb_mode
        os.environ.setdefault("WANDB_SILENT", "true")
        wandb = require("wandb", "cpu", "wandb logging")
        from megatron_sdpo.config.construction import to_dict

        kwargs = dict(
            project=cfg.logging.wandb_project,
            name=name,
            dir=str(self.run_dir.root),
            config=to_dict(cfg),
            settings=wandb.Settings(init_timeout=30, silent=True),
        )
        if mode != "online":
            return wandb.init(mode=mode, **kwargs)
        try:
            return wandb.init(mode=mode, **kwargs)
        except Exception as exc:  # wandb raises several types when its server is out of reach
            # Compute nodes often have no route to the server: keep the run and log to the run
            # directory (`wandb sync` uploads it later).
            print(
                f"warning: wandb could not reach its server ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:200]}); "
                f"logging offline under {self.run_dir.root}/wandb",
                file=sys.stderr,
                flush=True,
            )
            return wandb.init(mode="offline", **kwargs)

    # -- stages -----------------------------------------------------------------------------
    def stage_start(self, label: str, total: int, done: int = 0) -> None:
        if not self.write:
            return
        if self.quiet:
            print(f"[{label}] {total} steps (starting at {done})", flush=True)
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]:.3f}  loss {task.fields[loss]:+.4f}  {task.fields[dt]:.2f}s/step"),
            TimeElapsedColumn(),
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(label, total=total, completed=done, reward=0.0, loss=0.0, dt=0.0)

    def step(self, record: dict) -> None:
        if not self.write:
            return
        self.run_dir.append_metrics(record)
        self._to_wandb(record)
        reward, loss, dt = record.get("reward_mean", 0.0), record.get("loss", 0.0), record.get("time/step", 0.0)
        if self._progress is not None:
            self._progress.update(self._task, advance=1, reward=reward, loss=loss, dt=dt)
        else:
            print(
                f"[{record.get('stage_domain')}] step {record.get('step')} reward {reward:.3f} "
                f"loss {loss:+.4f} {dt:.2f}s",
                flush=True,
            )

    def stage_end(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def log(self, message: str) -> None:
        if self.write:
            print(message, flush=True)

    def summary(self, values: dict) -> None:
        self._to_wandb(values)

    def _to_wandb(self, values: dict) -> None:
        if self._wandb is None:
            return
        try:
            self._wandb.log({k: v for k, v in values.items() if isinstance(v, (int, float))})
        except Exception as exc:  # whatever wandb's service raises once it is gone
            self._wandb_gone(exc)

    def _wandb_gone(self, exc: Exception) -> None:
        """wandb logs through a service process of its own, which a scheduler's stop signal (sent
        to every process of the job) or an OOM kill ends: the run goes on, its save included,
        without it; metrics.jsonl holds every record."""
        print(
            f"warning: wandb stopped ({type(exc).__name__}: {' '.join(str(exc).split())[:160]}); the run goes on "
            f"without it (every step is in {self.run_dir.root}/metrics.jsonl)",
            file=sys.stderr,
            flush=True,
        )
        self._wandb = None
        # Its exit hook would talk to the dead service again and print a traceback at exit.
        teardown = getattr(sys.modules.get("wandb"), "teardown", None)
        try:
            if teardown is not None:
                teardown(1)
        except Exception:  # the service is gone: nothing left to close
            pass

    def close(self) -> None:
        self.stage_end()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as exc:
                self._wandb_gone(exc)
            self._wandb = None
