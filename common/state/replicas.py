"""What replicas report: rollout replicas' numbers (and their history), what each replica
computes on and in, and the embedded stack's restarts of each service."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from common.state.keyspace import RESTARTS, runtime_key, stats_history_key, stats_key
from common.state.redis_part import RedisPart, text, texts
from common.wire.lifecycle import RolloutReplicaStats

ENVIRONMENTS_FIELD = "environments"
"""An env_svc replica's runtime field: the environments it serves, comma-separated."""

STATS_HISTORY_SAMPLES = 20_000
"""Samples kept per replica (one per 5 s report: over a day)."""
STATS_HISTORY_TTL_S = 7 * 24 * 3600
"""A stopped replica's history outlives it by a week, for reports of past runs."""


class ReplicaBoard(RedisPart):
    async def put_stats(self, replica: str, stats: RolloutReplicaStats, *, ttl_s: int) -> None:
        """Publish a rollout replica's numbers; they vanish if it stops reporting.

        Each call also appends a timestamped sample to the replica's history (a capped Redis
        stream) for reports of utilisation and throughput over time.
        """
        key = stats_key(replica)
        # redis-py's mapping types are invariant; every value here is a float.
        numbers: dict[Any, Any] = stats.as_map()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=numbers)
            pipe.expire(key, ttl_s)
            pipe.xadd(
                stats_history_key(replica),
                {**numbers, "at": time.time()},
                maxlen=STATS_HISTORY_SAMPLES,
                approximate=True,
            )
            pipe.expire(stats_history_key(replica), STATS_HISTORY_TTL_S)
            await pipe.execute()

    async def stats(self) -> dict[str, RolloutReplicaStats]:
        """The numbers of every live rollout replica, by replica name."""
        found: dict[str, RolloutReplicaStats] = {}
        async for key in self._redis.scan_iter(match=f"{stats_key.prefix}*", count=500):
            fields = await self._redis.hgetall(key)
            found[text(key).removeprefix(stats_key.prefix)] = _stats(fields)
        return found

    async def stats_history(self) -> dict[str, list[RolloutReplicaStats]]:
        """Time-ordered samples (each with `at`) of every rollout replica, by replica name."""
        found: dict[str, list[RolloutReplicaStats]] = {}
        async for key in self._redis.scan_iter(match=f"{stats_history_key.prefix}*", count=500):
            entries = await self._redis.xrange(key) or []
            found[text(key).removeprefix(stats_history_key.prefix)] = [
                _stats(fields or {}) for _, fields in entries
            ]
        return found

    async def put_runtime(
        self, service: str, replica: str, fields: Mapping[str, str], *, ttl_s: int
    ) -> None:
        """Publish what a replica computes on and in (common/runtime/hardware.py); it vanishes
        `ttl_s` after the replica stops refreshing it."""
        key = runtime_key(service, replica)
        values: dict[Any, Any] = dict(fields)  # redis-py's mapping types are invariant
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=values)
            pipe.expire(key, ttl_s)
            await pipe.execute()

    async def runtimes(self) -> dict[tuple[str, str], dict[str, str]]:
        """Every live replica's runtime fields, by (service, replica)."""
        found: dict[tuple[str, str], dict[str, str]] = {}
        async for key in self._redis.scan_iter(match=f"{runtime_key.prefix}*", count=500):
            service, _, replica = text(key).removeprefix(runtime_key.prefix).partition(":")
            found[service, replica] = texts(await self._redis.hgetall(key))
        return found

    async def served_environments(self) -> set[str] | None:
        """The environments the live env_svc replicas serve (their runtime records' union);
        None while no replica says (none is up, or none is new enough to say)."""
        served: set[str] | None = None
        async for key in self._redis.scan_iter(match=f"{runtime_key('env_svc', '')}*", count=500):
            names = await self._redis.hget(key, ENVIRONMENTS_FIELD)
            if names is not None:  # gone meanwhile, or a replica that does not say
                served = (served or set()) | {n for n in text(names).split(",") if n}
        return served

    async def count_restart(self, service: str) -> None:
        """One more restart of `service` by the embedded stack's supervisor."""
        await self._redis.hincrby(RESTARTS, service, 1)

    async def restarts(self) -> dict[str, int]:
        """Restarts per service since the stack's Redis was created (status shows them)."""
        return {text(k): int(v) for k, v in (await self._redis.hgetall(RESTARTS)).items()}


def _stats(fields: Mapping[Any, Any]) -> RolloutReplicaStats:
    return RolloutReplicaStats.of({text(k): float(v) for k, v in fields.items()})
