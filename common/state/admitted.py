"""Registered jobs as this process knows them: each one's `AdmittedJob` (common/wire/jobspec.py),
decoded once per process whoever reads it, the terminal status it reached, and its record
(`JobRecord`: that job with where it stands now) read in one round trip.

A job's spec is admitted once (env_svc registers it; a spec re-sent under a registered id does
not replace it), so the bytes under `job:{job}`'s `spec` never change while the record lives;
nor does a terminal status (the status Lua refuses to leave it). Every record read compares
its `created_at` with the known job's: an unkept job's record expires and its id may be
reused, and the new record's job is decoded anew. `job` (a hot path that needs the spec, not
the status) reads Redis only for a job not known here, and `statuses` does not read a terminal
status known here: so each service forgets a job on its lifecycle (env_svc's sweep keeps the
active jobs, trainer_svc forgets a job it lets go, rollout_svc one gone idle), long before an
unkept job's record can expire (a week). The least recently read leave past `capacity`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.runtime.metrics import JOB_SPEC_DECODES
from common.state.keyspace import dedup_key, job_key
from common.state.redis_part import RedisPart, text
from common.wire.codec import decode
from common.wire.jobspec import AdmittedJob
from common.wire.lifecycle import JOB_STATES, TERMINAL_STATES, JobState
from common.wire.messages import JobSpec, Topic

if TYPE_CHECKING:
    from redis import asyncio as aioredis

CAPACITY = 4096
"""Jobs known per process: more than the jobs a replica serves at once."""
RECORD_FIELDS = ("status", "reason", "created_at", "updated_at")
"""What a record read takes of `job:{job}` besides the spec (known here)."""


@dataclass(frozen=True)
class JobRecord:
    """A registered job: as admitted, and where it stands now."""

    job: AdmittedJob
    status: JobState
    reason: str
    updated_at: float

    @property
    def spec(self) -> JobSpec:
        return self.job.spec

    @property
    def created_at(self) -> float:
        return self.job.created_at


@dataclass
class _Known:
    job: AdmittedJob
    ended: JobState | None = None
    """The terminal status it was read in (it sticks); None while not read ended."""


class AdmittedJobs(RedisPart):
    """The registered jobs this process has read, each decoded once."""

    def __init__(self, client: aioredis.Redis, capacity: int = CAPACITY) -> None:
        super().__init__(client)
        self.capacity = capacity
        self._known: OrderedDict[str, _Known] = OrderedDict()

    async def job(self, job_id: str, created_at: float | None = None) -> AdmittedJob | None:
        """The registered job, read only when it is not known here (or known with another
        `created_at` than its record's: its id reused); None: no record."""
        known = self._known.get(job_id)
        if known is not None and created_at in (None, known.job.created_at):
            self._known.move_to_end(job_id)
            return known.job
        raw, registered_at = await self._redis.hmget(job_key(job_id), "spec", "created_at")
        if raw is None or registered_at is None:
            self.forget(job_id)
            return None
        return self.keep(AdmittedJob(_decoded(raw), created_at=float(registered_at)))

    def keep(self, job: AdmittedJob) -> AdmittedJob:
        """Know `job` as registered (env_svc's own admission knows it without a read)."""
        self._known[job.job_id] = _Known(job)
        self._known.move_to_end(job.job_id)
        while len(self._known) > self.capacity:
            self._known.popitem(last=False)
        return job

    def ended(self, job_id: str) -> JobState | None:
        """The terminal status the job was last read in (None: not known to have ended)."""
        known = self._known.get(job_id)
        return None if known is None else known.ended

    def forget(self, job_id: str) -> None:
        self._known.pop(job_id, None)

    def keep_only(self, job_ids: Iterable[str]) -> None:
        """Forget every job not in `job_ids` (those a service's lifecycle still holds)."""
        for job_id in set(self._known) - set(job_ids):
            del self._known[job_id]

    async def get(self, job_id: str) -> JobRecord | None:
        return (await self.records([job_id])).get(job_id)

    async def records(self, job_ids: Collection[str]) -> dict[str, JobRecord]:
        """The records of those of the jobs that are registered: one round trip while the
        jobs are known here, and one more for each that is not."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(job_key(job_id), *RECORD_FIELDS)
            answers = await pipe.execute()
        found: dict[str, JobRecord] = {}
        for job_id, fields in zip(job_ids, answers, strict=True):
            if (record := await self.record_of(job_id, fields)) is not None:
                found[job_id] = record
        return found

    async def record_of(self, job_id: str, fields: Sequence[Any]) -> JobRecord | None:
        """The record whose `RECORD_FIELDS` were read as `fields` (a status None: none)."""
        status, reason, created_at, updated_at = fields
        if status is None or (job := await self.job(job_id, float(created_at))) is None:
            return None
        status = self._seen_in(job_id, _status(status))
        return JobRecord(job, status, text(reason or ""), float(updated_at))

    def _seen_in(self, job_id: str, status: JobState) -> JobState:
        """`status`, read just now: remembered when terminal (it sticks) of a job known here."""
        if status in TERMINAL_STATES and (known := self._known.get(job_id)) is not None:
            known.ended = status
        return status

    async def statuses(self, job_ids: Collection[str]) -> dict[str, str | None]:
        """Each job's status alone (None: no record), in one round trip, none for a job
        known here to have ended: for a hot path that has the spec at hand."""
        statuses: dict[str, str | None] = {
            job_id: ended for job_id in job_ids if (ended := self.ended(job_id)) is not None
        }
        unknown = [job_id for job_id in job_ids if job_id not in statuses]
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in unknown:
                pipe.hget(job_key(job_id), "status")
            answers = await pipe.execute() if unknown else []
        for job_id, answer in zip(unknown, answers, strict=True):
            statuses[job_id] = None if answer is None else self._seen_in(job_id, _status(answer))
        return {job_id: statuses[job_id] for job_id in job_ids}

    async def get_unless_seen(
        self, scope: str, job_id: str, item_id: str
    ) -> tuple[bool, JobRecord | None]:
        """Whether `item_id` was handled already in the de-dup `scope`
        (common/state/dedup.py), and if not the job's record: one round trip while the job
        is known here."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.sismember(dedup_key(scope, job_id), item_id)
            pipe.hmget(job_key(job_id), *RECORD_FIELDS)
            seen, fields = await pipe.execute()
        if seen:
            return True, None
        return False, await self.record_of(job_id, fields)


def _decoded(raw: bytes | str) -> JobSpec:
    spec = decode(Topic.JOBS, raw.encode() if isinstance(raw, str) else raw)
    if not isinstance(spec, JobSpec):
        raise TypeError(f"a job record holds a {type(spec).__name__}, not a JobSpec")
    JOB_SPEC_DECODES.inc()
    return spec


def _status(raw: bytes | str) -> JobState:
    status = text(raw)
    if status not in JOB_STATES:
        raise ValueError(f"corrupt job status {status!r}")
    return status  # type: ignore[return-value]
