"""The jobs a rollout replica has seen: each one's tenant and when it was last used here, and
the ids found unregistered lately."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from common.runtime.logs import job_logger
from common.state.store import RedisStore
from common.wire.jobspec import AdmittedJob
from common.wire.messages import GenerationRequest

log = logging.getLogger(__name__)

IDLE_JOB_S = 600.0
"""A job with no request here for this long (and none waiting) is forgotten: its newest
adapter leaves the engine and its entries go, which would otherwise pile up with every job
ever served. A later request of it reads its pointer again (`JobAdapters.adapter_for`)."""
UNKNOWN_JOB_S = 5.0
"""How long an id found unregistered is taken as such without asking the registry again (a
job submitted meanwhile is found after it)."""
MAX_UNKNOWN_JOBS = 1024
"""Ids remembered as unregistered at most: the oldest leave first."""


class JobsSeen:
    """Each job's tenant (read once) and when it last had a request or an update here."""

    def __init__(self, store: Callable[[], RedisStore | None]) -> None:
        """`store`: the registry, None while not connected (a tenant is then "")."""
        self._store = store
        self.tenants: dict[str, str] = {}
        """Tenant of each job this replica logged about or admitted, read once."""
        self.used_at: dict[str, float] = {}
        """When each job with an adapter or a tenant here, or read as registered, last had a
        request or an update."""
        self._unknown: OrderedDict[str, float] = OrderedDict()
        """When each id lately found unregistered was (monotonic)."""

    def touch(self, job_id: str) -> None:
        self.used_at[job_id] = time.monotonic()

    def took(self, request: GenerationRequest) -> None:
        """A request of its job was read: the job is used, and its tenant known if carried."""
        self.touch(request.job_id)
        if request.tenant:  # schema 4 on: carried, no registry read
            self.tenants.setdefault(request.job_id, request.tenant)

    async def job(self, job_id: str) -> AdmittedJob | None:
        """The registered job as admitted (read once per process, `store.admitted`); None for
        an id not registered, which is asked again only after `UNKNOWN_JOB_S`, or while not
        connected."""
        store, now = self._store(), time.monotonic()
        if store is None or now - self._unknown.get(job_id, -UNKNOWN_JOB_S) < UNKNOWN_JOB_S:
            return None
        if (job := await store.admitted.job(job_id)) is not None:
            self._unknown.pop(job_id, None)
            self.used_at.setdefault(job_id, now)  # forgotten, with what it knows, once idle
            return job
        self._unknown[job_id] = now
        self._unknown.move_to_end(job_id)
        while len(self._unknown) > MAX_UNKNOWN_JOBS:
            self._unknown.popitem(last=False)
        return None

    async def tenant_of(self, job_id: str) -> str:
        """The job's tenant: the one its requests carry, else from the registry (`job`: one
        read per job, for requests of writers before schema 4); "" while unknown.

        "" is a tenant of its own for admission. An unregistered job, or a registry that
        does not answer, is asked again later: neither logging nor admission fails on it."""
        if job_id not in self.tenants:
            try:
                job = await self.job(job_id)
            except Exception as exc:
                log.debug("no tenant for job %s: %r", job_id, exc)
                job = None
            if job is not None:
                self.tenants[job_id] = job.tenant
        return self.tenants.get(job_id, "")

    async def job_log(self, job_id: str) -> logging.LoggerAdapter[logging.Logger]:
        """A logger tagged with the job and its tenant."""
        return job_logger(log, job_id, await self.tenant_of(job_id) or None)

    def forget_idle(self, now: float, waiting: set[str]) -> list[str]:
        """Forget the jobs idle for `IDLE_JOB_S` (monotonic `now`) with nothing `waiting`;
        returns them."""
        idle = [j for j, at in self.used_at.items() if now - at > IDLE_JOB_S and j not in waiting]
        store = self._store()
        for job_id in idle:
            del self.used_at[job_id]
            self.tenants.pop(job_id, None)
            if store is not None:
                store.admitted.forget(job_id)  # read afresh should it come back
        return idle
