"""Flow control: how far generation may run ahead of training, in one place.

The rule (docs/architecture.md, "Flow control"): a job may have at most
`(trained_version + S + 1) * B` live groups issued, where live = issued minus dropped, and
never more than `max_steps * B` (more would be waste). Each trained version releases exactly
one step's worth of groups; with S = 0 generation never runs ahead of training.

State: `flow:{job}` holds the two counters below. The trained version is NOT stored here: it
is the adapter pointer's version (`adapter:{job}`, moved forward by the trainer), stored once
and read by the issue script. `issue_limit` and `TRY_ISSUE_GROUP` are the same rule, one in
Python (tests, the status board) and one in Lua (the atomic claim in Redis).
"""

from __future__ import annotations

from dataclasses import dataclass

ISSUED_GROUPS = "issued_groups"
"""Group indices claimed so far (env_svc); index n is the job's n-th task."""
DROPPED_GROUPS = "dropped_groups"
"""Groups the trainer will never train (stale or invalid); each frees a slot for a new one."""


def flow_key(job_id: str) -> str:
    return f"flow:{job_id}"


def issue_limit(trained_version: int, max_staleness: int, groups_per_step: int) -> int:
    """How many live groups a job may have issued: `(trained_version + S + 1) * B`."""
    return (trained_version + max_staleness + 1) * groups_per_step


@dataclass(frozen=True)
class FlowState:
    """A job's flow-control counters and trained version, read together."""

    issued_groups: int
    dropped_groups: int
    trained_version: int

    @property
    def live_groups(self) -> int:
        return self.issued_groups - self.dropped_groups

    def untrained_groups(self, groups_per_step: int) -> int:
        """Live groups not yet trained: issued, neither dropped nor part of a trained step."""
        return max(self.live_groups - self.trained_version * groups_per_step, 0)


@dataclass(frozen=True)
class IssuedGroup:
    index: int
    """The group's index in the job's task stream."""
    trained_version: int
    """The job's trained version when the group was claimed: its samples wait for it."""


TRY_ISSUE_GROUP = """
-- KEYS[1] flow:{job}, KEYS[2] adapter:{job}; ARGV max_staleness, groups_per_step, max_groups
-- -> {claimed index or -1, trained version}
local issued = tonumber(redis.call('HGET', KEYS[1], 'issued_groups') or '0')
local dropped = tonumber(redis.call('HGET', KEYS[1], 'dropped_groups') or '0')
local trained = tonumber(redis.call('HGET', KEYS[2], 'version') or '0')
local limit = (trained + tonumber(ARGV[1]) + 1) * tonumber(ARGV[2])
if issued - dropped >= limit or issued - dropped >= tonumber(ARGV[3]) then
  return {-1, trained}
end
redis.call('HSET', KEYS[1], 'issued_groups', issued + 1)
return {issued, trained}
"""
