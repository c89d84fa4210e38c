"""Admission of job specs: a job id bound to its first tenant for good, the spec checked once
against the deployment and its tenant's limits, its environment proven by a first episode,
then registered and `accepted`, or `rejected` with the reason. A spec under a job id already
registered is not checked again: the registered spec stands, and issuing resumes."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from common.runtime.backoff import is_transient
from common.runtime.config import SharedSettings
from common.runtime.logs import job_logger
from common.runtime.service import Connections
from common.state.registry import JobRecord
from common.state.tenants import TenantLimits
from common.wire.codec import job_named_in
from common.wire.jobspec import AdmittedJob, admit
from common.wire.lifecycle import STATE_AFTER
from common.wire.messages import JobSpec, MessageDecodeError, Topic, job_event
from env_svc.episodes import start_episode
from env_svc.jobs import SERVICE
from env_svc.jobs.environments import JobEnvironments
from env_svc.jobs.episode_part import EpisodePart
from env_svc.jobs.evaluations import Evaluations
from env_svc.jobs.issuing import GroupIssuer
from env_svc.jobs.reasons import reason
from env_svc.protocol import Environment

log = logging.getLogger(__name__)


class ForeignJobError(ValueError):
    """A job spec under a job id bound to another tenant (dead-lettered, no event)."""


class Admission(EpisodePart):
    """Admits or rejects each job spec, and starts what it admits."""

    def __init__(
        self,
        shared: SharedSettings,
        io: Connections,
        environments: JobEnvironments,
        *,
        issuer: GroupIssuer,
        evaluations: Evaluations,
    ) -> None:
        super().__init__(io, environments)
        self.shared = shared
        self.issuer = issuer
        self.evaluations = evaluations

    async def on_job(self, spec: JobSpec) -> None:
        store = self.io.require_store()
        # A job id is bound to the tenant that first sent it, for good: a spec of another
        # tenant under it is dead-lettered with no event, since a `rejected` event would end
        # the owner's view of its job (docs/architecture.md, "Tenants").
        claim = await store.jobs.claim_id(spec.job_id, spec.tenant)
        if claim.owner != spec.tenant:
            raise ForeignJobError(
                f"job id {spec.job_id!r} belongs to tenant {claim.owner!r}; "
                f"a spec for it from tenant {spec.tenant!r} is refused"
            )
        if claim.record is not None:
            # Redelivered, or sent again under its id: the registered spec stands, checked when
            # it came, in its status as registered (a paused job stays paused). Checked again,
            # it could be `rejected` (its tenant's limits lowered since, an environment gone)
            # while it runs, ending its owner's view of it.
            job_logger(log, spec.job_id, spec.tenant).info(
                "job already registered; its registered spec stands"
            )
            await self._start(claim.record)
            return
        limits = await store.tenants.limits(spec.tenant)
        try:
            job, probed, registered = await self._admit(spec, limits)
        except Exception as exc:  # whatever the spec or its environment raised: rejected
            if is_transient(exc):
                raise
            await self._reject(spec.job_id, spec.tenant, reason(exc))
            return
        if not registered:  # another replica registered it meanwhile: as it stands there
            if (record := await store.jobs.get(spec.job_id)) is not None:
                await self._start(record)
            return
        self.environments.keep(job.job_id, probed)  # the registered spec's environment
        job_logger(log, job.job_id, job.tenant).info("job accepted: env %s", job.spec.env.name)
        await self.io.send(job_event(job.job_id, "accepted", SERVICE, tenant=job.tenant))
        status = STATE_AFTER["accepted"]
        await self._start(JobRecord(job, status, reason="", updated_at=job.created_at))

    async def on_undecodable(
        self, topic: str, raw: bytes | None, error: MessageDecodeError
    ) -> None:
        """A job spec that names its job but does not decode (a field misspelt or of the
        wrong type, e.g. in JSON from another Kafka client) is `rejected` with the reason,
        so its sender sees why in `marlaas logs`; the record is dead-lettered as well."""
        if topic != Topic.JOBS or (named := job_named_in(raw)) is None:
            return
        job_id, tenant = named
        claim = await self.io.require_store().jobs.claim_id(job_id, None)
        if claim.record is not None or claim.owner not in (None, tenant):
            # Not this sender's job to reject: a `rejected` event would end the owner's view
            # of a job that runs (`logs --follow`). The dead letter says what came.
            job_logger(log, job_id, tenant).warning("undecodable spec for a taken job id")
            return
        await self._reject(job_id, tenant, error.reason)

    async def _start(self, record: JobRecord) -> None:
        """Issue what the registered job's status allows (also resumes issuing after a
        redelivery), and evaluate the base model, to compare the adapters with."""
        await self.issuer.issue_groups(record)
        await self.evaluations.evaluate(record, 0)

    async def _admit(
        self, spec: JobSpec, limits: TenantLimits | None
    ) -> tuple[AdmittedJob, Environment[Any], bool]:
        """The spec admitted (common/wire/jobspec.py), its environment proven, and the job
        registered: the job, its environment and whether this call registered it (False:
        another replica did)."""
        deployment = self.shared.deployment(max_model_len=await self._engine_context())
        job = admit(spec, deployment=deployment, limits=limits)
        # A first episode proves the environment, its params and the prompt length.
        probed = await self._probe(job.spec)
        registered = await self.io.require_store().jobs.register(
            job, status=STATE_AFTER["accepted"], limits=limits
        )
        return job, probed, registered

    async def _reject(self, job_id: str, tenant: str, why: str) -> None:
        job_logger(log, job_id, tenant).warning("job rejected: %s", why)
        await self.io.require_store().jobs.record_rejection(job_id, why)
        await self.io.send(job_event(job_id, "rejected", SERVICE, tenant=tenant, reason=why))

    async def _engine_context(self) -> int | None:
        """The shortest `max_model_len` of the live rollout replicas (None: none reports)."""
        stats = await self.io.require_store().replicas.stats()
        limits = [int(s.max_model_len) for s in stats.values() if s.max_model_len]
        return min(limits, default=None)

    async def _probe(self, spec: JobSpec) -> Environment[Any]:
        """The job's environment, proven by starting a first episode."""
        env = await self.environments.build(spec)
        await self.calls.drive(
            f"job {spec.job_id}: first episode",
            partial(
                start_episode,
                env,
                self.tokenizer,
                spec,
                group_id="probe",
                group_index=0,
                sample_index=0,
            ),
            awaits=env.awaits,
        )
        return env
