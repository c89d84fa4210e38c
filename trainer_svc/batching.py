"""Which jobs a step trains: those with B usable groups, round-robin; before that, the groups
that can never be trained are dropped (too stale, uniform, invalid, dropped elsewhere, lost),
and jobs that ended elsewhere are let go."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from common.runtime.backoff import is_transient
from common.runtime.logs import job_logger
from common.wire.lifecycle import TERMINAL_STATES
from trainer_svc.groups import Group, verdict, worth_resampling
from trainer_svc.owned import OwnedJob
from trainer_svc.roster import Roster, retry_through_outages

log = logging.getLogger(__name__)


class Batching:
    """Picks the jobs of the next step and drops what they cannot train."""

    def __init__(self, roster: Roster, caught_up: Callable[[int], Awaitable[bool]]) -> None:
        """`caught_up(partition)`: whether this replica has read the partition's
        trajectories to its end (no group is lost while some may be unread)."""
        self.roster = roster
        self.settings = roster.settings
        self.caught_up = caught_up
        self._last: tuple[str, int] | None = None
        """The job the last step took last, and where it stood: the next round starts after
        it (where it stood, if it has gone)."""

    async def ready_jobs(self) -> list[OwnedJob]:
        """Jobs with B usable groups, round-robin from the job after the last one taken: no
        tenant waits behind another when there are more ready jobs than one step takes, and
        a job whose next groups come while its step trains is not taken again before the
        others have had their turn (a start moved by one per step, while a step took up to
        `max_jobs_per_step`, took the same jobs back to back: bench/README.md, "Agentic
        jobs")."""
        candidates = list(self.roster.jobs.values())
        if not candidates:
            return []
        ids = [job.spec.job_id for job in candidates]
        start = 0
        if self._last is not None:
            last, stood = self._last
            start = (ids.index(last) + 1 if last in ids else stood) % len(ids)
        ready: list[OwnedJob] = []
        for job in candidates[start:] + candidates[:start]:
            await self.drop_unusable(job)
            now = time.monotonic()
            if (
                len(job.ready) >= job.spec.rl.groups_per_step
                and job.not_before <= now
                and not job.waits(now, self.settings.stale_wait_s)
            ):
                ready.append(job)
                if len(ready) == self.settings.max_jobs_per_step:
                    break
        if ready:
            self._last = (ready[-1].spec.job_id, ids.index(ready[-1].spec.job_id))
        return ready

    async def drop_unusable(self, job: OwnedJob) -> None:
        """Drop ready groups that cannot be trained, and filling ones already too stale to
        ever be (their late samples then find the group closed). Trajectories keep arriving
        while a drop is sent: a group may complete, and new ones become ready, meanwhile."""
        if not await self._drop_stale_filling(job):
            return
        pending = await self._without_dropped_elsewhere(job)
        keep: deque[Group] = deque()
        while pending:
            group = pending.popleft()
            kind, reason = verdict(
                group,
                trained_version=job.version,
                max_staleness=job.spec.rl.max_staleness,
                resample_uniform=job.resampled < job.spec.rl.resample_uniform_groups
                and worth_resampling(job.recent_signal),
            )
            if kind == "train":
                keep.append(group)
            else:
                job.resampled += kind == "dropped_uniform"
                await self.roster.drop(job, group, kind, reason)
            if not self.roster.owns(job):
                # The drop failed the job (or it was handed over): nothing of it stays held.
                for left in [*keep, *pending]:
                    left.release()
                return
        job.ready.extendleft(reversed(keep))  # ahead of groups that became ready meanwhile

    async def _drop_stale_filling(self, job: OwnedJob) -> bool:
        """Drop the filling groups already more than `max_staleness` behind; False when a
        drop failed the job."""
        for group in list(job.filling.values()):
            if job.filling.get(group.group_id) is not group:
                continue  # it completed while an earlier drop was sent
            lag = job.version - group.oldest_version if group.trajectories else 0
            if lag <= job.spec.rl.max_staleness:
                continue
            del job.filling[group.group_id]
            job.closed.add(group.group_id)
            await self.roster.drop(
                job, group, "dropped_stale", f"{lag} versions behind, unfinished"
            )
            if not self.roster.owns(job):
                return False
        return True

    async def _without_dropped_elsewhere(self, job: OwnedJob) -> deque[Group]:
        """Take the job's ready groups out, less those dropped elsewhere (a replica that owned
        the job before, dropping one as lost while its trajectories were only late): each was
        replaced, so it must never be trained too."""
        store, ready_ids = self.roster.io.require_store(), [g.group_id for g in job.ready]
        elsewhere = await retry_through_outages(
            "checking for groups dropped elsewhere",
            lambda: store.dedup.dropped_among(job.spec.job_id, ready_ids),
        )
        pending, job.ready = job.ready, deque()
        for group in [g for g in pending if g.group_id in elsewhere]:
            pending.remove(group)
            job.closed.add(group.group_id)
            group.release()
            job_logger(log, job.spec.job_id, job.spec.tenant).info(
                "group %s was dropped elsewhere; not trained", group.group_id
            )
        return pending

    async def sweep_finished(self) -> None:
        """Let go of jobs that ended elsewhere (cancelled, failed): their groups' commits
        would otherwise be held forever, stopping commits of the whole partition. Drop the
        lost groups of running jobs that stopped moving. The jobs' statuses are read in one
        round trip."""
        jobs = list(self.roster.jobs.values())
        try:
            statuses = await self.roster.io.require_store().jobs.statuses(
                [job.spec.job_id for job in jobs]
            )
            for job in jobs:
                await self._sweep(job, statuses[job.spec.job_id])
        except Exception as exc:  # Redis down: the loop goes on training what it has
            if not is_transient(exc):
                raise
            log.warning("sweep stopped (%r); the next sweep retries", exc)

    async def _sweep(self, job: OwnedJob, status: str | None) -> None:
        job_id = job.spec.job_id
        if status is None or status in TERMINAL_STATES:
            async with self.roster.stepping:  # an adapter is not removed under a resume
                await self.roster.ended(job)
            job_logger(log, job_id, job.spec.tenant).info(
                "job %s: its held groups released", status or "gone"
            )
        else:  # running, or paused: a paused job's lost groups must not pin the partition
            async with self.roster.stepping:
                await self._drop_lost(job)

    async def _drop_lost(self, job: OwnedJob) -> None:
        """Drop the live groups of a job whose ledger has not moved for `group_timeout_s`
        (nothing issued, trained or dropped) but those complete here, once this replica has
        read the job's partition to its end: their missing trajectories are not coming (a
        record the broker lost; an episode that never ended), and a job whose window is
        full would wait for them forever. env_svc issues replacements; late trajectories
        find the groups dropped. The time is the ledger's, so it outlives hand-overs between
        replicas. Trajectories not read yet (a backlog replayed after a hand-over) are late,
        not lost: dropping their groups would have env_svc issue more and grow the backlog."""
        store, job_id = self.roster.io.require_store(), job.spec.job_id
        last = await store.flow.last_activity(job_id)
        quiet = time.time() - last if last is not None else 0.0
        if quiet <= self.settings.group_timeout_s or not self.roster.owns(job):
            return
        if not await self.caught_up(job.partition):
            return
        for group_id in await store.flow.live_groups(job_id):
            # Closed here: complete (ready or trained) or dropped. Checked at each group, not
            # once: a group may complete while an earlier drop is being recorded.
            if group_id in job.closed or not self.roster.owns(job):
                continue
            group = job.filling.pop(group_id, None) or Group(group_id)
            job.closed.add(group_id)
            have = f"{len(group.trajectories)} of {job.spec.rl.group_size} trajectories"
            reason = f"{have} after {quiet:.0f}s without progress; the rest are lost"
            await self.roster.drop(job, group, "dropped_stale", reason)
