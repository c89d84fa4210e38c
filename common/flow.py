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
"""Groups the trainer will never train (stale or invalid); each frees a slot for a new one.
Counted once per group id, however often a drop is replayed."""
FAILED_IN_A_ROW = "failed_in_a_row"
"""Groups dropped as invalid (no usable rewards) since the job's last trained step; a job
that reaches the trainer's limit fails instead of being re-issued forever."""


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
    failed_in_a_row: int = 0

    @property
    def live_groups(self) -> int:
        return self.issued_groups - self.dropped_groups

    def untrained_groups(self, groups_per_step: int) -> int:
        """Live groups not yet trained: issued, neither dropped nor part of a trained step."""
        return max(self.live_groups - self.trained_version * groups_per_step, 0)


@dataclass(frozen=True)
class DroppedGroup:
    counted: bool
    """False when this group's drop was already counted (a replay after a crash)."""
    dropped_groups: int
    failed_in_a_row: int


@dataclass(frozen=True)
class IssuedGroup:
    index: int
    """The group's index in the job's task stream."""
    trained_version: int
    """The job's trained version when the group was claimed: its samples wait for it."""


def ledger_key(job_id: str) -> str:
    """The job's audit ledger: a Redis stream with one entry per effect on a group, each
    written by the same Lua script as the effect (console/audit.py reads it)."""
    return f"ledger:{job_id}"


def claims_key(job_id: str) -> str:
    """Hash of the job's claimed group indices whose first requests are not all sent yet,
    index -> when claimed (or last re-sent); env_svc's sweeper re-sends the old ones."""
    return f"claims:{job_id}"


TRY_ISSUE_GROUP = """
-- KEYS[1] flow:{job}, KEYS[2] claims:{job}, KEYS[3] ledger:{job}; ARGV max_staleness,
-- groups_per_step, max_groups, now, job -> {claimed index or -1, trained version}. The
-- trained version is read from adapter:{job} undeclared: a declared key needs write access
-- under Redis ACLs, and env_svc only reads the pointer (common/access.py).
local issued = tonumber(redis.call('HGET', KEYS[1], 'issued_groups') or '0')
local dropped = tonumber(redis.call('HGET', KEYS[1], 'dropped_groups') or '0')
local trained = tonumber(redis.call('HGET', 'adapter:' .. ARGV[5], 'version') or '0')
local limit = (trained + tonumber(ARGV[1]) + 1) * tonumber(ARGV[2])
if issued - dropped >= limit or issued - dropped >= tonumber(ARGV[3]) then
  return {-1, trained}
end
redis.call('HSET', KEYS[1], 'issued_groups', issued + 1)
redis.call('HSET', KEYS[2], issued, ARGV[4] .. ':' .. trained)
redis.call('XADD', KEYS[3], '*', 'kind', 'issued', 'group', issued, 'version', trained)
return {issued, trained}
"""

TAKE_STALE_CLAIMS = """
-- KEYS[1] claims:{job}; ARGV cutoff, now -> {index, trained version, ...} of the claims
-- older than cutoff, each re-armed to now so that one sweeper re-sends it, not every replica
local taken = {}
local claims = redis.call('HGETALL', KEYS[1])
for i = 1, #claims, 2 do
  local at, trained = string.match(claims[i + 1], '([^:]+):(.+)')
  if tonumber(at) < tonumber(ARGV[1]) then
    redis.call('HSET', KEYS[1], claims[i], ARGV[2] .. ':' .. trained)
    table.insert(taken, tonumber(claims[i]))
    table.insert(taken, tonumber(trained))
  end
end
return taken
"""

RECORD_DROP = """
-- KEYS[1] flow:{job}, KEYS[2] the job's dropped-groups set, KEYS[3] ledger:{job}, KEYS[4]
-- the job's trained-groups set; ARGV group id, invalid 0/1, drop kind -> {counted 0/1,
-- dropped_groups, failed_in_a_row}. A group a published version trained is never dropped.
local counted = 0
if redis.call('SISMEMBER', KEYS[4], ARGV[1]) == 0 then
  counted = redis.call('SADD', KEYS[2], ARGV[1])
end
if counted == 1 then
  redis.call('HINCRBY', KEYS[1], 'dropped_groups', 1)
  if ARGV[2] == '1' then redis.call('HINCRBY', KEYS[1], 'failed_in_a_row', 1) end
  redis.call('XADD', KEYS[3], '*', 'kind', 'dropped', 'group', ARGV[1], 'reason', ARGV[3])
end
return {counted, tonumber(redis.call('HGET', KEYS[1], 'dropped_groups') or '0'),
        tonumber(redis.call('HGET', KEYS[1], 'failed_in_a_row') or '0')}
"""

FINISH_CLAIM = """
-- KEYS[1] claims:{job}, KEYS[2] ledger:{job}; ARGV group index
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('XADD', KEYS[2], '*', 'kind', 'sent', 'group', ARGV[1])
"""
