"""The job registry: each job's record (spec, tenant, status), the set of all jobs, why a
job was rejected, job-id owners, and the tenant's count limits checked where jobs register.
Records are read through the jobs this process knows (`admitted`): a spec is decoded once per
process.

The count limits (a tenant's live jobs and their samples in flight) are one rule, in Lua:
`_QUOTA_RULE` is part of the script that registers a job (checked and registered in one step,
so two replicas accepting two jobs of one tenant cannot both take the last slot) and of the
read-only script the tenant API asks before it accepts a job for the bus.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.state.admitted import RECORD_FIELDS, AdmittedJobs, JobRecord
from common.state.keyspace import (
    ACTIVE_JOBS,
    ACTIVE_SINCE,
    JOBS,
    UNKEPT_JOBS,
    job_key,
    owner_key,
    rejection_key,
    tenant_jobs_key,
    tenant_load_key,
)
from common.state.redis_part import Lua, RedisPart, text
from common.state.tenants import QuotaError, TenantLimits, quota_problem, samples_in_flight
from common.wire.codec import encode
from common.wire.jobspec import AdmittedJob
from common.wire.lifecycle import TERMINAL_STATES, JobState
from common.wire.messages import JobSpec, clipped

if TYPE_CHECKING:
    from redis import asyncio as aioredis

REJECTION_TTL_S = 7 * 24 * 3600
ENDED_TTL_S = 7 * 24 * 3600
"""How long an ended job's working state (ledger, de-dup sets, claims, tallies) outlives
it: audits and late redeliveries within a week still find it; then it goes. The job's
record and its adapter pointers stay (exports)."""

# quota(the tenant's load key, the job's samples in flight, max_concurrent_jobs,
# max_samples_in_flight (-1: unlimited)) -> code (1 fits / -1 too many jobs / -2 too many
# samples), the tenant's live jobs, their samples in flight: from its counters, whatever
# number of jobs it ever had.
_QUOTA_RULE = """
local function quota(load, samples, max_jobs, max_samples)
  local counted = redis.call('HMGET', load, 'jobs', 'samples')
  local jobs, busy = tonumber(counted[1] or '0'), tonumber(counted[2] or '0')
  if max_jobs >= 0 and jobs + 1 > max_jobs then return -1, jobs, busy end
  if max_samples >= 0 and busy + samples > max_samples then return -2, jobs, busy end
  return 1, jobs, busy
end
"""

# KEYS[1] job key, KEYS[2] jobs set, KEYS[3] the tenant's jobs set, KEYS[4] the tenant's load,
# KEYS[5] active jobs, KEYS[6] the id's owner binding; ARGV job_id, spec, tenant, status, now,
# the job's samples in flight, max_concurrent_jobs, max_samples_in_flight, terminal
# statuses... -> {1 new / 0 known / -1 too many jobs / -2 too many samples, the tenant's live
# jobs, their samples in flight}.
_REGISTER_JOB = (
    _QUOTA_RULE
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, 0, 0} end
local code, jobs, busy = quota(KEYS[4], tonumber(ARGV[6]), tonumber(ARGV[7]),
                               tonumber(ARGV[8]))
if code < 0 then return {code, jobs, busy} end
redis.call('HSET', KEYS[1], 'spec', ARGV[2], 'tenant', ARGV[3], 'status', ARGV[4],
           'reason', '', 'created_at', ARGV[5], 'updated_at', ARGV[5], 'samples', ARGV[6])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
redis.call('PERSIST', KEYS[6])  -- a registered job's id is its tenant's for good
for i = 9, #ARGV do
  if ARGV[4] == ARGV[i] then return {1, jobs, busy} end  -- registered ended: no load
end
redis.call('HINCRBY', KEYS[4], 'jobs', 1)
redis.call('HINCRBY', KEYS[4], 'samples', ARGV[6])
return {1, jobs + 1, busy + tonumber(ARGV[6])}
"""
)

