"""Flow control: how far generation may run ahead of training, in one place.

The rule (docs/architecture.md, "Flow control"): a job may have at most
`(trained_version + S + 1) * B` live groups issued, where live = issued minus dropped, and
never more than `max_steps * B` (more would be waste). Each trained version releases exactly
one step's worth of groups; with S = 0 generation never runs ahead of training.

State: `flow:{job}` holds the counters below; `claims:{job}` the claimed groups not yet
sent and `ledger:{job}` the audit ledger (common/state/keyspace.py). `FlowWindow` is the store's
part that moves them, each move one Lua script. The trained version is NOT stored here: it
is the adapter pointer's version (`adapter:{job}`, moved forward by the trainer), stored once
and read by the issue script. `issue_limit` and `_TRY_ISSUE_GROUP` are the same rule, one in
Python (tests, the status board) and one in Lua (the atomic claim in Redis).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.state.dedup import DROPPED, TRAINED
from common.state.keyspace import (
    adapter_key,
    claims_key,
    dedup_key,
    fence_key,
    flow_key,
    ledger_key,
)
from common.state.pointers import FencedError
from common.state.redis_part import Lua, RedisPart, text

ISSUED_GROUPS = "issued_groups"
"""Group indices claimed so far (env_svc); index n is the job's n-th task."""
DROPPED_GROUPS = "dropped_groups"
"""Groups the trainer will never train (stale or invalid); each frees a slot for a new one.
Counted once per group id, however often a drop is replayed."""
FAILED_IN_A_ROW = "failed_in_a_row"
"""Groups dropped as invalid (no usable rewards) since the job's last trained step; a job
that reaches the trainer's limit fails instead of being re-issued forever."""


def group_id_of(job_id: str, index: int) -> str:
    """The id of the job's group number `index` (its `index`-th task): `<job>/g<index>`."""
    return f"{job_id}/g{index}"


def group_index_of(job_id: str, group_id: str) -> int | None:
    """The inverse of `group_id_of`: n for `<job>/g<n>`, None for an id `group_id_of` never
    makes for this job (another job's, a leading zero, anything but ASCII digits)."""
    tail = group_id.removeprefix(f"{job_id}/g")
    if tail == group_id or not (tail.isascii() and tail.isdigit()):
        return None
    index = int(tail)
    return index if group_id_of(job_id, index) == group_id else None


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


_TRY_ISSUE_GROUP = """
-- KEYS[1] flow:{job}, KEYS[2] claims:{job}, KEYS[3] ledger:{job}; ARGV max_staleness,
-- groups_per_step, max_groups, now, job -> {claimed index or -1, trained version}. The
-- trained version is read from adapter:{job} undeclared: a declared key needs write access
-- under Redis ACLs, and env_svc only reads the pointer (common/security/access.py).
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

_TAKE_STALE_CLAIMS = """
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

