"""A job this replica trains: its spec, the version it has reached, and its groups on the
way from filling to ready to taken by a step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.wire.messages import JobSpec
from trainer_svc.groups import SIGNAL_WINDOW, Group


@dataclass
class OwnedJob:
    """A job this replica trains: its spec, the adapter version it has reached, its groups."""

    spec: JobSpec
    partition: int
    version: int
    epoch: int = 0
    """This replica's fencing epoch for the job: its publishes are refused once another
    replica has taken the job over."""
    filling: dict[str, Group] = field(default_factory=dict)
    ready: deque[Group] = field(default_factory=deque)
    closed: set[str] = field(default_factory=set)
    """Groups that left `filling` here (ready, trained or dropped): late copies of their
    trajectories are not held, so they cannot pin the partition's commits."""
    not_before: float = 0.0
    """Monotonic time before which the job is not stepped (after a step it could not save)."""
    waiting_since: float | None = None
    """Monotonic time since which the job's ready step waits for an older group (`waits`)."""
    resampled: int = 0
    """Groups dropped as uniform since the job's last step (`rl.resample_uniform_groups`
    caps it; kept here only, so a replica that takes the job over starts again at 0)."""
    recent_signal: deque[bool] = field(default_factory=lambda: deque(maxlen=SIGNAL_WINDOW))
    """Whether each of the job's last complete groups had a signal: resampling stops while
    few did (`groups.worth_resampling`). Kept here only, as `resampled` is."""

    def waits(self, now: float, limit_s: float) -> bool:
        """Whether the job's next step waits for a group still filling that the step would
        leave too stale to train (sampled with a version S + 1 behind the one the step makes)
        while it takes a younger ready group in its place; at most `limit_s`. Were the step
        to take only groups as old, the filling one could not be trained anyway."""
        bound = self.version + 1 - self.spec.rl.max_staleness
        doomed = [
            group.oldest_version
            for group in self.filling.values()
            if group.trajectories and group.oldest_version < bound
        ]
        taken = self._oldest_first()[: self.spec.rl.groups_per_step]
        if not doomed or not taken or taken[-1].oldest_version <= min(doomed):
            self.waiting_since = None
            return False
        if self.waiting_since is None:
            self.waiting_since = now
        return now - self.waiting_since < limit_s

    def _oldest_first(self) -> list[Group]:
        """The ready groups in the order steps take them: sampled with the oldest version
        first, then in the order they became ready. A group left behind one sampled later
        would wait a step more and could outrun the staleness bound (dropped, its samples
        wasted)."""
        return sorted(self.ready, key=lambda group: group.oldest_version)

    def take_ready(self) -> list[Group]:
        """The step's B groups, the first of `_oldest_first`."""
        ordered = self._oldest_first()
        count = self.spec.rl.groups_per_step
        self.waiting_since = None
        self.ready = deque(ordered[count:])
        return ordered[:count]

    def release_all(self) -> None:
        """Let go of every group held here: their trajectories' commits are no longer held."""
        for group in [*self.ready, *self.filling.values()]:
            group.release()
        self.ready.clear()
        self.filling.clear()
