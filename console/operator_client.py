"""The operator's client: the client library's `Client` with the console's own views of the
deployment, the status board of every job and service and experiment tracking."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from common.runtime.config import SERVICE_SETTINGS, load
from common.wire.lifecycle import SERVICES, STATE_AFTER, TERMINAL_STATES
from common.wire.messages import JobSpec
from console.status.board import StatusBoard
from console.tracking import Tracker
from marlaas.client import Client


class OperatorClient(Client):
    """`Client` plus the views only an operator has: every service's consumer lag and the
    replicas (`status_board`), and the jobs' metrics written to trackers (`track`)."""

    def status_board(self, job_ids: Collection[str] | None = None) -> StatusBoard:
        return StatusBoard(
            self.settings.kafka_bootstrap,
            self.store,
            consumer_groups(),
            job_ids=job_ids,
            timeout_s=self.connect_timeout_s,
        )

    async def track(self, job_ids: Collection[str], tracker: Tracker, *, follow: bool) -> int:
        """Write the jobs' (or every job's) metrics and settings to the tracker's sinks;
        returns how many events were new. With `follow`, keep writing as events come,
        until the named jobs have ended (no job named: until interrupted)."""
        for job_id in job_ids:
            await self.job(job_id)  # UnknownJobError for a typo, before anything is written
        specs: dict[str, JobSpec] = {}
        written, ended = 0, set[str]()
        async with self._feed(set(job_ids) or None) as feed:
            while True:
                if follow:
                    events = await feed.poll(0.5)
                else:
                    events = await feed.read_to_end(timeout_s=self.connect_timeout_s * 3)
                for job_id in {event.job_id for event in events} - specs.keys():
                    if (record := await self.store.jobs.get(job_id)) is not None:
                        specs[job_id] = record.spec
                written += await asyncio.to_thread(tracker.write, events, specs)
                ended |= {e.job_id for e in events if STATE_AFTER.get(e.event) in TERMINAL_STATES}
                if not follow or (job_ids and feed.caught_up and set(job_ids) <= ended):
                    return written


def consumer_groups() -> dict[str, str]:
    """Each service's consumer group, as this machine's settings name them."""
    return {service: load(SERVICE_SETTINGS[service]).consumer_group for service in SERVICES}
