"""The retirement of ended jobs: once its evaluations are all done, an ended job's audit is
kept in its record, its working state expires in a week, and no sweep visits it again."""

from __future__ import annotations

from collections.abc import Iterable

from common.runtime.service import Connections
from common.state.audit import audit
from common.state.dedup import COMMANDS, RESULTS
from common.state.evals import DONE
from common.state.keyspace import (
    claims_key,
    dedup_key,
    eval_resends_key,
    eval_seen_key,
    eval_tally_key,
    evals_key,
    flow_key,
    ledger_key,
)
from common.state.registry import JobRecord


class Retirement:
    """Retires a job that has ended, when nothing of it is left to finish."""

    def __init__(self, io: Connections) -> None:
        self.io = io

    async def retire_when_done(self, record: JobRecord) -> bool:
        """An ended job whose evaluations are all done: its audit is kept in its record, its
        state here expires in a week, and it is retired (no sweep visits it again). False
        while something is left to finish."""
        store, job_id = self.io.require_store(), record.spec.job_id
        evals = await store.evals.versions(job_id)
        if any(state != DONE for state in evals.values()):
            return False
        pointer = await store.adapters.get(job_id)
        summary = audit(
            job_id,
            await store.flow.ledger(job_id),
            status=record.status,
            groups_per_step=record.spec.rl.groups_per_step,
            pointer_version=pointer.version if pointer else 0,
        )
        await store.jobs.put_audit_summary(job_id, summary.to_json())
        await store.jobs.expire_after_end(working_state_keys(job_id, evals))
        if pointer is None:  # nothing to export: its record goes too
            await store.jobs.expire_unkept(job_id, record.spec.tenant)
        await store.jobs.retire(job_id)
        return True


def working_state_keys(job_id: str, evaluated: Iterable[int]) -> list[str]:
    """What env_svc keeps of a job while it runs (its Redis user's keys), to expire when it
    has ended and its `evaluated` versions are done."""
    versions = list(evaluated)
    return [
        claims_key(job_id),
        flow_key(job_id),
        ledger_key(job_id),
        evals_key(job_id),
        eval_resends_key(job_id),
        dedup_key(RESULTS, job_id),
        dedup_key(COMMANDS, job_id),
        *(eval_seen_key(job_id, v) for v in versions),
        *(eval_tally_key(job_id, v) for v in versions),
    ]
