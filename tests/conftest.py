"""Test configuration: skip a marker's tests, with the reason, when its capability is absent."""

import importlib.util
import os

import pytest

# Runs and caches stay inside the test's temporary tree, never in $HOME.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def _slurm_cluster() -> tuple[bool, str]:
    """Whether tools/cluster.sh can bring up its two-node Slurm here, and why not."""
    import shutil
    import subprocess

    if os.uname().sysname != "Linux" or os.geteuid() != 0:
        return False, "needs root on Linux (network namespaces, slurmd): tests/cluster skipped"
    if not all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged")) and not shutil.which("apt-get"):
        return False, "Slurm and munge are not installed and there is no apt-get to install them: tests/cluster skipped"
    probe = subprocess.run(["ip", "netns", "add", "sdpo-probe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", "sdpo-probe"], capture_output=True)
    if probe.returncode != 0:
        return False, f"cannot create a network namespace here ({probe.stderr.strip()}): tests/cluster skipped"
    return True, ""


CAPABILITIES = {
    "cluster": (_slurm_cluster, ""),  # (whether, the reason why not)
    "megatron": (lambda: _has("megatron.core"), "megatron-core is not installed (pip install -e .[cpu])"),
    "vllm": (lambda: _has("vllm"), "vLLM is not installed (pip install -e .[cpu] or .[gpu])"),
    "triton": (lambda: _has("triton"), "triton is not installed"),
    "gpu": (_cuda, "no CUDA GPU on this machine"),
    "distributed": (lambda: _has("torch.distributed"), "torch.distributed is unavailable"),
}


def _tiny_two_stage(name: str, *, steps: tuple[int, int] = (2, 2), **sections: str) -> str:
    """The tiny preset cut to a math and a tool-use stage with small eval sets (YAML text): the run
    the multi-process and study tests launch. `sections` add top-level keys as flow-style YAML
    (rollout="{engine: hf, max_new_tokens: 16}")."""
    lines = [
        "defaults: tiny",
        f"name: {name}",
        "stages:",
        f"  - {{domain: math, steps: {steps[0]}}}",
        f"  - {{domain: tooluse, steps: {steps[1]}}}",
        "domains:",
        "  math: {eval: {id: {n: 8}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}",
        "  science: {eval: {id: {n: 4}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}",
        "  tooluse: {eval: {id: {n: 8}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}",
        "  code: {eval: {id: {n: 4}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}",
        "algorithm: {prompts_per_step: 4, group_size: 4}",
        *(f"{key}: {value}" for key, value in sections.items()),
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def tiny_two_stage():
    return _tiny_two_stage


def pytest_collection_modifyitems(config, items):
    cache: dict[str, tuple[bool, str]] = {}
    for item in items:
        for name, (probe, reason) in CAPABILITIES.items():
            if name in item.keywords:
                if name not in cache:
                    found = probe()
                    cache[name] = found if isinstance(found, tuple) else (bool(found), reason)
                if not cache[name][0]:
                    item.add_marker(pytest.mark.skip(reason=cache[name][1]))


def _assert_adam_first_step_close(got, want, g_got, g_want, *, lr: float, eps: float = 1e-8, what: str = ""):
    """Two parameter tensors after ONE AdamW step (no weight decay) from the same weights, taken with
    gradients `g_got` / `g_want` (after clipping), agree as far as the gradients do.

    Why not a fixed tolerance: Adam's first update is -lr * f(g), f(g) = g / (|g| + eps) (m_hat = g,
    v_hat = g^2 after bias correction), i.e. ~lr * sign(g). Where |g| is near eps, fp32 rounding of
    g is amplified up to lr / eps times, so a fixed atol either hides real errors (lr, betas, eps)
    or fails on a machine whose reductions round differently.

    The bound, elementwise: f has f'(x) = eps / (|x| + eps)^2, so by the mean
    value theorem |f(g1) - f(g2)| <= |g1 - g2| * eps / (d + eps)^2 with d = min(|g1|, |g2|) when g1
    and g2 have the same sign and d = 0 when [g1, g2] contains 0; |f| < 1 caps it at 2. This is
    evaluated (in float64) on the gradients as the test knows them, exp_avg / (1 - beta1), which
    are the optimizer's to within 4u relative (u = fp32 unit roundoff: the product, 0.1 in fp32,
    the division); since x * eps / (x + eps)^2 <= 1/4, that moves each side's f by at most u.
    Each side's own fp32 arithmetic adds at most u * |p_new| (rounding the new weight) plus
    8u * lr (bias corrections, sqrt, + eps, division, the scaled add). Total slack:
    u * (|got| + |want|) + (16 + 2) u * lr, taken as 20u * lr. Where |g| >> eps the bound is
    ~1e-7 * |p|: a wrong lr, beta or eps shows (a 0.1% lr error fails it).
    """
    import torch

    u = torch.finfo(torch.float32).eps / 2
    got, want = got.double(), want.double()
    g1, g2 = g_got.double(), g_want.double()
    d = torch.where(g1 * g2 > 0, torch.minimum(g1.abs(), g2.abs()), torch.zeros_like(g1))
    amplified = ((g1 - g2).abs() * eps / (d + eps) ** 2).clamp(max=2.0)
    bound = lr * amplified + u * (got.abs() + want.abs()) + 20 * u * lr
    err = (got - want).abs()  # exact in float64: the difference of the two updates
    bad = err > bound
    if bad.any():
        i = int(torch.argmax((err - bound) / bound.clamp_min(1e-30)))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} weights differ beyond the Adam first-step bound; "
            f"worst: update diff {float(err.flatten()[i]):.3e} > bound {float(bound.flatten()[i]):.3e} "
            f"(grads {float(g1.flatten()[i]):.3e} vs {float(g2.flatten()[i]):.3e})"
        )


@pytest.fixture
def assert_adam_first_step_close():
    """The checker above, for tests comparing weights after one AdamW step (see its docstring)."""
    return _assert_adam_first_step_close
