"""The Redis store: adapter pointers, the job registry, flow-control counters, de-dup sets.

Keys (docs/architecture.md, "Redis keys"):
- `adapter:{job}`   hash version, uri, step, updated_at — moved only forward (Lua CAS)
- `job:{job}`       hash spec (msgpack JobSpec), tenant, status, reason, created_at, updated_at
- `jobs`            set of every registered job id
- `flow:{job}`      hash of integer counters (issued_groups, trained_version, ...)
- `dedup:{scope}:{job}` set of ids already handled in that scope (e.g. trained groups)
- `stats:{service}:{replica}` hash of a replica's numbers (utilisation), expiring

Every read-modify-write is one Lua script, so concurrent replicas cannot interleave.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import msgspec
from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.backoff import connect_with_backoff
from common.messages import JobSpec

JobStatus = Literal["pending", "running", "paused", "completed", "failed", "cancelled", "rejected"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled", "rejected"})

ISSUED_GROUPS = "issued_groups"
DROPPED_GROUPS = "dropped_groups"
TRAINED_VERSION = "trained_version"

STATS_HISTORY_SAMPLES = 20_000
"""Samples kept per replica (one per 5 s report: over a day)."""
STATS_HISTORY_TTL_S = 7 * 24 * 3600
"""A stopped replica's history outlives it by a week, for reports of past runs."""


def issue_limit(trained_version: int, max_staleness: int, groups_per_step: int) -> int:
    """How many live groups a job may have issued: `(trained_version + S + 1) * B`.

    Live = issued minus dropped as stale. With S = 0 generation never runs ahead of
    training (synchronous on-policy); each AdapterUpdate raises the limit by B.
    `_TRY_ISSUE_GROUP` applies the same rule.
    """
    return (trained_version + max_staleness + 1) * groups_per_step


# KEYS[1] adapter key; ARGV version, uri, step, updated_at -> {moved 0/1, version now stored}
_SET_ADAPTER = """
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
local proposed = tonumber(ARGV[1])
if proposed <= current then return {0, current} end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'uri', ARGV[2], 'step', ARGV[3],
           'updated_at', ARGV[4])
return {1, proposed}
"""

# KEYS[1] job key, KEYS[2] jobs set; ARGV job_id, spec, tenant, status, now -> 1 new / 0 known
_REGISTER_JOB = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'spec', ARGV[2], 'tenant', ARGV[3], 'status', ARGV[4],
           'reason', '', 'created_at', ARGV[5], 'updated_at', ARGV[5])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS[1] job key; ARGV status, reason, now, terminal statuses... -> {changed 0/1, status now}
_SET_STATUS = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return {0, ''} end
for i = 4, #ARGV do
  if current == ARGV[i] then return {0, current} end
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'reason', ARGV[2], 'updated_at', ARGV[3])
return {1, ARGV[1]}
"""

# KEYS[1] flow key; ARGV max_staleness, groups_per_step, max_groups -> issued index, or -1.
# Groups the trainer dropped as stale do not count against the bound: they are replaced.
_TRY_ISSUE_GROUP = """
local issued = tonumber(redis.call('HGET', KEYS[1], 'issued_groups') or '0')
local dropped = tonumber(redis.call('HGET', KEYS[1], 'dropped_groups') or '0')
local trained = tonumber(redis.call('HGET', KEYS[1], 'trained_version') or '0')
local limit = (trained + tonumber(ARGV[1]) + 1) * tonumber(ARGV[2])
if issued - dropped >= limit or issued - dropped >= tonumber(ARGV[3]) then return -1 end
redis.call('HSET', KEYS[1], 'issued_groups', issued + 1)
return issued
"""

# KEYS[1] hash; ARGV field, value -> the field's value after max(current, value)
_MAX_FIELD = """
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local proposed = tonumber(ARGV[2])
if proposed > current then
  redis.call('HSET', KEYS[1], ARGV[1], proposed)
  return proposed
