"""The Redis store: adapter pointers, the job registry, flow-control counters, de-dup sets.

Keys (who writes and reads each: docs/architecture.md, "Redis keys"):
- `adapter:{job}`   hash version, uri, step, updated_at — moved only forward (Lua CAS); its
                    version is the job's trained version (common/flow.py reads it)
- `job:{job}`       hash spec (wire-encoded JobSpec), tenant, status, reason, created_at,
                    updated_at, samples (its G x B x (S + 1), for its tenant's quota)
- `jobs`            set of every registered job id
- `rejected:{job}`  why a job was rejected (never registered), for a week
- tenants, API keys, job owners and each tenant's jobs: common/tenants.py
- `flow:{job}`      hash of the flow-control counters (common/flow.py)
- `claims:{job}`    hash of claimed group indices not yet fully sent (common/flow.py)
- `stack:restarts`  hash service -> restarts by the embedded stack's supervisor
- `fence:{job}`     the job's fencing epoch: incremented by each trainer taking it over
- `adapter-versions:{job}` hash version -> uri of every published version
- `ledger:{job}`    stream: the job's audit ledger (issued, sent, trained, dropped groups)
- `dedup:{scope}:{job}` set of ids already handled in that scope (e.g. trained groups)
- `stats:rollout:{replica}` hash of a rollout replica's numbers (RolloutReplicaStats), expiring;
  `stats-history:rollout:{replica}` the same numbers over time (a capped stream)
- `runtime:{service}:{replica}` hash of what a replica computes on and in (hardware,
  precision, why), expiring

Every read-modify-write is one Lua script, so concurrent replicas cannot interleave.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis import asyncio as aioredis
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.access import redacted
from common.backoff import connect_with_backoff
from common.evals import (
    CLAIM_EVAL,
    DONE,
    RECORD_EVAL,
    TAKE_STALE_EVALS,
    EvalTally,
    evals_key,
    record_args,
    resends_key,
    tally_keys,
)
from common.flow import (
    DROPPED_GROUPS,
    FAILED_IN_A_ROW,
    FINISH_CLAIM,
    ISSUED_GROUPS,
    RECORD_DROP,
    TAKE_STALE_CLAIMS,
    TRY_ISSUE_GROUP,
    DroppedGroup,
    FlowState,
    IssuedGroup,
    claims_key,
    flow_key,
    ledger_key,
)
from common.lifecycle import JOB_STATES, TERMINAL_STATES, JobState, RolloutReplicaStats
from common.messages import JobSpec, Topic
from common.tenants import (
    QuotaError,
    TenantLimits,
    TenantRegistry,
    count_problem,
    owner_key,
    rejection_key,
    samples_in_flight,
    tenant_jobs_key,
)
from common.wire import decode, encode

_RESTARTS = "stack:restarts"
REJECTION_TTL_S = 7 * 24 * 3600
TRAINED = "trained"
"""De-dup scope of the groups a published version trained."""
DROPPED = "dropped"
"""De-dup scope of the groups counted as dropped."""
_STATS = "stats:rollout:"
_RUNTIME = "runtime:"
_STATS_HISTORY = "stats-history:rollout:"
STATS_HISTORY_SAMPLES = 20_000
"""Samples kept per replica (one per 5 s report: over a day)."""
STATS_HISTORY_TTL_S = 7 * 24 * 3600
"""A stopped replica's history outlives it by a week, for reports of past runs."""


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

# KEYS[1] job key, KEYS[2] jobs set, KEYS[3] the tenant's jobs set; ARGV job_id, spec,
# tenant, status, now, the job's samples in flight, the tenant's max_concurrent_jobs and
# max_samples_in_flight (-1: unlimited), terminal statuses... -> {1 new / 0 known / -1 too many
# jobs / -2 too many samples, the tenant's live jobs, their samples in flight}. The quota is
# checked and the job registered in one step: two replicas accepting two jobs of one tenant
# at once cannot both take the last slot. (It reads the tenant's job keys without declaring
# them: one Redis, never a cluster.)
_REGISTER_JOB = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, 0, 0} end
local jobs, samples = 0, 0
for _, member in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local fields = redis.call('HMGET', 'job:' .. member, 'status', 'samples')
  local live = fields[1] ~= false
  for i = 9, #ARGV do
    if fields[1] == ARGV[i] then live = false end
  end
  if live then
    jobs = jobs + 1
    samples = samples + tonumber(fields[2] or '0')
  end
