"""Every engine declares the seam it implements and defines each of its members itself.

The backends and rollout engines subclass their Protocol (`Backend`, `RolloutEngine`), so a
type checker holds their signatures to it; a member they failed to define would silently fall
back to the Protocol's empty body, which is what this test rules out. Data attributes the
trainer or the refit guard read must be set by the constructor (checked on the source, so no
model is built here) or be properties."""

import ast
import inspect
import typing

import pytest

from megatron_sdpo.backends.hf import HFBackend
from megatron_sdpo.interfaces.backend import Backend
from megatron_sdpo.rollout.base import RolloutEngine
from megatron_sdpo.rollout.hf import HFRolloutEngine
from megatron_sdpo.rollout.replicas import ReplicatedRollout


def _megatron_backend():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron_sdpo.backends.megatron.backend import MegatronBackend

    return MegatronBackend


def _vllm_engine():
    # The engine module imports vLLM only when an engine starts; the class is importable anyway.
    from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine


CASES = [
    (Backend, lambda: HFBackend),
    (Backend, _megatron_backend),
    (RolloutEngine, lambda: HFRolloutEngine),
    (RolloutEngine, _vllm_engine),
    (RolloutEngine, lambda: ReplicatedRollout),
]


def _members(proto) -> tuple[set[str], set[str]]:
    """(methods, data attributes) the Protocol declares."""
    methods = {n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")}
    data = set(typing.get_type_hints(proto)) if hasattr(proto, "__annotations__") else set()
    return methods, data - methods


def _assigned_in_source(cls) -> set[str]:
    """`self.<name> = ...` targets anywhere in the class body's methods (the constructor and what
    it calls), plus class-level assignments and properties."""
    names = {n for klass in cls.__mro__ if klass.__module__.startswith("megatron_sdpo") for n in vars(klass)}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("megatron_sdpo") or klass in (Backend, RolloutEngine):
            continue
        for node in ast.walk(ast.parse(inspect.getsource(klass))):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                        names.add(el.attr)
    return names


@pytest.mark.parametrize(
    "proto, get_cls", CASES, ids=["hf-backend", "megatron-backend", "hf-engine", "vllm-engine", "replicas"]
)
def test_engine_declares_and_defines_its_protocol(proto, get_cls):
    cls = get_cls()
    assert proto in cls.__mro__, f"{cls.__name__} does not declare {proto.__name__}"
    methods, data = _members(proto)
    inherited = sorted(m for m in methods if getattr(cls, m) is getattr(proto, m))
    assert not inherited, f"{cls.__name__} leaves {inherited} to the Protocol's empty body"
    defined = {n for n in _assigned_in_source(cls)}
    missing = sorted(data - defined)
    assert not missing, f"{cls.__name__} never sets {missing}"
    for m in methods:  # the same parameters, by name and kind (a type checker checks the types)
        want = [(p.name, p.kind) for p in inspect.signature(getattr(proto, m)).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(getattr(cls, m)).parameters.values()]
        assert got[: len(want)] == want, f"{cls.__name__}.{m}{got} does not take {proto.__name__}.{m}{want}"


def test_the_check_catches_a_member_left_to_the_protocol():
    class Lazy(RolloutEngine):
        def __init__(self):
            self.last_sync = {}

        def generate(self, prompt_ids, sampling):
            return []

    methods, data = _members(RolloutEngine)
    assert {m for m in methods if getattr(Lazy, m) is getattr(RolloutEngine, m)} == {"update_weights", "sleep", "wake"}
    assert data - {"last_sync"} <= {"sent_checksums", "received_checksums"}