# No KEYS (a declared key needs write access under ACLs, and the API only reads it); ARGV the
# tenant's load key, the job's samples in flight, max_concurrent_jobs, max_samples_in_flight
# -> {code, live jobs, their samples in flight}
_CHECK_QUOTA = (
    _QUOTA_RULE
    + """
local code, jobs, busy = quota(ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
                               tonumber(ARGV[4]))
return {code, jobs, busy}
"""
)

# KEYS[1] rejection key, KEYS[2] owner key, KEYS[3] job key; ARGV reason, ttl. The binding
# ends with the rejection's record only while no job is registered under the id: a spec
# rejected under a running job's id must not lock its tenant out of it a week later.
_RECORD_REJECTION = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
if redis.call('EXISTS', KEYS[3]) == 0 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
"""

# KEYS[1] owner key; ARGV tenant ('' binds nothing), the job key (read, undeclared) -> {the
# tenant the id is bound to ('' unbound), 1 if bound by this call, the record's
# RECORD_FIELDS (nil: no record)}
_RECORD_FIELDS = ", ".join(f"'{field}'" for field in RECORD_FIELDS)
_CLAIM_ID = f"""
local owner, bound = redis.call('GET', KEYS[1]), 0
if not owner and ARGV[1] ~= '' then
  redis.call('SET', KEYS[1], ARGV[1])
  owner, bound = ARGV[1], 1
end
local record = redis.call('HMGET', ARGV[2], {_RECORD_FIELDS})
return {{owner or '', bound, record[1], record[2], record[3], record[4]}}
"""

# KEYS[1] job key; ARGV status, reason, now, terminal statuses... -> {changed 0/1, status
# now}. The move to a terminal status takes the job out of its tenant's load (a key named
# from the record, undeclared: one Redis, never a cluster).
_SET_STATUS = f"""
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return {{0, ''}} end
local ends = false
for i = 4, #ARGV do
  if current == ARGV[i] then return {{0, current}} end
  if ARGV[1] == ARGV[i] then ends = true end
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'reason', ARGV[2], 'updated_at', ARGV[3])
if ends then
  local job = redis.call('HMGET', KEYS[1], 'tenant', 'samples')
  local load = '{tenant_load_key.prefix}' .. job[1]
  redis.call('HINCRBY', load, 'jobs', -1)
  redis.call('HINCRBY', load, 'samples', -tonumber(job[2] or '0'))
end
return {{1, ARGV[1]}}
"""

# KEYS[1] jobs, KEYS[2] active jobs, KEYS[3] the marker; ARGV terminal statuses -> jobs
# taken in, or -1 when done before. Once per deployment, for a Redis from before the active
# set and the tenants' counters: every job is active (the sweep retires the ended), and
# each tenant's load counts its jobs not ended.
_BACKFILL_ACTIVE = f"""
if not redis.call('SET', KEYS[3], '1', 'NX') then return -1 end
local members = redis.call('SMEMBERS', KEYS[1])
for _, member in ipairs(members) do
  redis.call('SADD', KEYS[2], member)
  local job = redis.call('HMGET', '{job_key.prefix}' .. member, 'status', 'tenant', 'samples')
  local live = job[1] ~= false
  for i = 1, #ARGV do
    if job[1] == ARGV[i] then live = false end
  end
  if live then
    local load = '{tenant_load_key.prefix}' .. job[2]
    redis.call('HINCRBY', load, 'jobs', 1)
    redis.call('HINCRBY', load, 'samples', tonumber(job[3] or '0'))
  end
