"""DAPO's dynamic sampling: groups whose rewards all agree leave the batch, more prompts refill it.

A group of samples whose rewards are all equal has GRPO advantage 0 on every row: it costs a
rollout and teaches nothing. With `algorithm.filter_groups.enabled` the trainer keeps only the
groups with reward variance and draws more prompts (a fresh round of generation) until it holds
`prompts_per_step` of them or `max_extra_rounds` extra rounds have run, as verl's DAPO recipe
does. Where the cap is reached short of a full batch, the batch is filled with the last
filtered-out groups rather than trained smaller (verl stops with an error there): the batch keeps
its shape (mini-batches of whole groups) and the exact zero-signal skipping (algorithms/signal_rows.py)
leaves those rows out of the forward and backward at no cost.

The extra rounds' prompts and seeds are pure functions of (stage, step, round), like the first
round's, so a resumed run draws the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sdpo.rollout.base import Completion


def informative(rewards: list[float], group_size: int) -> list[bool]:
    """Per group of `group_size` consecutive samples: whether its rewards are not all equal."""
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return [max(g) != min(g) for g in groups]


@dataclass
class Group:
    """One prompt's record, its prompt ids, its samples and their scoring results."""

    record: dict
    prompt_ids: list[int]
    completions: list[Completion]
    results: list


@dataclass
class GroupPool:
    """The groups a step trains on, gathered over generation rounds.

    want: groups per step (`prompts_per_step`). `add` takes one round's groups; `full` says when
    enough informative ones are held; `batch()` gives the first `want` informative groups, then
    filtered-out ones of the latest rounds where too few were found."""

    want: int
    kept: list[Group] = field(default_factory=list)
    dropped: list[Group] = field(default_factory=list)
    rounds: int = 0
    generated: int = 0  # samples generated over all rounds

    def add(self, groups: list[Group], keep: list[bool]) -> None:
        self.rounds += 1
        self.generated += sum(len(g.completions) for g in groups)
        for g, k in zip(groups, keep, strict=True):
            (self.kept if k else self.dropped).append(g)

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.want

    def batch(self) -> list[Group]:
        fill = max(0, self.want - len(self.kept))
        return self.kept[: self.want] + (self.dropped[len(self.dropped) - fill :] if fill else [])

    def metrics(self, group_size: int) -> dict[str, float]:
        """What the filtering cost and found (`dynamic/...`)."""
        return {
            "dynamic/rounds": float(self.rounds),
            "dynamic/extra_rollouts": float(self.generated - self.want * group_size),
            "dynamic/kept_groups": float(min(len(self.kept), self.want)),
            "dynamic/filled_groups": float(max(0, self.want - len(self.kept))),
            "dynamic/informative_frac": len(self.kept) / max(len(self.kept) + len(self.dropped), 1),
        }
