"""Adapter pointers: which version of each job's adapter is current, moved only forward.

The trainer publishes a version with the groups it trained in one Lua step (the pointer,
the trained-groups set and the ledger entry move together), fenced by the job's epoch so
that a replica that lost the job cannot publish; rollout replicas and env_svc read it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.state.dedup import TRAINED
from common.state.keyspace import (
    adapter_key,
    dedup_key,
    fence_key,
    flow_key,
    ledger_key,
    versions_key,
)
from common.state.redis_part import Lua, RedisPart, text, texts
from common.wire.adapters import AdapterRef

# KEYS[1] adapter key, KEYS[2] the job's trained-groups set, KEYS[3] flow key, KEYS[4] fence
# key, KEYS[5] the job's published versions (version -> uri), KEYS[6] the job's ledger; ARGV
# version, uri, step, updated_at, epoch, group ids... -> {moved 1 / not newer 0 / fenced -1,
# version now stored}. The pointer, the groups it trained and their ledger entry move
# together: a crash cannot leave a version published with its groups unmarked. Only the owner
# of the job's current fencing epoch may publish (epoch 0: unfenced). A trained step also ends
# a run of failed groups.
_SET_ADAPTER = """
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
local epoch = tonumber(ARGV[5])
if epoch > 0 and tonumber(redis.call('GET', KEYS[4]) or '0') ~= epoch then
  return {-1, current}
end
local proposed = tonumber(ARGV[1])
if proposed <= current then return {0, current} end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'uri', ARGV[2], 'step', ARGV[3],
           'updated_at', ARGV[4])
redis.call('HSET', KEYS[5], ARGV[1], ARGV[2])
local groups = {}
for i = 6, #ARGV do
  redis.call('SADD', KEYS[2], ARGV[i])
  table.insert(groups, ARGV[i])
end
redis.call('XADD', KEYS[6], '*', 'kind', 'trained', 'version', ARGV[1], 'epoch', ARGV[5],
           'groups', table.concat(groups, ' '))
redis.call('HSET', KEYS[3], 'failed_in_a_row', 0)
return {1, proposed}
"""


# KEYS[1] adapter key; ARGV version -> 1 if `announced` moved up to it, else 0.
_MARK_ANNOUNCED = """
local announced = tonumber(redis.call('HGET', KEYS[1], 'announced') or '0')
if tonumber(ARGV[1]) <= announced then return 0 end
redis.call('HSET', KEYS[1], 'announced', ARGV[1])
return 1
"""


class FencedError(RuntimeError):
    """A publish by a trainer that no longer owns the job: another replica took it over
    (a newer fencing epoch) after this one's partition moved or it stalled."""

    def __init__(self, job_id: str, epoch: int) -> None:
        super().__init__(f"job {job_id!r}: epoch {epoch} was fenced off by a newer owner")
        self.job_id = job_id
        self.epoch = epoch


@dataclass(frozen=True)
class AdapterPointer:
    job_id: str
    version: int
    uri: str
    step: int
    updated_at: float
    announced: int = 0
    """The newest version whose step event went out (0: none, or a pointer older than the
    field): a trainer resuming the job sends the step events of versions after it."""

    @property
    def ref(self) -> AdapterRef:
        """The adapter version the pointer names."""
        return AdapterRef(self.job_id, self.version, self.uri, self.step)

    @classmethod
    def of(cls, job_id: str, fields: Mapping[Any, Any]) -> AdapterPointer:
        values = texts(fields)
        return cls(
            job_id=job_id,
            version=int(values["version"]),
            uri=values["uri"],
            step=int(values["step"]),
            updated_at=float(values["updated_at"]),
            announced=int(values.get("announced", 0)),
        )


class AdapterPointers(RedisPart):
    _set_adapter = Lua(_SET_ADAPTER)
    _mark_announced = Lua(_MARK_ANNOUNCED)

    async def mark_announced(self, job_id: str, version: int) -> None:
        """Record that `version`'s step event was sent (never moves back)."""
        await self._mark_announced(keys=[adapter_key(job_id)], args=[version])

    async def publish(
        self,
        job_id: str,
        version: int,
        uri: str,
        step: int,
        trained_groups: Sequence[str] = (),
        *,
        epoch: int = 0,
    ) -> bool:
        """Point `adapter:{job}` at `version` unless it already holds that or a newer one, and
        in the same atomic step mark `trained_groups` as trained (`seen("trained", ...)`).

        Returns whether the pointer moved; an older writer never overwrites a newer version.
        With an `epoch` (from `take_over`), raises FencedError unless it is still the job's
        newest: a replica that lost the job cannot publish.
        """
        moved, _ = await self._set_adapter(
            keys=[
                adapter_key(job_id),
                dedup_key(TRAINED, job_id),
                flow_key(job_id),
                fence_key(job_id),
                versions_key(job_id),
                ledger_key(job_id),
            ],
            args=[version, uri, step, time.time(), epoch, *trained_groups],
        )
        if int(moved) < 0:
            raise FencedError(job_id, epoch)
        return bool(moved)

    async def published_uri(self, job_id: str, version: int) -> str | None:
        """Where version `version` of the job's adapter was published (None: never, or
        published before versions were recorded)."""
        uri = await self._redis.hget(versions_key(job_id), str(version))
        return None if uri is None else text(uri)

    async def take_over(self, job_id: str) -> int:
        """A new fencing epoch for a trainer taking the job on; every older one is fenced."""
        return int(await self._redis.incr(fence_key(job_id)))

    async def get(self, job_id: str) -> AdapterPointer | None:
        fields = await self._redis.hgetall(adapter_key(job_id))
        return AdapterPointer.of(job_id, fields) if fields else None

    async def all(self) -> dict[str, AdapterPointer]:
        """Every job's adapter pointer (rollout replicas read this at start-up)."""
        pointers: dict[str, AdapterPointer] = {}
        async for key in self._redis.scan_iter(match=f"{adapter_key.prefix}*", count=500):
            job_id = text(key).removeprefix(adapter_key.prefix)
            if fields := await self._redis.hgetall(key):
                pointers[job_id] = AdapterPointer.of(job_id, fields)
        return pointers
