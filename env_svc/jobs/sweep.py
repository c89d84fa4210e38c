"""The periodic pass over every active job: what a lost record or a dead replica left undone
(groups claimed but not sent, the window's next groups, evaluations unfinished) done again,
and ended jobs retired; expired shared-listing entries dropped first."""

from __future__ import annotations

from common.runtime.service import Connections
from common.wire.lifecycle import TERMINAL_STATES
from env_svc.jobs.environments import JobEnvironments
from env_svc.jobs.evaluations import Evaluations
from env_svc.jobs.issuing import GroupIssuer
from env_svc.jobs.retirement import Retirement


class Sweep:
    """One pass over the active jobs; `EnvService` runs it every `claim_sweep_s`."""

    def __init__(
        self,
        io: Connections,
        environments: JobEnvironments,
        *,
        issuer: GroupIssuer,
        evaluations: Evaluations,
        retirement: Retirement,
    ) -> None:
        self.io = io
        self.environments = environments
        self.issuer = issuer
        self.evaluations = evaluations
        self.retirement = retirement

    async def run(self) -> int:
        """Send again every group claimed more than `claim_timeout_s` ago and never finished
        (its replica died or lost Kafka mid-group), and issue what each running job's window
        allows (in case the record that should have prompted it, an AdapterUpdate or a
        GroupDropped, never arrived); returns how many groups were sent again."""
        store, resent = self.io.require_store(), 0
        await store.jobs.drop_expired_listings()
        active = await store.jobs.active_ids()
        self.environments.keep_only(active)  # retired, maybe by another replica
        store.admitted.keep_only(active)  # and known no more: a retired id may be reused
        records = await store.admitted.records(active)  # one round trip
        for job_id in active:
            record = records.get(job_id)
            if record is None:
                await store.jobs.retire(job_id)
                continue
            if record.status in TERMINAL_STATES:
                self.environments.forget(job_id)  # a cache: rebuilt should a late result need it
                if await self.retirement.retire_when_done(record):
                    continue
            await self.issuer.issue_groups(record)
            await self.evaluations.sweep(record)
            resent += await self.issuer.resend_stale_claims(record)
        return resent
