"""`python -m megatron_sdpo ...` with a rollout that can be slowed from outside: while the file
named by SDPO_TEST_SLOW_FLAG exists, each rollout touches `<flag>.in_rollout` and sleeps the
seconds the flag holds. The cluster tests put a `python` that runs this first on the job's PATH,
so that a signal lands in the middle of a step; the sbatch scripts themselves are unchanged."""

import os
import pathlib
import sys
import time

from megatron_sdpo import trainer
from megatron_sdpo.cli import main

_rollout = trainer.Trainer._rollout


def _slowed(self, *args, **kwargs):
    flag = pathlib.Path(os.environ["SDPO_TEST_SLOW_FLAG"])
    if flag.exists():
        pathlib.Path(f"{flag}.in_rollout").touch()
        time.sleep(float(flag.read_text()))
    return _rollout(self, *args, **kwargs)


if __name__ == "__main__":  # not in the processes multiprocessing spawns, which import this module
    trainer.Trainer._rollout = _slowed
    sys.exit(main(sys.argv[1:]))
