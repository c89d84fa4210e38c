"""Fair admission into the engine's slots: work waits per tenant, and enters by its share.

Every request read, and every chat request made for a job, waits in a `FairQueue` under its
job's tenant until a slot frees and the rule (rollout_svc/admission.py) picks it; a tenant
holding its water-filled share of the slots is passed over (docs/architecture.md, "Rollout
admission"). The slots count what is in the engine per tenant and keep each job's work, so
a stopped job's generations can be cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

from rollout_svc.admission import FairQueue, water_fill

Serve = Callable[[], Awaitable[None]]
"""Admitted work: sample (and send) in an engine slot."""


class EngineSlots:
    """The waiting work by tenant and job, the shares, and what each tenant has in the engine."""

    def __init__(
        self,
        max_in_flight: int,
        fair_share_grace_s: float,
        *,
        closed: Callable[[], bool],
        clock: Callable[[], float],
    ) -> None:
        """`closed`: True once nothing may enter any more (the replica stops, or its engine
        died): held commits of waiting work are then never released, so a restart reads them
        again. `clock`: monotonic seconds, of the shares' grace."""
        self.max_in_flight = max_in_flight
        self._grace_s = fair_share_grace_s
        self._closed = closed
        self._clock = clock
        self.waiting: FairQueue[tuple[Serve, str, str]] = FairQueue()
        """Work not yet in the engine, with its tenant and job: requests read (their commits
        held) and chat requests made for a job (a judge's). Each is served once admitted."""
        self.in_engine = 0
        """Work admitted and not finished: at most `max_in_flight`."""
        self.tenant_in_engine: dict[str, int] = {}
        self._tenant_peak: dict[str, tuple[int, float]] = {}
        """Each tenant's recent peak demand (waiting + in the engine) and when it was seen: its
        claim on the slots for `fair_share_grace_s` (rollout_svc/admission.py `water_fill`)."""
        self.generations: set[asyncio.Task[None]] = set()
        self._job_tasks: dict[str, set[asyncio.Task[None]]] = {}
        """Each job's work in the engine, stopped when the job stops."""
        self.room = asyncio.Event()
        """Set when work left `waiting`: a poll loop held back may read again."""

    def queue(self, tenant: str, job_id: str, serve: Serve, *, rank: int | None) -> None:
        """Queue `serve` as `tenant`'s (for `job_id`) and start what the free slots allow."""
        self.waiting.put(tenant, job_id, (serve, tenant, job_id), rank=rank)
        self._note_demand(tenant)
        self.admit()

    def admit(self) -> None:
        """Start the next waiting work (rollout_svc/admission.py: the rule) while engine slots
        are free and the slots are not `closed`. Called whenever either changes: work queued,
        a generation ended."""
        while self.waiting and self.in_engine < self.max_in_flight and not self._closed():
            try:
                serve, tenant, job_id = self.waiting.pop(partial(self._below, self.shares()))
            except LookupError:  # every waiting tenant holds its share: keep the rest free
                return
            self.room.set()
            self._start(serve, tenant, job_id)

    def _start(self, serve: Serve, tenant: str, job_id: str) -> None:
        self.in_engine += 1
        self.tenant_in_engine[tenant] = self.tenant_in_engine.get(tenant, 0) + 1
        task = asyncio.create_task(self._in_engine_slot(serve, tenant), name="generate")
        self.generations.add(task)
        task.add_done_callback(self.generations.discard)
        self._job_tasks.setdefault(job_id, set()).add(task)
        task.add_done_callback(partial(self._task_done, job_id))

    def _task_done(self, job_id: str, task: asyncio.Task[None]) -> None:
        tasks = self._job_tasks.get(job_id, set())
        tasks.discard(task)
        if not tasks:
            self._job_tasks.pop(job_id, None)

    async def _in_engine_slot(self, serve: Serve, tenant: str) -> None:
        """Serve admitted work in its engine slot, then free the slot for the next."""
        try:
            await serve()
        finally:
            self.in_engine -= 1
            self.tenant_in_engine[tenant] = self.tenant_in_engine.get(tenant, 1) - 1
            self._note_demand(tenant)
            self.admit()

    def job_ids(self) -> set[str]:
        """The jobs with work here: waiting or in the engine."""
        return self.waiting.job_ids() | set(self._job_tasks)

    def cancel(self, job_id: str) -> int:
        """Cancel the job's work in the engine; returns how much."""
        tasks = self._job_tasks.get(job_id, set())
        for task in tasks:
            task.cancel()
        return len(tasks)

    def _below(self, shares: dict[str, int], tenant: str) -> bool:
        return self.tenant_in_engine.get(tenant, 0) < shares.get(tenant, 0)

    def _note_demand(self, tenant: str) -> None:
        """Keep the tenant's peak demand of the last `fair_share_grace_s`."""
        now = self._clock()
        demand = self.tenant_in_engine.get(tenant, 0) + self.waiting.waiting_of(tenant)
        peak, at = self._tenant_peak.get(tenant, (0, now))
        if demand >= peak or now - at > self._grace_s:
            self._tenant_peak[tenant] = (demand, now)

    def shares(self) -> dict[str, int]:
        """Slots each tenant may hold: `max_in_flight` water-filled over the tenants' demands
        (waiting + in the engine, or their peak within `fair_share_grace_s`, so a job between
        two steps keeps its claim), docs/architecture.md, "Rollout admission"."""
        now, grace = self._clock(), self._grace_s
        demands = {}
        for tenant, (peak, at) in list(self._tenant_peak.items()):
            current = self.tenant_in_engine.get(tenant, 0) + self.waiting.waiting_of(tenant)
            if now - at > grace and not current:
                del self._tenant_peak[tenant]
                continue
            demands[tenant] = max(current, peak if now - at <= grace else 0)
        return water_fill(demands, self.max_in_flight)