end
return #members
"""

_TERMINAL = sorted(TERMINAL_STATES)


class UnknownJobError(KeyError):
    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id

    def __str__(self) -> str:
        return f"unknown job {self.job_id!r}"


@dataclass(frozen=True)
class IdClaim:
    """Who a job id is bound to, and the job registered under it."""

    owner: str | None
    """The tenant the id is bound to (None: unbound)."""
    bound_now: bool
    """Whether this claim bound it."""
    record: JobRecord | None
    """The job registered under the id (None: none)."""


Job = str | JobRecord
"""A job named by its id, or its record already read (so that nobody reads it again)."""


def job_id_of(job: Job) -> str:
    return job.spec.job_id if isinstance(job, JobRecord) else job


class JobRegistry(RedisPart):
    _register_job = Lua(_REGISTER_JOB)
    _check_quota = Lua(_CHECK_QUOTA)
    _claim_id = Lua(_CLAIM_ID)
    _record_rejection = Lua(_RECORD_REJECTION)
    _set_status = Lua(_SET_STATUS)
    _backfill_active = Lua(_BACKFILL_ACTIVE)

    def __init__(self, client: aioredis.Redis, admitted: AdmittedJobs | None = None) -> None:
        super().__init__(client)
        self.admitted = admitted or AdmittedJobs(client)
        """The registered jobs this process has read, each decoded once."""

    async def register(
        self,
        job: AdmittedJob | JobSpec,
        status: JobState = "pending",
        *,
        limits: TenantLimits | None = None,
    ) -> bool:
        """Record an admitted job once (a bare spec, as tests and repairs register, as it
        stands); returns False when the id was already registered.

        With `limits`, raises QuotaError (naming the limit) instead of registering a job that
        would take its tenant past `max_concurrent_jobs` or `max_samples_in_flight`."""
        if isinstance(job, JobSpec):
            job = AdmittedJob(job, created_at=time.time())
        spec = job.spec
        code, jobs, busy = await self._register_job(
            keys=[
                job_key(spec.job_id),
                JOBS,
                tenant_jobs_key(spec.tenant),
                tenant_load_key(spec.tenant),
                ACTIVE_JOBS,
                owner_key(spec.job_id),
            ],
            args=[
                spec.job_id,
                encode(spec),
                spec.tenant,
                status,
                job.created_at,
                *_quota_args(spec, limits),
                *_TERMINAL,
            ],
        )
        _raise_over_quota(int(code), spec, limits, int(jobs), int(busy))
        if int(code) == 1:
            self.admitted.keep(job)
        return bool(code)

    async def check_quota(self, spec: JobSpec, limits: TenantLimits) -> None:
        """Raises QuotaError when registering the job now would take its tenant past a count
        limit (the tenant API asks before it puts a job on the bus; registering checks
        again, atomically)."""
        code, jobs, busy = await self._check_quota(
            keys=[], args=[tenant_load_key(spec.tenant), *_quota_args(spec, limits)]
        )
        _raise_over_quota(int(code), spec, limits, int(jobs), int(busy))

    async def expire_after_end(self, keys: Sequence[str]) -> None:
        """An ended job's working state, the `keys` this caller owns, goes `ENDED_TTL_S`
        from now (each service expires its own: Redis users, common/security/access.py)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.expire(key, ENDED_TTL_S)
            await pipe.execute()

    async def put_audit_summary(self, job_id: str, summary: Mapping[str, object]) -> None:
        """An ended job's audit (`common/state/audit.py`), kept in its record for when its ledger
        has expired (`ENDED_TTL_S`)."""
        await self._redis.hset(job_key(job_id), "audit", json.dumps(summary))

    async def audit_summary(self, job_id: str) -> dict[str, Any] | None:
        raw = await self._redis.hget(job_key(job_id), "audit")
        return None if raw is None else dict(json.loads(raw))

    async def claim_id(self, job_id: str, tenant: str | None) -> IdClaim:
        """Bind the job id to `tenant` unless it is bound already (None: bind nothing), and
        say who it is bound to and which job is registered under it: one round trip while
        that job is known here."""
        owner, bound, *fields = await self._claim_id(
            keys=[owner_key(job_id)], args=[tenant or "", job_key(job_id)]
        )
        return IdClaim(
            owner=text(owner) or None,
            bound_now=bool(bound),
            record=await self.admitted.record_of(job_id, fields),
        )

    async def record_rejection(self, job_id: str, reason: str) -> None:
        """Why a job was rejected (it is never registered), kept a week for its sender; the
        id's binding to its tenant ends with it (a rejected job leaves no key forever), unless
        a job is registered under the id."""
        await self._record_rejection(
            keys=[rejection_key(job_id), owner_key(job_id), job_key(job_id)],
            args=[clipped(reason), REJECTION_TTL_S],
        )

    async def rejection(self, job_id: str) -> str | None:
        reason = await self._redis.get(rejection_key(job_id))
        return None if reason is None else text(reason)

    async def of_tenant(self, tenant: str) -> list[str]:
        return sorted(text(m) for m in await self._redis.smembers(tenant_jobs_key(tenant)))

    async def get(self, job_id: str) -> JobRecord | None:
        """The job's record: its status read, its spec decoded once per process."""
        return await self.admitted.get(job_id)

    async def statuses(self, job_ids: Collection[str]) -> dict[str, str | None]:
        """Each job's status alone, in one round trip (None: no record): for a hot path
        that has the spec at hand (`AdmittedJobs.statuses`)."""
        return await self.admitted.statuses(job_ids)

    async def ids(self) -> list[str]:
        """Every job ever registered (listings: the status board, reports)."""
        return sorted(text(member) for member in await self._redis.smembers(JOBS))

    async def active_ids(self) -> list[str]:
        """The jobs env_svc's sweep still visits (`retire` takes one out)."""
        return sorted(text(member) for member in await self._redis.smembers(ACTIVE_JOBS))

    async def retire(self, job_id: str) -> None:
        """An ended job whose evaluations are done and whose state now expires: no sweep
        visits it again."""
        await self._redis.srem(ACTIVE_JOBS, job_id)

    async def expire_unkept(self, job_id: str, tenant: str) -> None:
        """An ended job that never published an adapter has nothing to export: its record and
        owner binding go with its working state (`ENDED_TTL_S`), and its entries in the
        listings then (`drop_expired_listings`). A job that trained stays; one that did not
        costs a tenant no work to make (submitted, then cancelled), so it must not stay."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.expire(job_key(job_id), ENDED_TTL_S)
            pipe.expire(owner_key(job_id), ENDED_TTL_S)
            pipe.zadd(UNKEPT_JOBS, {f"{tenant}/{job_id}": time.time() + ENDED_TTL_S})
            await pipe.execute()

    async def drop_expired_listings(self, *, now: float | None = None, batch: int = 500) -> int:
        """Take the unkept jobs whose records have expired out of `jobs` and their tenant's
        jobs, at most `batch` per call; returns how many."""
        members = await self._redis.zrangebyscore(
            UNKEPT_JOBS, "-inf", time.time() if now is None else now, start=0, num=batch
        )
        due = [text(member) for member in members if isinstance(member, bytes | str)]
        if due:
            async with self._redis.pipeline(transaction=True) as pipe:
                for member in due:
                    tenant, _, job_id = member.partition("/")
                    pipe.srem(JOBS, job_id)
                    pipe.srem(tenant_jobs_key(tenant), job_id)
                pipe.zrem(UNKEPT_JOBS, *due)
                await pipe.execute()
        return len(due)

    async def backfill_active(self) -> int | None:
        """Fill `active-jobs` and the tenants' load counters from `jobs`, once per
        deployment (a Redis from before them); the jobs taken in, or None when done before."""
        taken = int(
            await self._backfill_active(keys=[JOBS, ACTIVE_JOBS, ACTIVE_SINCE], args=_TERMINAL)
        )
        return None if taken < 0 else taken

    async def set_status(self, job_id: str, status: JobState, reason: str = "") -> bool:
        """Move a job to `status`; a job in a terminal status stays there (returns False).

        Raises UnknownJobError for a job that was never registered.
        """
        changed, current = await self._set_status(
            keys=[job_key(job_id)], args=[status, reason, time.time(), *_TERMINAL]
        )
        if not current:
            raise UnknownJobError(job_id)
        return bool(changed)


def _quota_args(spec: JobSpec, limits: TenantLimits | None) -> list[int]:
    """The quota rule's arguments: samples, the two limits (-1: none)."""
    return [
        samples_in_flight(spec),
        limits.max_concurrent_jobs if limits else -1,
        limits.max_samples_in_flight if limits else -1,
    ]


def _raise_over_quota(
    code: int, spec: JobSpec, limits: TenantLimits | None, jobs: int, busy: int
) -> None:
    if code < 0 and limits is not None:
        raise QuotaError(quota_problem(code, spec, limits, jobs, busy))
