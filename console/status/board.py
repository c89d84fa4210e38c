"""`marlaas status`: every job's progress and the services' health, from Kafka and Redis only.

Job progress comes from `marlaas.events` (read from the start, then followed); job state,
flow-control counters and rollout replica stats from Redis; consumer lag from the broker.
Nothing here talks to a service, so it works from any machine that reaches both servers.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from common.state.registry import UnknownJobError
from common.state.store import RedisStore
from common.wire.lifecycle import CONSUMED_TOPICS
from common.wire.messages import Event, JobSpec
from console.stack.topics import group_lag
from console.status.load import TrainerBusy, TrainerLoad
from marlaas.eventfeed import EventFeed
from marlaas.jobwatch import JobProgress

RECENT_EVENTS = 200
"""Events kept per job for `marlaas status JOB` and `--json`."""


@dataclass
class JobRow:
    progress: JobProgress
    state: str
    """The registry's state when it knows the job (authoritative), else the events'."""
    in_flight_episodes: int
    """Episodes of groups issued but not yet trained or dropped."""
    recent_events: list[Event] = field(default_factory=list)

    def to_json(self, now: float) -> dict[str, Any]:
        p = self.progress
        return {
            "job_id": p.job_id,
            "tenant": p.tenant,
            "env": p.env,
            "state": self.state,
            "step": p.steps,
            "max_steps": p.max_steps,
            "latest_reward": p.latest_reward,
            "best_reward": p.best_reward,
            "rewards": p.rewards,
            "staleness": p.last_staleness,
            "max_staleness_seen": p.max_staleness_seen,
            "dropped_groups": p.dropped_groups,
            "in_flight_episodes": self.in_flight_episodes,
            "eta_s": p.eta_s(now),
            "reason": p.reason,
            "evals": {str(v): m for v, m in sorted(p.evals.items())},
            "learning": p.learning,
            "below_base": p.below_base,
        }


@dataclass(frozen=True)
class ServiceLag:
    service: str
    group: str
    lag: int
    """Records on the service's topics not yet committed by its consumer group."""


@dataclass(frozen=True)
class ReplicaRow:
    name: str
    utilisation: float
    """Share of its uptime the engine had at least one request running."""
    recent_utilisation: float | None
    """The same over the replica's last report interval (5 s); None from older replicas."""
    compute_utilisation: float | None
    """Share of its cores' time the engine computed since the replica started (None: not
    reported, or a GPU)."""
    recent_compute_utilisation: float | None
    """The same over the replica's last report interval."""
    mean_batch: float | None
    """Requests the engine held on average while busy, over the last report interval."""
    tokens_per_s: float | None
    """Generated tokens per second over the last report interval."""
    in_flight: int


@dataclass
class StatusSnapshot:
    jobs: list[JobRow]
    lags: list[ServiceLag]
    replicas: list[ReplicaRow]
    taken_at: float
    restarts: dict[str, int] = field(default_factory=dict)
    """Restarts of each service by the embedded stack's supervisor."""
    runtimes: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    """What each live replica computes on and in, by (service, replica)."""
    trainer: TrainerBusy = field(default_factory=lambda: TrainerBusy(None, None, 0))
    """The trainer's busy share, from its step events."""

    def computes_in(self, service: str) -> str:
        """`service`'s precision and hardware (each distinct one of its replicas'), or ""."""
        found = {
            f"{fields.get('precision', '-')} on {fields.get('hardware', '?')}"
            for (name, _), fields in self.runtimes.items()
            if name == service and "hardware" in fields  # env_svc's says what it serves
        }
        return "; ".join(sorted(found))

    def to_json(self) -> dict[str, Any]:
        return {
            "taken_at": self.taken_at,
            "jobs": [row.to_json(self.taken_at) for row in self.jobs],
            "services": [lag.__dict__ for lag in self.lags],
            "rollout_replicas": [replica.__dict__ for replica in self.replicas],
            "trainer": self.trainer.__dict__,
            "restarts": self.restarts,
            "runtimes": [
                {"service": service, "replica": replica, **fields}
                for (service, replica), fields in sorted(self.runtimes.items())
            ],
        }


