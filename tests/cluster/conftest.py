"""The real two-node Slurm of tools/cluster.sh, up for the session and down after it (the
`cluster` marker: root, Linux network namespaces and the distribution's Slurm packages)."""

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "tools" / "cluster.sh"
NODES = ("sdpo-node1", "sdpo-node2")


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=timeout)


def _running(daemon: str) -> bool:
    return subprocess.run(["pgrep", "-x", daemon], capture_output=True).returncode == 0


def leftovers(munged_before: bool = True) -> list[str]:
    """What a torn-down cluster must not leave: slurmd, slurmctld, the munged it started (one
    that ran before it is the machine's), our namespaces."""
    found = [] if munged_before or not _running("munged") else ["munged"]
    for daemon in ("slurmd", "slurmctld"):
        if _running(daemon):
            found.append(daemon)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [n for n in NODES if n in netns]
    return found


@pytest.fixture(scope="session")
def slurm_cluster():
    """The environment a submitting user has: SLURM_CONF of the test cluster, brought up afresh:
    a test cluster that an earlier, killed session left up (its jobs still holding the nodes)
    is taken down first."""
    if leftovers():
        earlier = _script("down", timeout=300)
        assert earlier.returncode == 0, (
            f"tools/cluster.sh down (an earlier session's cluster) failed:\n{earlier.stderr}"
        )
    munged_before = _running("munged")
    up = _script("up", timeout=900)
    try:
        assert up.returncode == 0, f"tools/cluster.sh up failed:\n{up.stdout}\n{up.stderr}"
        conf = _script("env", timeout=30).stdout.strip().removeprefix("export SLURM_CONF=")
        yield {"SLURM_CONF": conf}
    finally:
        down = _script("down", timeout=300)
        assert down.returncode == 0, f"tools/cluster.sh down failed:\n{down.stdout}\n{down.stderr}"
        assert leftovers(munged_before) == [], f"left running after tools/cluster.sh down: {leftovers(munged_before)}"
