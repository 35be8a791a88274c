"""The time a stop needs, and the time the job gives it.

Slurm sends the time-limit signal `--signal=B:USR1@LEAD` seconds before it kills the job; the
lead is fixed when the job is submitted. In that window every rank finishes (or abandons) its
step, the run writes its checkpoint and the processes exit. The grace a stop needs is therefore

    step (the rest of one step) + save (checkpoint bytes per node / write bandwidth)
    + refit (the weights back into the engine, when the training state is offloaded) + margin

computed here before the first step from the plan (`StopBudget.planned`) and, during the run,
from the measured step and save times (continual.py). The preflight fails when the job script's
lead is shorter than the planned grace, naming the lead to use.

The planned step is an estimate with stated constants, not a measurement: every answer runs to
`rollout.max_model_len` (the longest a step can take), training at `TRAIN_MFU` of the GPUs' dense
bf16 peak, decoding memory-bound: every decode step of a wave reads the engine's weights and the
wave's KV cache (its sequences at their mean length) at `DECODE_HBM_SHARE` of HBM bandwidth.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_sdpo.errors import UserError
from megatron_sdpo.stop_request import LEAD_ENV, MARGIN_MIN_S, RESERVE_ENV

# H100-SXM: dense bf16 peak and HBM3 bandwidth (NVIDIA's data sheet); the shares of them a step
# reaches are assumptions, stated where the plan prints them.
PEAK_FLOPS = 989e12
HBM_BYTES_S = 3.35e12
TRAIN_MFU = 0.30
DECODE_HBM_SHARE = 0.5
REFIT_BYTES_S = 50e9  # bucketed refit over NVLink, per rank
MARGIN_SHARE = 0.10  # of the rest, at least MARGIN_MIN_S
__all__ = ["LEAD_ENV", "MARGIN_MIN_S", "RESERVE_ENV"]  # re-exported: the launch environment's names
_SIGNAL = re.compile(r"^#SBATCH\s+--signal[= ](?:[RB]{1,2}:)?(?:SIG)?(\w+)(?:@(\d+))?\s*$", re.M)
SLURM_DEFAULT_LEAD_S = 60  # --signal without @TIME


@dataclass(frozen=True)
class StopBudget:
    step_s: float
    step_source: str
    save_s: float
    save_source: str
    refit_s: float

    @property
    def margin_s(self) -> float:
        return max(MARGIN_MIN_S, MARGIN_SHARE * (self.step_s + self.save_s + self.refit_s))

    @property
    def reserve_s(self) -> float:
        """What a stop needs once the step is done: the save, the refit and the margin."""
        return self.save_s + self.refit_s + self.margin_s

    @property
    def total_s(self) -> float:
        return self.step_s + self.reserve_s

    def line(self) -> str:
        return (
            f"stop grace: {self.total_s:.0f} s = step {self.step_s:.0f} s ({self.step_source}) + save "
            f"{self.save_s:.0f} s ({self.save_source}) + refit {self.refit_s:.0f} s + margin {self.margin_s:.0f} s"
        )


def planned_step_seconds(
    *,
    params: int,
    world: int,
    samples: int,
    max_len: int,
    new_tokens: int,
    waves: int,
    wave_seqs: int,
    kv_bytes_per_token: int,
    engine_weight_bytes: int,
    extra_forwards: int,
    collectives_s: float = 0.0,
) -> tuple[float, str]:
    """One step's seconds when every answer runs to the length limit: train (fwd + bwd, 6 N
    FLOPs a token, plus 2 N for each extra forward: teacher, reference, old log-probs) at
    TRAIN_MFU of the world's peak, and decoding that reads the engine's weights and the wave's
    KV cache (`wave_seqs` sequences of mean length max_len - new_tokens / 2) once per token and
    wave at DECODE_HBM_SHARE of HBM bandwidth, plus `collectives_s` of the engine's TP
    collectives (planning/engine_class.py)."""
    tokens = samples * max_len
    train = (6 + 2 * extra_forwards) * params * tokens / (world * PEAK_FLOPS * TRAIN_MFU)
    per_token = engine_weight_bytes + wave_seqs * (max_len - new_tokens / 2) * kv_bytes_per_token
    decode = new_tokens * max(waves, 1) * per_token / (HBM_BYTES_S * DECODE_HBM_SHARE) + collectives_s
    return train + decode, (
        f"planned: rollout {decode:.0f} s + train {train:.0f} s, every answer at {max_len} tokens, MFU {TRAIN_MFU:.2f}"
    )


def planned_budget(
    *, step_s: float, step_source: str, node_bytes: int, write_gib_s: float, refit_bytes_per_rank: int, offloaded: bool
) -> StopBudget:
    """`node_bytes`: what the node that writes the most writes at a save (the ledger's
    node_save_bytes): the nodes write side by side, so the save lasts as long as that node's."""
    save = node_bytes / (write_gib_s * 2**30)
    refit = refit_bytes_per_rank / REFIT_BYTES_S if offloaded else 0.0
    return StopBudget(
        step_s, step_source, save, f"{node_bytes / 2**30:.1f} GiB per node at {write_gib_s:g} GiB/s", refit
    )