end
return current
"""


class UnknownJobError(KeyError):
    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id

    def __str__(self) -> str:
        return f"unknown job {self.job_id!r}"


@dataclass(frozen=True)
class AdapterPointer:
    job_id: str
    version: int
    uri: str
    step: int
    updated_at: float


@dataclass(frozen=True)
class JobRecord:
    spec: JobSpec
    status: JobStatus
    reason: str
    created_at: float
    updated_at: float


_spec_decoder = msgspec.msgpack.Decoder(JobSpec)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisStore:
    """Async access to MARLaaS' Redis state. Create with `await RedisStore.connect(url)`."""

    def __init__(self, client: aioredis.Redis, url: str) -> None:
        self.url = url
        self._redis = client
        self._set_adapter = client.register_script(_SET_ADAPTER)
        self._register_job = client.register_script(_REGISTER_JOB)
        self._set_status = client.register_script(_SET_STATUS)
        self._try_issue_group = client.register_script(_TRY_ISSUE_GROUP)
        self._max_field = client.register_script(_MAX_FIELD)

    @classmethod
    async def connect(cls, url: str, *, timeout_s: float = 60.0) -> RedisStore:
        """Connect, retrying with back-off while Redis does not answer."""

        async def attempt() -> aioredis.Redis:
            client = aioredis.Redis.from_url(url, socket_connect_timeout=2.0)
            try:
                await client.ping()
            except BaseException:
                await client.aclose()
                raise
            return client

        client = await connect_with_backoff(
            "Redis",
            url,
            attempt,
            timeout_s=timeout_s,
            retry_on=(RedisConnectionError, RedisTimeoutError, OSError),
        )
        return cls(client, url)

    async def ping(self) -> None:
        """Raises when Redis does not answer (readiness probes)."""
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()

    # --- adapter pointers -----------------------------------------------------------

    async def publish_adapter(self, job_id: str, version: int, uri: str, step: int) -> bool:
        """Point `adapter:{job}` at `version` unless it already holds that or a newer one.

        Returns whether the pointer moved; an older writer never overwrites a newer version.
        """
        moved, _ = await self._set_adapter(
            keys=[f"adapter:{job_id}"], args=[version, uri, step, time.time()]
        )
        return bool(moved)

    async def adapter(self, job_id: str) -> AdapterPointer | None:
        fields = await self._redis.hgetall(f"adapter:{job_id}")
        return _pointer(job_id, fields) if fields else None

    async def adapters(self) -> dict[str, AdapterPointer]:
        """Every job's adapter pointer (rollout replicas read this at start-up)."""
        pointers: dict[str, AdapterPointer] = {}
        async for key in self._redis.scan_iter(match="adapter:*", count=500):
            job_id = _text(key).removeprefix("adapter:")
            if fields := await self._redis.hgetall(key):
                pointers[job_id] = _pointer(job_id, fields)
        return pointers

    # --- job registry ---------------------------------------------------------------

    async def register_job(self, spec: JobSpec, status: JobStatus = "pending") -> bool:
        """Record a job once; returns False when the id was already registered."""
        created = await self._register_job(
            keys=[f"job:{spec.job_id}", "jobs"],
            args=[spec.job_id, msgspec.msgpack.encode(spec), spec.tenant, status, time.time()],
        )
        return bool(created)

    async def job(self, job_id: str) -> JobRecord | None:
        fields = {_text(k): v for k, v in (await self._redis.hgetall(f"job:{job_id}")).items()}
        if not fields:
            return None
        return JobRecord(
            spec=_spec_decoder.decode(fields["spec"]),  # type: ignore[arg-type]
            status=_status(fields["status"]),
            reason=_text(fields["reason"]),
            created_at=float(fields["created_at"]),
            updated_at=float(fields["updated_at"]),
        )

    async def job_ids(self) -> list[str]:
        return sorted(_text(member) for member in await self._redis.smembers("jobs"))

    async def set_job_status(self, job_id: str, status: JobStatus, reason: str = "") -> bool:
        """Move a job to `status`; a job in a terminal status stays there (returns False).

        Raises UnknownJobError for a job that was never registered.
        """
        changed, current = await self._set_status(
            keys=[f"job:{job_id}"], args=[status, reason, time.time(), *sorted(TERMINAL_STATUSES)]
        )
        if not current:
            raise UnknownJobError(job_id)
        return bool(changed)

    # --- flow control ---------------------------------------------------------------

    async def try_issue_group(
        self, job_id: str, *, max_staleness: int, groups_per_step: int, max_groups: int
    ) -> int | None:
        """Claim the next group index if the staleness bound allows it, else None.

        `max_groups` caps the live groups of the whole job (max_steps * B: more is waste).
        """
        index = int(
            await self._try_issue_group(
                keys=[f"flow:{job_id}"], args=[max_staleness, groups_per_step, max_groups]
            )
        )
        return None if index < 0 else index

    async def advance_trained_version(self, job_id: str, version: int) -> int:
        """Raise the job's trained version to `version` (never lowers it); returns the new value."""
        return int(await self._max_field(keys=[f"flow:{job_id}"], args=[TRAINED_VERSION, version]))

    async def incr_counter(self, job_id: str, name: str, by: int = 1) -> int:
        return int(await self._redis.hincrby(f"flow:{job_id}", name, by))

    async def counters(self, job_id: str) -> dict[str, int]:
        fields = await self._redis.hgetall(f"flow:{job_id}")
        return {_text(k): int(v) for k, v in fields.items()}

    # --- service stats --------------------------------------------------------------

    async def put_stats(self, name: str, stats: dict[str, float], *, ttl_s: int) -> None:
        """Publish a replica's numbers under `stats:{name}`; they vanish if it stops reporting.

        Each call also appends a timestamped sample to `stats-history:{name}` (a capped Redis
        stream) for reports of utilisation and throughput over time.
        """
        key = f"stats:{name}"
        sample = {**stats, "at": time.time()}
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=dict(stats))  # type: ignore[arg-type]
            pipe.expire(key, ttl_s)
            pipe.xadd(
                f"stats-history:{name}", sample,  # type: ignore[arg-type]
                maxlen=STATS_HISTORY_SAMPLES, approximate=True,
            )  # fmt: skip
            pipe.expire(f"stats-history:{name}", STATS_HISTORY_TTL_S)
            await pipe.execute()

    async def stats(self, prefix: str) -> dict[str, dict[str, float]]:
        """Numbers of every live replica whose name starts with `prefix` (e.g. `rollout:`)."""
        found: dict[str, dict[str, float]] = {}
        async for key in self._redis.scan_iter(match=f"stats:{prefix}*", count=500):
            fields = await self._redis.hgetall(key)
            found[_text(key).removeprefix("stats:")] = {
                _text(k): float(v) for k, v in fields.items()
            }
        return found

    async def stats_history(self, prefix: str) -> dict[str, list[dict[str, float]]]:
        """Time-ordered samples (each with `at`) of each replica whose name starts with `prefix`."""
        found: dict[str, list[dict[str, float]]] = {}
        async for key in self._redis.scan_iter(match=f"stats-history:{prefix}*", count=500):
            entries = await self._redis.xrange(key) or []
            found[_text(key).removeprefix("stats-history:")] = [
                {_text(k): float(v) for k, v in (fields or {}).items()} for _, fields in entries
            ]
        return found

    # --- de-duplication -------------------------------------------------------------

    async def mark_seen(self, scope: str, job_id: str, item_id: str) -> bool:
        """Record `item_id` as handled; True the first time, False for a duplicate."""
        return bool(await self._redis.sadd(f"dedup:{scope}:{job_id}", item_id))

    async def seen(self, scope: str, job_id: str, item_id: str) -> bool:
        return bool(await self._redis.sismember(f"dedup:{scope}:{job_id}", item_id))

    async def forget_seen(self, scope: str, job_id: str, item_id: str) -> None:
        """Undo `mark_seen` when the work it guarded failed before becoming durable."""
        await self._redis.srem(f"dedup:{scope}:{job_id}", item_id)


def _pointer(job_id: str, fields: Mapping[Any, Any]) -> AdapterPointer:
    values = {_text(k): _text(v) for k, v in fields.items()}
    return AdapterPointer(
        job_id=job_id,
        version=int(values["version"]),
        uri=values["uri"],
        step=int(values["step"]),
        updated_at=float(values["updated_at"]),
    )


def _status(raw: bytes | str) -> JobStatus:
    status = _text(raw)
    if status not in get_args(JobStatus):
        raise ValueError(f"corrupt job status {status!r}")
    return status  # type: ignore[return-value]