end
local max_jobs, max_samples = tonumber(ARGV[7]), tonumber(ARGV[8])
if max_jobs >= 0 and jobs + 1 > max_jobs then return {-1, jobs, samples} end
if max_samples >= 0 and samples + tonumber(ARGV[6]) > max_samples then
  return {-2, jobs, samples}
end
redis.call('HSET', KEYS[1], 'spec', ARGV[2], 'tenant', ARGV[3], 'status', ARGV[4],
           'reason', '', 'created_at', ARGV[5], 'updated_at', ARGV[5], 'samples', ARGV[6])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
return {1, jobs + 1, samples + tonumber(ARGV[6])}
"""

# KEYS[1] owner key; ARGV tenant -> the tenant the job id is bound to (this one if unbound)
_BIND_OWNER = """
local owner = redis.call('GET', KEYS[1])
if owner then return owner end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
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


class FencedError(RuntimeError):
    """A publish by a trainer that no longer owns the job: another replica took it over
    (a newer fencing epoch) after this one's partition moved or it stalled."""

    def __init__(self, job_id: str, epoch: int) -> None:
        super().__init__(f"job {job_id!r}: epoch {epoch} was fenced off by a newer owner")
        self.job_id = job_id
        self.epoch = epoch


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
    status: JobState
    reason: str
    created_at: float
    updated_at: float


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisStore:
    """Async access to MARLaaS' Redis state. Create with `await RedisStore.connect(url)`."""

    def __init__(self, client: aioredis.Redis, url: str) -> None:
        self.url = url
        self._redis = client
        self._set_adapter = client.register_script(_SET_ADAPTER)
        self._register_job = client.register_script(_REGISTER_JOB)
        self._bind_owner = client.register_script(_BIND_OWNER)
        self._set_status = client.register_script(_SET_STATUS)
        self._try_issue_group = client.register_script(TRY_ISSUE_GROUP)
        self._record_drop = client.register_script(RECORD_DROP)
        self._take_stale_claims = client.register_script(TAKE_STALE_CLAIMS)
        self._finish_claim = client.register_script(FINISH_CLAIM)
        self._claim_eval = client.register_script(CLAIM_EVAL)
        self._take_stale_evals = client.register_script(TAKE_STALE_EVALS)
        self._record_eval = client.register_script(RECORD_EVAL)

    @classmethod
    async def connect(cls, url: str, *, timeout_s: float = 60.0) -> RedisStore:
        """Connect, retrying with back-off while Redis does not answer."""

        async def attempt() -> aioredis.Redis:
            client = aioredis.Redis.from_url(url, socket_connect_timeout=2.0)
            try:
                await client.ping()
            except RedisAuthenticationError as exc:  # not a network blip: no use retrying
                await client.aclose()
                raise PermissionError(
                    f"Redis at {redacted(url)} refused the login: {exc}"
                ) from None
            except BaseException:
                await client.aclose()
                raise
            return client

        client = await connect_with_backoff(
            "Redis",
            redacted(url),
            attempt,
            timeout_s=timeout_s,
            retry_on=(RedisConnectionError, RedisTimeoutError, OSError),
        )
        return cls(client, url)

    @property
    def client(self) -> aioredis.Redis:
        """The Redis client itself, for what no method covers (tests, repairs)."""
        return self._redis

    @property
    def tenants(self) -> TenantRegistry:
        """Tenants, their limits and API keys (common/tenants.py)."""
        return TenantRegistry(self._redis)

    async def ping(self) -> None:
        """Raises when Redis does not answer (readiness probes)."""
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()

    # --- adapter pointers -----------------------------------------------------------

    async def publish_adapter(
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
                _adapter_key(job_id),
                _dedup_key(TRAINED, job_id),
                flow_key(job_id),
                _fence_key(job_id),
                _versions_key(job_id),
                ledger_key(job_id),
            ],
            args=[version, uri, step, time.time(), epoch, *trained_groups],
        )
        if int(moved) < 0:
            raise FencedError(job_id, epoch)
        return bool(moved)

    async def ledger(self, job_id: str) -> list[dict[str, str]]:
        """The job's audit ledger, oldest first: each entry's fields (kind, group, ...)."""
        entries = await self._redis.xrange(ledger_key(job_id)) or []
        return [{_text(k): _text(v) for k, v in (fields or {}).items()} for _, fields in entries]

    async def last_activity(self, job_id: str) -> float | None:
        """When the job's ledger last moved (a group issued, sent, trained or dropped), unix
        s; None before its first entry."""
        entries = await self._redis.xrevrange(ledger_key(job_id), count=1) or []
        if not entries or entries[0][0] is None:
            return None
        return int(_text(entries[0][0]).split("-")[0]) / 1000  # the entry id's milliseconds

    async def live_groups(self, job_id: str) -> list[str]:
        """Ids of the job's issued groups neither trained nor dropped, oldest first."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hget(flow_key(job_id), ISSUED_GROUPS)
            pipe.smembers(_dedup_key(TRAINED, job_id))
            pipe.smembers(_dedup_key(DROPPED, job_id))
            issued, trained, dropped = await pipe.execute()
        done = {_text(g) for g in trained | dropped}
        ids = (f"{job_id}/g{index}" for index in range(int(issued or 0)))
        return [group_id for group_id in ids if group_id not in done]

    async def dropped_among(self, job_id: str, group_ids: Sequence[str]) -> set[str]:
        """Those of `group_ids` counted as dropped (by any replica, at any time)."""
        if not group_ids:
            return set()
        found = await self._redis.smismember(_dedup_key(DROPPED, job_id), list(group_ids))
        return {group_id for group_id, hit in zip(group_ids, found, strict=True) if hit}

    async def published_uri(self, job_id: str, version: int) -> str | None:
        """Where version `version` of the job's adapter was published (None: never, or
        published before versions were recorded)."""
        uri = await self._redis.hget(_versions_key(job_id), str(version))
        return None if uri is None else _text(uri)

    async def take_over(self, job_id: str) -> int:
        """A new fencing epoch for a trainer taking the job on; every older one is fenced."""
        return int(await self._redis.incr(_fence_key(job_id)))

    async def adapter(self, job_id: str) -> AdapterPointer | None:
        fields = await self._redis.hgetall(_adapter_key(job_id))
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

    async def register_job(
        self,
        spec: JobSpec,
        status: JobState = "pending",
        *,
        limits: TenantLimits | None = None,
    ) -> bool:
        """Record a job once; returns False when the id was already registered.

        With `limits`, raises QuotaError (naming the limit) instead of registering a job that
        would take its tenant past `max_concurrent_jobs` or `max_samples_in_flight`."""
        code, jobs, samples = await self._register_job(
            keys=[f"job:{spec.job_id}", "jobs", tenant_jobs_key(spec.tenant)],
            args=[
                spec.job_id,
                encode(spec),
                spec.tenant,
                status,
                time.time(),
                samples_in_flight(spec),
                limits.max_concurrent_jobs if limits else -1,
                limits.max_samples_in_flight if limits else -1,
                *sorted(TERMINAL_STATES),
            ],
        )
        if code < 0 and limits is not None:
            raise QuotaError(count_problem(spec, limits, jobs, samples) or f"quota: code {code}")
        return bool(code)

    async def bind_owner(self, job_id: str, tenant: str) -> str:
        """Bind the job id to `tenant` unless it is bound already; returns its tenant."""
        return _text(await self._bind_owner(keys=[owner_key(job_id)], args=[tenant]))

    async def owner(self, job_id: str) -> str | None:
        """The tenant the job id is bound to (None: not bound yet)."""
        owner = await self._redis.get(owner_key(job_id))
        return None if owner is None else _text(owner)

    async def record_rejection(self, job_id: str, reason: str) -> None:
        """Why a job was rejected (it is never registered), kept a week for its sender."""
        await self._redis.set(rejection_key(job_id), reason, ex=REJECTION_TTL_S)

    async def rejection(self, job_id: str) -> str | None:
        reason = await self._redis.get(rejection_key(job_id))
        return None if reason is None else _text(reason)

    async def tenant_job_ids(self, tenant: str) -> list[str]:
        return sorted(_text(m) for m in await self._redis.smembers(tenant_jobs_key(tenant)))

    async def job(self, job_id: str) -> JobRecord | None:
        fields = {_text(k): v for k, v in (await self._redis.hgetall(f"job:{job_id}")).items()}
        if not fields:
            return None
        return JobRecord(
            spec=_stored_spec(fields["spec"]),
            status=_status(fields["status"]),
            reason=_text(fields["reason"]),
            created_at=float(fields["created_at"]),
            updated_at=float(fields["updated_at"]),
        )

    async def job_ids(self) -> list[str]:
        return sorted(_text(member) for member in await self._redis.smembers("jobs"))

    async def set_job_status(self, job_id: str, status: JobState, reason: str = "") -> bool:
        """Move a job to `status`; a job in a terminal status stays there (returns False).

        Raises UnknownJobError for a job that was never registered.
        """
        changed, current = await self._set_status(
            keys=[f"job:{job_id}"], args=[status, reason, time.time(), *sorted(TERMINAL_STATES)]
        )
        if not current:
            raise UnknownJobError(job_id)
        return bool(changed)

    # --- flow control ---------------------------------------------------------------

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
        self, job_id: str, group_id: str, *, invalid: bool, kind: str = "dropped"
    ) -> DroppedGroup:
        """Count a group out of the job's window (it is replaced), once per group id; an
        `invalid` one (no usable rewards) also extends the job's run of failed groups."""
        counted, dropped, failed = await self._record_drop(
            keys=[
                flow_key(job_id),
                _dedup_key(DROPPED, job_id),
                ledger_key(job_id),
                _dedup_key(TRAINED, job_id),
            ],
            args=[group_id, int(invalid), kind],
        )
        return DroppedGroup(bool(counted), int(dropped), int(failed))

    async def flow(self, job_id: str) -> FlowState:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(flow_key(job_id))
            pipe.hget(_adapter_key(job_id), "version")
            counters, version = await pipe.execute()
        values = {_text(k): int(v) for k, v in counters.items()}
        return FlowState(
            issued_groups=values.get(ISSUED_GROUPS, 0),
            dropped_groups=values.get(DROPPED_GROUPS, 0),
            trained_version=int(version or 0),
            failed_in_a_row=values.get(FAILED_IN_A_ROW, 0),
        )

    # --- rollout replica stats -----------------------------------------------------

    async def put_replica_stats(
        self, replica: str, stats: RolloutReplicaStats, *, ttl_s: int
    ) -> None:
        """Publish a rollout replica's numbers; they vanish if it stops reporting.

        Each call also appends a timestamped sample to the replica's history (a capped Redis
        stream) for reports of utilisation and throughput over time.
        """
        key = f"{_STATS}{replica}"
        # redis-py's mapping types are invariant; every value here is a float.
        numbers: dict[Any, Any] = stats.as_map()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=numbers)
            pipe.expire(key, ttl_s)
            pipe.xadd(
                f"{_STATS_HISTORY}{replica}",
                {**numbers, "at": time.time()},
                maxlen=STATS_HISTORY_SAMPLES,
                approximate=True,
            )
            pipe.expire(f"{_STATS_HISTORY}{replica}", STATS_HISTORY_TTL_S)
            await pipe.execute()

    async def replica_stats(self) -> dict[str, RolloutReplicaStats]:
        """The numbers of every live rollout replica, by replica name."""
        found: dict[str, RolloutReplicaStats] = {}
        async for key in self._redis.scan_iter(match=f"{_STATS}*", count=500):
            fields = await self._redis.hgetall(key)
            found[_text(key).removeprefix(_STATS)] = RolloutReplicaStats.of(_numbers(fields))
        return found

    async def replica_stats_history(self) -> dict[str, list[RolloutReplicaStats]]:
        """Time-ordered samples (each with `at`) of every rollout replica, by replica name."""
        found: dict[str, list[RolloutReplicaStats]] = {}
        async for key in self._redis.scan_iter(match=f"{_STATS_HISTORY}*", count=500):
            entries = await self._redis.xrange(key) or []
            found[_text(key).removeprefix(_STATS_HISTORY)] = [
                RolloutReplicaStats.of(_numbers(fields or {})) for _, fields in entries
            ]
        return found

    # --- what each replica runs on ---------------------------------------------------

    async def put_runtime(
        self, service: str, replica: str, fields: Mapping[str, str], *, ttl_s: int
    ) -> None:
        """Publish what a replica computes on and in (common/hardware.py); it vanishes
        `ttl_s` after the replica stops refreshing it."""
        key = f"{_RUNTIME}{service}:{replica}"
        values: dict[Any, Any] = dict(fields)  # redis-py's mapping types are invariant
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=values)
            pipe.expire(key, ttl_s)
            await pipe.execute()

    async def runtimes(self) -> dict[tuple[str, str], dict[str, str]]:
        """Every live replica's runtime fields, by (service, replica)."""
        found: dict[tuple[str, str], dict[str, str]] = {}
        async for key in self._redis.scan_iter(match=f"{_RUNTIME}*", count=500):
            service, _, replica = _text(key).removeprefix(_RUNTIME).partition(":")
            fields = await self._redis.hgetall(key)
            found[service, replica] = {_text(k): _text(v) for k, v in fields.items()}
        return found

    # --- the embedded stack --------------------------------------------------------

    async def count_restart(self, service: str) -> None:
        """One more restart of `service` by the embedded stack's supervisor."""
        await self._redis.hincrby(_RESTARTS, service, 1)

    async def restarts(self) -> dict[str, int]:
        """Restarts per service since the stack's Redis was created (status shows them)."""
        return {_text(k): int(v) for k, v in (await self._redis.hgetall(_RESTARTS)).items()}

    # --- evaluations (common/evals.py) ----------------------------------------------

    async def claim_eval(self, job_id: str, version: int) -> bool:
        """True for the one caller that sends the evaluation of `version`."""
        return bool(await self._claim_eval(keys=[evals_key(job_id)], args=[version, time.time()]))

    async def take_stale_evals(self, job_id: str, older_than_s: float) -> list[int]:
        """Evaluations sent more than `older_than_s` ago and not done, each handed to one
        caller per `older_than_s`: the caller finishes it or sends its requests again."""
        now = time.time()
        taken = await self._take_stale_evals(
            keys=[evals_key(job_id)], args=[now - older_than_s, now]
        )
        return [int(version) for version in taken]

    async def record_eval(
        self,
        job_id: str,
        version: int,
        episode_id: str,
        *,
        reward: float,
        solved: bool,
        components: Mapping[str, float],
    ) -> int:
        """Count one finished evaluation episode; returns the episodes counted so far, or -1
        when this one was counted before."""
        return int(
            await self._record_eval(
                keys=tally_keys(job_id, version),
                args=record_args(episode_id, reward, solved, dict(components)),
            )
        )

    async def eval_tally(self, job_id: str, version: int) -> EvalTally:
        return EvalTally.from_hash(
            version, await self._redis.hgetall(tally_keys(job_id, version)[1])
        )

    async def count_eval_resend(self, job_id: str, version: int) -> int:
        """One more re-send of the evaluation of `version`; returns how many so far."""
        return int(await self._redis.hincrby(resends_key(job_id), str(version), 1))

    async def finish_eval(self, job_id: str, version: int) -> None:
        """Its `eval` event is out: the sweeper leaves it alone."""
        await self._redis.hset(evals_key(job_id), str(version), DONE)

    async def evals(self, job_id: str) -> dict[int, str]:
        """Evaluated versions: when their requests were last sent, or `done`."""
        raw = await self._redis.hgetall(evals_key(job_id))
        return {int(_text(k)): _text(v) for k, v in raw.items()}

    # --- de-duplication -------------------------------------------------------------

    async def mark_seen(self, scope: str, job_id: str, item_id: str) -> bool:
        """Record `item_id` as handled; True the first time, False for a duplicate."""
        return bool(await self._redis.sadd(_dedup_key(scope, job_id), item_id))

    async def seen(self, scope: str, job_id: str, item_id: str) -> bool:
        return bool(await self._redis.sismember(_dedup_key(scope, job_id), item_id))

    async def forget_seen(self, scope: str, job_id: str, item_id: str) -> None:
        """Undo `mark_seen` when the work it guarded failed before becoming durable."""
        await self._redis.srem(_dedup_key(scope, job_id), item_id)