def ranks_per_node(world: int) -> int:
    """GPUS_PER_NODE (the sbatch body's), else LOCAL_WORLD_SIZE (torchrun's), else up to 8."""
    for key in ("GPUS_PER_NODE", "LOCAL_WORLD_SIZE"):
        value = os.environ.get(key)
        if value:
            try:
                return max(1, min(int(value), world))
            except ValueError:
                raise UserError(f"{key}={value!r} is not an integer") from None
    return min(world, 8)


def signal_lead(job_script: Path | None) -> tuple[int | None, str]:
    """(seconds between the stop signal and the kill, where that came from): SDPO_STOP_LEAD_S
    when set (a `--signal` given to sbatch on the command line, which the job cannot read), else
    the job script's `#SBATCH --signal` line; (None, why) when neither says."""
    env = os.environ.get(LEAD_ENV)
    if env:
        try:
            return int(env), LEAD_ENV
        except ValueError:
            raise UserError(f"{LEAD_ENV}={env!r} is not a whole number of seconds") from None
    if job_script is None:
        return None, "no job script"
    try:
        text = job_script.read_text()
    except OSError as exc:
        raise UserError(f"--job-script {job_script}: {exc.strerror or exc}") from None
    found = _SIGNAL.findall(text)
    if not found:
        return None, f"{job_script.name} has no #SBATCH --signal line"
    sig, lead = found[-1]
    return (
        int(lead) if lead else SLURM_DEFAULT_LEAD_S
    ), f"{job_script.name}: #SBATCH --signal {sig}@{lead or '(default 60)'}"


def lead_error(lead: int, source: str, budget: StopBudget) -> str | None:
    """One line when the lead cannot hold the planned grace."""
    if lead >= budget.total_s:
        return None
    need = int(math.ceil(budget.total_s / 60.0) * 60)
    return (
        f"stop signal lead {lead} s ({source}) is shorter than the {budget.total_s:.0f} s a stop needs "
        f"({budget.line().split(' = ', 1)[1]}): submit with #SBATCH --signal=B:USR1@{need}, or lower the step "
        f"(rollout.max_model_len) or raise checkpoint.write_gib_per_s where the filesystem is faster"
    )


def env_lines(lead: int | None, budget: StopBudget | None) -> str:
    """The launch environment the sbatch body sources after the preflight: the lead (torchrun's
    shutdown timeout) and the reserve the run keeps for its save when it decides whether to
    finish a step."""
    lines = []
    if lead is not None:
        lines.append(f"{LEAD_ENV}={lead}")
    if budget is not None:
        lines.append(f"{RESERVE_ENV}={int(math.ceil(budget.reserve_s))}")
    return "".join(f"export {x}\n" for x in lines)


def torchrun_has_shutdown_timeout() -> bool:
    """Whether this torch's torchrun takes --shutdown-timeout (torch 2.11, pytorch/pytorch#172596:
    before it, torchrun killed its workers 30 s after passing the stop signal on)."""
    from torch.distributed.run import get_args_parser

    return "--shutdown-timeout" in get_args_parser()._option_string_actions
