"""The jobs a rollout replica has work of that have stopped (cancelled, failed).

A job is cancelled in env_svc or fails in the trainer; its requests may still wait in this
replica's fair queue or generate in its engine, work whose results nobody reads. Looked up
every second for the jobs with work here (one pipelined Redis read), a stopped job's waiting
requests are released unserved and its generations stopped, so a cancelled job's work ends
with it: a tenant submitting and cancelling jobs in a loop cannot fill the shared engine. A
completed job is not stopped: its final version is still evaluated.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping

from common.wire.lifecycle import STOPPED_STATES

FORGET_AFTER_S = 600.0
"""How long a stopped job is remembered after it was last asked about."""


class StoppedJobs:
    """Which jobs have stopped, as far as this replica has looked."""

    def __init__(
        self,
        statuses: Callable[[Collection[str]], Awaitable[Mapping[str, str | None]]],
        clock: Callable[[], float],
    ) -> None:
        self._statuses = statuses
        self._clock = clock
        self._stopped: dict[str, float] = {}
        """Each stopped job, and when it was last asked about (forgotten after a while)."""

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._stopped

    async def look(self, job_ids: Collection[str]) -> set[str]:
        """Look up the jobs not known to have stopped; returns those that have since."""
        now = self._clock()
        for job_id in job_ids:
            if job_id in self._stopped:
                self._stopped[job_id] = now
        self._stopped = {j: at for j, at in self._stopped.items() if now - at <= FORGET_AFTER_S}
        unknown = [job_id for job_id in job_ids if job_id not in self._stopped]
        if not unknown:
            return set()
        statuses = await self._statuses(unknown)
        stopped = {job_id for job_id, status in statuses.items() if status in STOPPED_STATES}
        self._stopped.update(dict.fromkeys(stopped, now))
        return stopped