_RECORD_DROP = """
-- KEYS[1] flow:{job}, KEYS[2] the job's dropped-groups set, KEYS[3] ledger:{job}, KEYS[4]
-- the job's trained-groups set, KEYS[5] fence:{job}; ARGV group id, invalid 0/1, drop kind,
-- epoch -> {counted 0/1 (-1: fenced), dropped_groups, failed_in_a_row}. A group a published
-- version trained is never dropped; only the owner of the job's current fencing epoch may
-- drop (epoch 0: unfenced), as only it may publish.
local epoch = tonumber(ARGV[4])
if epoch > 0 and tonumber(redis.call('GET', KEYS[5]) or '0') ~= epoch then
  return {-1, 0, 0}
end
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

_FINISH_CLAIM = """
-- KEYS[1] claims:{job}, KEYS[2] ledger:{job}; ARGV group index
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('XADD', KEYS[2], '*', 'kind', 'sent', 'group', ARGV[1])
"""


class FlowWindow(RedisPart):
    """Each job's window of live groups: claims, drops, and the audit ledger they write."""

    _try_issue_group = Lua(_TRY_ISSUE_GROUP)
    _take_stale_claims = Lua(_TAKE_STALE_CLAIMS)
    _record_drop = Lua(_RECORD_DROP)
    _finish_claim = Lua(_FINISH_CLAIM)

    async def try_issue_group(
        self, job_id: str, *, max_staleness: int, groups_per_step: int, max_groups: int
    ) -> IssuedGroup | None:
        """Claim the next group index if the staleness bound allows it, else None.

        `max_groups` caps the live groups of the whole job (max_steps * B: more is waste).
        """
        index, trained_version = await self._try_issue_group(
            keys=[flow_key(job_id), claims_key(job_id), ledger_key(job_id)],
            args=[max_staleness, groups_per_step, max_groups, time.time(), job_id],
        )
        return None if int(index) < 0 else IssuedGroup(int(index), int(trained_version))

    async def finish_claim(self, job_id: str, index: int) -> None:
        """Every first request of claimed group `index` is on the bus: nothing to re-send."""
        await self._finish_claim(keys=[claims_key(job_id), ledger_key(job_id)], args=[index])

    async def take_stale_claims(self, job_id: str, older_than_s: float) -> list[IssuedGroup]:
        """Claims not finished for `older_than_s` (their replica died or failed mid-group),
        each handed to one caller per `older_than_s`: the caller re-sends the group."""
        now = time.time()
        flat = await self._take_stale_claims(
            keys=[claims_key(job_id)], args=[now - older_than_s, now]
        )
        return [IssuedGroup(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def record_dropped_group(
        self,
        job_id: str,
        group_id: str,
        *,
        invalid: bool,
        kind: str = "dropped",
        epoch: int = 0,
    ) -> DroppedGroup:
        """Count a group out of the job's window (it is replaced), once per group id; an
        `invalid` one (no usable rewards) also extends the job's run of failed groups.

        With an `epoch` (from `take_over`), raises FencedError unless it is still the job's
        newest: a replica that lost the job cannot drop its groups."""
        counted, dropped, failed = await self._record_drop(
            keys=[
                flow_key(job_id),
                dedup_key(DROPPED, job_id),
                ledger_key(job_id),
                dedup_key(TRAINED, job_id),
                fence_key(job_id),
            ],
            args=[group_id, int(invalid), kind, epoch],
        )
        if int(counted) < 0:
            raise FencedError(job_id, epoch)
        return DroppedGroup(bool(counted), int(dropped), int(failed))

    async def state(self, job_id: str) -> FlowState:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(flow_key(job_id))
            pipe.hget(adapter_key(job_id), "version")
            counters, version = await pipe.execute()
        values = {text(k): int(v) for k, v in counters.items()}
        return FlowState(
            issued_groups=values.get(ISSUED_GROUPS, 0),
            dropped_groups=values.get(DROPPED_GROUPS, 0),
            trained_version=int(version or 0),
            failed_in_a_row=values.get(FAILED_IN_A_ROW, 0),
        )

    async def live_groups(self, job_id: str) -> list[str]:
        """Ids of the job's issued groups neither trained nor dropped, oldest first."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hget(flow_key(job_id), ISSUED_GROUPS)
            pipe.smembers(dedup_key(TRAINED, job_id))
            pipe.smembers(dedup_key(DROPPED, job_id))
            issued, trained, dropped = await pipe.execute()
        done = {text(g) for g in trained | dropped}
        ids = (group_id_of(job_id, index) for index in range(int(issued or 0)))
        return [group_id for group_id in ids if group_id not in done]

    async def ledger(self, job_id: str) -> list[dict[str, str]]:
        """The job's audit ledger, oldest first: each entry's fields (kind, group, ...)."""
        entries = await self._redis.xrange(ledger_key(job_id)) or []
        return [{text(k): text(v) for k, v in (fields or {}).items()} for _, fields in entries]

    async def last_activity(self, job_id: str) -> float | None:
        """When the job's ledger last moved (a group issued, sent, trained or dropped), unix
        s; None before its first entry."""
        entries = await self._redis.xrevrange(ledger_key(job_id), count=1) or []
        if not entries or entries[0][0] is None:
            return None
        return int(text(entries[0][0]).split("-")[0]) / 1000  # the entry id's milliseconds
