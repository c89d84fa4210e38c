"""Group assembly rules of the trainer: when a group is complete, stale or unusable."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from common.messages import DropKind, Trajectory

Verdict = Literal["train"] | DropKind
"""Train the group, or drop it (and why: the drop kinds of `GroupDropped`)."""


@dataclass
class Group:
    """Trajectories of one group as they arrive, with the commits they hold."""

    group_id: str
    trajectories: dict[str, Trajectory] = field(default_factory=dict)
    releases: list[Callable[[], None]] = field(default_factory=list)

    def add(self, trajectory: Trajectory, release: Callable[[], None]) -> None:
        """Keep a new episode's trajectory and the function that releases its commit."""
        self.trajectories[trajectory.episode_id] = trajectory
        self.releases.append(release)

    def complete(self, group_size: int) -> bool:
        return len(self.trajectories) >= group_size

    def release(self) -> None:
        for release in self.releases:
            release()
        self.releases.clear()

    @property
    def oldest_version(self) -> int:
        """The adapter version of the group's oldest sampled turn."""
        return min(v for t in self.trajectories.values() for v in t.adapter_versions or [0])

    @property
    def valid(self) -> list[Trajectory]:
        """Trajectories whose reward could be computed."""
        return [t for t in self.trajectories.values() if not t.error]


def verdict(group: Group, *, trained_version: int, max_staleness: int) -> tuple[Verdict, str]:
    """Train the group on adapter `trained_version`, or drop it, and why.

    Stale: the oldest turn is more than S versions behind the adapter being trained.
    Invalid: fewer than two trajectories with a reward, so no relative advantage exists.
    """
    lag = trained_version - group.oldest_version
    if lag > max_staleness:
        return "dropped_stale", f"{lag} versions behind (max_staleness {max_staleness})"
    if len(group.valid) < 2:
        errors = sorted({t.error for t in group.trajectories.values() if t.error})
        return "dropped_invalid", f"{len(group.valid)} rewarded trajectories; " + "; ".join(errors)
    return "train", f"{lag} versions behind"
