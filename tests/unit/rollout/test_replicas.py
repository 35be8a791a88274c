"""Splitting a step's prompts over rollout replicas and gathering the completions back."""

import os

import pytest
import torch.multiprocessing as mp

from megatron_sdpo.errors import ConfigError
from megatron_sdpo.rollout.base import Completion, SamplingConfig
from megatron_sdpo.rollout.replicas import ReplicaLayout, ReplicatedRollout, merge_shares, share_bounds


def test_share_bounds_cover_every_prompt_once_in_order():
    for n in range(0, 12):
        for replicas in range(1, 5):
            bounds = share_bounds(n, replicas)
            assert len(bounds) == replicas
            assert [i for s, e in bounds for i in range(s, e)] == list(range(n))
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_merge_shares_restores_global_prompt_indices():
    bounds = share_bounds(5, 2)  # [0, 3), [3, 5)
    a = [Completion(i, [i], [-0.5], f"a{i}", False) for i in (0, 0, 1, 1, 2, 2)]
    b = [Completion(i, [10 + i], [-0.5], f"b{i}", True) for i in (0, 0, 1, 1)]
    merged = merge_shares([a, b], bounds)
    assert [c.prompt_index for c in merged] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [c.text for c in merged[-2:]] == ["b1", "b1"]
    with pytest.raises(ValueError, match="outside its share"):
        merge_shares([a, [Completion(2, [], [], "", False)]], bounds)


def test_layout_errors_are_one_line_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="must divide the number of ranks"):
        ReplicaLayout(world=4, tp=3, rank=0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="needs a launch of at least 2 ranks"):
        ReplicaLayout.of_launch(2)
    assert ReplicaLayout(world=4, tp=2, rank=3).replica == 1 and ReplicaLayout(world=4, tp=2, rank=3).replicas == 2


class FakeEngine:
    """Completions that depend only on the prompt and its global index (like seeded vLLM)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, sampling, *, first_index=0):
        self.calls.append((len(prompt_ids), first_index))
        out = []
        for i, p in enumerate(prompt_ids):
            g = first_index + i
            for k in range(sampling.n):
                out.append(Completion(i, [sum(p), g, k, sampling.seed], [-float(g)], f"{g}.{k}", False))
        return out


PROMPTS = [[i, i + 1] for i in range(7)]


def _worker(rank: int, world: int, tp: int, port: int, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        engine = FakeEngine()
        rollout = ReplicatedRollout(engine, ReplicaLayout.of_launch(tp))
        comps = rollout.generate(PROMPTS, SamplingConfig(n=3, seed=5))
        empty = rollout.generate(PROMPTS[:1], SamplingConfig(n=2, seed=6))  # replicas without prompts
        out.put((rank, [(c.prompt_index, c.token_ids, c.text) for c in comps], len(empty), engine.calls))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_replicas_gather_the_single_process_batch_on_every_rank(tp):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 4 if tp == 2 else 2
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, tp, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    single = FakeEngine().generate(PROMPTS, SamplingConfig(n=3, seed=5))
    want = [(c.prompt_index, c.token_ids, c.text) for c in single]
    replicas = world // tp
    bounds = share_bounds(len(PROMPTS), replicas)
    for r in range(world):
        got, n_empty, calls = results[r]
        assert got == want
        assert n_empty == 2
        start, end = bounds[r // tp]
        # This rank generated only its replica's share, seeded by the share's global offset;
        # ranks whose share of the one-prompt call is empty still called generate.
        assert calls[0] == (end - start, start)
        assert len(calls) == 2
