"""The jobs this replica trains, their adapters on the policy, and the ways it lets a job or
a group go: handed over, ended (completed, failed), a group dropped."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from common.runtime.backoff import retry_transient
from common.runtime.config import TrainerSettings
from common.runtime.logs import job_logger
from common.runtime.metrics import TRAINER_GROUPS_DROPPED, forget_job
from common.runtime.service import Connections
from common.state.dedup import DROPPED, TRAINED
from common.state.keyspace import dedup_key, fence_key, flow_key, ledger_key
from common.state.pointers import FencedError
from common.wire.lifecycle import STATE_AFTER, ServiceName
from common.wire.messages import DropKind, GroupDropped, job_event
from trainer_svc.groups import Group
from trainer_svc.owned import OwnedJob
from trainer_svc.policy import MultiAdapterPolicy

log = logging.getLogger(__name__)

SERVICE: ServiceName = "trainer_svc"

T = TypeVar("T")


async def retry_through_outages(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """Run `call`, retried while Redis or Kafka is briefly away: an effect of a trained step
    must happen, not be lost to a restart of either."""
    return await retry_transient(what, call, logger=log)


def working_state_keys(job_id: str) -> list[str]:
    """What trainer_svc keeps of a job while it trains it (its Redis user's keys), to expire
    when it has ended; the adapter pointers stay (exports)."""
    return [
        dedup_key(TRAINED, job_id),
        dedup_key(DROPPED, job_id),
        fence_key(job_id),
        ledger_key(job_id),
        flow_key(job_id),
    ]


class Roster:
    """The jobs this replica owns (`jobs`), each with an adapter on the policy."""

    def __init__(
        self,
        io: Connections,
        settings: TrainerSettings,
        policy: Callable[[], MultiAdapterPolicy],
    ) -> None:
        """`policy`: the loaded policy (it is loaded after the service is built)."""
        self.io = io
        self.settings = settings
        self._policy = policy
        self.jobs: dict[str, OwnedJob] = {}
        self.stepping = asyncio.Lock()
        """Held by a training step; adding or removing an adapter waits for it."""

    @property
    def policy(self) -> MultiAdapterPolicy:
        return self._policy()

    def owns(self, job: OwnedJob) -> bool:
        """Whether the job is still this replica's (not ended, failed or handed over)."""
        return job.spec.job_id in self.jobs

    def disown(self, job_id: str) -> None:
        """Hand a job over (its partition moved, another replica fenced it off): let go of
        it, and forget it as known here (`store.admitted`); callers hold `stepping`."""
        self._let_go(job_id)
        if (store := self.io.store) is not None:
            store.admitted.forget(job_id)  # taken on again, it is read afresh

    def _let_go(self, job_id: str) -> None:
        """Drop a job and its adapter."""
        self.jobs.pop(job_id, None)
        if job_id in self.policy.jobs:
            self.policy.remove_job(job_id)
        forget_job(job_id)  # its series, which would otherwise pile up with every job

    async def ended(self, job: OwnedJob) -> None:
        """The job has ended: let go of it, and its working state here expires in a week. It
        stays known here as ended (`store.admitted`): a late trajectory of it costs a status
        read, not a decode; a reused id is told by its record's `created_at`."""
        job_id = job.spec.job_id
        job.release_all()
        self._let_go(job_id)
        await retry_through_outages(
            f"expiring {job_id}'s state",
            lambda: self.io.require_store().jobs.expire_after_end(working_state_keys(job_id)),
        )

    async def fail(self, job: OwnedJob, reason: str) -> None:
        """End a job that cannot make progress, with the reason (instead of re-issuing its
        groups forever)."""
        spec, store = job.spec, self.io.require_store()
        changed = await retry_through_outages(
            f"failing {spec.job_id}",
            lambda: store.jobs.set_status(spec.job_id, STATE_AFTER["failed"], reason),
        )
        if changed:
            await self.io.send(
                job_event(
                    spec.job_id,
                    "failed",
                    SERVICE,
                    tenant=spec.tenant,
                    step=job.version,
                    reason=reason,
                )
            )
            job_logger(log, spec.job_id, spec.tenant).error("job failed: %s", reason)
        await self.ended(job)

    async def complete(self, job: OwnedJob) -> None:
        """End a job whose last step was published."""
        spec, store = job.spec, self.io.require_store()
        changed = await retry_through_outages(
            f"completing {spec.job_id}",
            lambda: store.jobs.set_status(spec.job_id, STATE_AFTER["completed"]),
        )
        if changed:
            await self.io.send(
                job_event(spec.job_id, "completed", SERVICE, tenant=spec.tenant, step=job.version)
            )
            job_logger(log, spec.job_id, spec.tenant).info("completed after %d steps", job.version)
        await self.ended(job)

    async def drop(self, job: OwnedJob, group: Group, kind: DropKind, reason: str) -> None:
        """Count the group out of the job's window (it is replaced), have env_svc replace it,
        tell dashboards; fail the job after too many unusable groups in a row."""
        job_id, store = job.spec.job_id, self.io.require_store()
        try:
            counted = await retry_through_outages(
                "counting a dropped group",
                lambda: store.flow.record_dropped_group(
                    job_id,
                    group.group_id,
                    invalid=kind == "dropped_invalid",
                    kind=kind,
                    epoch=job.epoch,
                ),
            )
        except FencedError as exc:  # another replica owns the job now: its groups are its own
            job_logger(log, job_id, job.spec.tenant).warning("%s; job given up", exc)
            self.disown(job_id)
            return
        await self.io.send(
            GroupDropped(
                job_id=job_id,
                group_id=group.group_id,
                verdict=kind,
                reason=reason,
                dropped_at=time.time(),
            )
        )
        await self.io.send(
            job_event(
                job_id,
                kind,
                SERVICE,
                tenant=job.spec.tenant,
                step=job.version,
                reason=f"group {group.group_id}: {reason}",
            )
        )
        TRAINER_GROUPS_DROPPED.labels(job_id, kind).inc()
        job_logger(log, job_id, job.spec.tenant).info(
            "%s group %s (%s)", kind, group.group_id, reason
        )
        group.release()
        if counted.failed_in_a_row >= self.settings.max_failed_groups:
            await self.fail(
                job,
                f"{counted.failed_in_a_row} groups in a row had no usable rewards; "
                f"the last: {reason}",
            )