class StatusBoard:
    """Keeps following events between refreshes, so a live view reads each event once."""

    def __init__(
        self,
        bootstrap: str,
        store: RedisStore,
        consumer_groups: dict[str, str],
        *,
        job_ids: Collection[str] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.bootstrap = bootstrap
        self.store = store
        self.consumer_groups = consumer_groups
        """Consumer group of each service, e.g. {"env_svc": "marlaas-env"}."""
        self.job_ids = set(job_ids) if job_ids else None
        self.timeout_s = timeout_s
        self._feed = EventFeed(bootstrap, self.job_ids, connect_timeout_s=timeout_s)
        self._progress: dict[str, JobProgress] = {}
        self._events: dict[str, deque[Event]] = {}
        self._trainer = TrainerLoad()

    async def start(self) -> None:
        await self._feed.start()
        self._apply(await self._feed.read_to_end(timeout_s=self.timeout_s * 3))

    async def stop(self) -> None:
        await self._feed.stop()

    async def __aenter__(self) -> StatusBoard:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def snapshot(self) -> StatusSnapshot:
        self._apply(await self._feed.poll(0.05))
        job_ids = self.job_ids or set(await self.store.jobs.ids()) | set(self._progress)
        rows = [await self._row(job_id) for job_id in sorted(job_ids)]
        if self.job_ids:
            for row, job_id in zip(rows, sorted(job_ids), strict=True):
                if row is None:
                    raise UnknownJobError(job_id)
        lags, replicas, restarts, runtimes = await asyncio.gather(
            self._lags(),
            self._replicas(),
            self.store.replicas.restarts(),
            self.store.replicas.runtimes(),
        )
        jobs = [row for row in rows if row is not None]
        jobs.sort(key=lambda row: (row.progress.done, row.progress.submitted_at))
        return StatusSnapshot(
            jobs=jobs,
            lags=lags,
            replicas=replicas,
            taken_at=time.time(),
            restarts=restarts,
            runtimes=runtimes,
            trainer=self._trainer.busy(time.time()),
        )

    def expect(self, specs: Collection[JobSpec]) -> None:
        """Jobs just submitted: shown as `pending` until env_svc has registered them."""
        for spec in specs:
            self._progress.setdefault(spec.job_id, JobProgress.of(spec))

    def _apply(self, events: list[Event]) -> None:
        for event in events:
            progress = self._progress.get(event.job_id)
            if progress is None:
                progress = JobProgress(event.job_id, event.tenant or "-", "-", 0)
                progress.submitted_at = event.at
                self._progress[event.job_id] = progress
            progress.apply(event)
            self._trainer.add(event)
            self._events.setdefault(event.job_id, deque(maxlen=RECENT_EVENTS)).append(event)

    async def _row(self, job_id: str) -> JobRow | None:
        record = await self.store.jobs.get(job_id)
        progress = self._progress.get(job_id)
        if record is None and progress is None:
            # Sent and bound to its tenant, not yet admitted by env_svc: pending.
            if (owner := (await self.store.jobs.claim_id(job_id, None)).owner) is None:
                return None
            progress = JobProgress(job_id, owner, "-", 0)
            self._progress[job_id] = progress
        if progress is None:
            progress = JobProgress.of(record.spec)  # type: ignore[union-attr]
            self._progress[job_id] = progress
        in_flight = 0
        state = progress.status
        if record is not None:
            spec = record.spec
            progress.tenant, progress.env, progress.max_steps = (
                spec.tenant,
                spec.env.name,
                spec.rl.max_steps,
            )
            state = record.status
            progress.submitted_at = spec.submitted_at or progress.submitted_at
            if state in ("running", "paused"):
                flow = await self.store.flow.state(job_id)
                in_flight = flow.untrained_groups(spec.rl.groups_per_step) * spec.rl.group_size
        return JobRow(progress, state, in_flight, list(self._events.get(job_id, ())))

    async def _lags(self) -> list[ServiceLag]:
        async def one(service: str, group: str) -> ServiceLag:
            partitions = await group_lag(
                self.bootstrap, group, CONSUMED_TOPICS[service], timeout_s=self.timeout_s
            )
            return ServiceLag(service, group, sum(max(p.lag, 0) for p in partitions))

        return list(await asyncio.gather(*(one(s, g) for s, g in self.consumer_groups.items())))

    async def _replicas(self) -> list[ReplicaRow]:
        return [
            ReplicaRow(
                name,
                utilisation=stats.utilisation or 0.0,
                recent_utilisation=stats.recent_utilisation,
                compute_utilisation=stats.compute_utilisation,
                recent_compute_utilisation=stats.recent_compute_utilisation,
                mean_batch=stats.mean_batch,
                tokens_per_s=stats.tokens_per_s,
                in_flight=int(stats.in_flight or 0),
            )
            for name, stats in sorted((await self.store.replicas.stats()).items())
        ]
