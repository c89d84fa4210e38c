"""De-dup sets: the ids a job has already handled in a scope (e.g. the groups a published
version trained), so that a redelivered record is handled once."""

from __future__ import annotations

from collections.abc import Sequence

from common.state.keyspace import dedup_key
from common.state.redis_part import RedisPart

TRAINED = "trained"
"""De-dup scope of the groups a published version trained."""
DROPPED = "dropped"
"""De-dup scope of the groups counted as dropped."""
RESULTS = "results"
"""De-dup scope of the generation results env_svc answered (by request id)."""
COMMANDS = "commands"
"""De-dup scope of the job commands env_svc applied (a replayed one changes nothing)."""


class DedupSets(RedisPart):
    async def mark_seen(self, scope: str, job_id: str, item_id: str) -> bool:
        """Record `item_id` as handled; True the first time, False for a duplicate."""
        return bool(await self._redis.sadd(dedup_key(scope, job_id), item_id))

    async def seen(self, scope: str, job_id: str, item_id: str) -> bool:
        return bool(await self._redis.sismember(dedup_key(scope, job_id), item_id))

    async def seen_in_any(self, scopes: Sequence[str], job_id: str, item_id: str) -> bool:
        """Whether `item_id` was handled in any of `scopes`, in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for scope in scopes:
                pipe.sismember(dedup_key(scope, job_id), item_id)
            return any(await pipe.execute())

    async def forget_seen(self, scope: str, job_id: str, item_id: str) -> None:
        """Undo `mark_seen` when the work it guarded failed before becoming durable."""
        await self._redis.srem(dedup_key(scope, job_id), item_id)

    async def dropped_among(self, job_id: str, group_ids: Sequence[str]) -> set[str]:
        """Those of `group_ids` counted as dropped (by any replica, at any time)."""
        if not group_ids:
            return set()
        found = await self._redis.smismember(dedup_key(DROPPED, job_id), list(group_ids))
        return {group_id for group_id, hit in zip(group_ids, found, strict=True) if hit}