def _numbers(fields: Mapping[Any, Any]) -> dict[str, float]:
    return {_text(k): float(v) for k, v in fields.items()}


def _versions_key(job_id: str) -> str:
    return f"adapter-versions:{job_id}"


def _fence_key(job_id: str) -> str:
    return f"fence:{job_id}"


def _dedup_key(scope: str, job_id: str) -> str:
    return f"dedup:{scope}:{job_id}"


def _adapter_key(job_id: str) -> str:
    return f"adapter:{job_id}"


def _pointer(job_id: str, fields: Mapping[Any, Any]) -> AdapterPointer:
    values = {_text(k): _text(v) for k, v in fields.items()}
    return AdapterPointer(
        job_id=job_id,
        version=int(values["version"]),
        uri=values["uri"],
        step=int(values["step"]),
        updated_at=float(values["updated_at"]),
    )


def _status(raw: bytes | str) -> JobState:
    status = _text(raw)
    if status not in JOB_STATES:
        raise ValueError(f"corrupt job status {status!r}")
    return status  # type: ignore[return-value]


def _stored_spec(raw: bytes | str) -> JobSpec:
    """A registered spec, in any wire schema a build of this deployment wrote."""
    spec = decode(Topic.JOBS, raw.encode() if isinstance(raw, str) else raw)
    if not isinstance(spec, JobSpec):
        raise TypeError(f"a job record holds a {type(spec).__name__}, not a JobSpec")
    return spec
