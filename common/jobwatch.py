"""Submitting jobs and following them through `marlaas.events` (demo, CLI, tests)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer

from common.bus import Producer
from common.messages import Event, JobSpec, MessageDecodeError, Topic, decode

FINAL_STATES = frozenset({"completed", "failed", "rejected", "cancelled"})


@dataclass
class JobProgress:
    """What the events of one job say so far."""

    job_id: str
    tenant: str
    env: str
    max_steps: int
    status: str = "submitted"
    steps: int = 0
    rewards: list[float] = field(default_factory=list)
    """Mean reward of each trained step, in step order."""
    max_staleness_seen: int = 0
    dropped_groups: int = 0
    reason: str = ""
    submitted_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    @classmethod
    def of(cls, spec: JobSpec) -> JobProgress:
        return cls(spec.job_id, spec.tenant, spec.env.name, spec.rl.max_steps)

    @property
    def done(self) -> bool:
        return self.status in FINAL_STATES

    @property
    def wall_s(self) -> float:
        return (self.finished_at or time.time()) - self.submitted_at

    def apply(self, event: Event) -> None:
        match event.event:
            case "step":
                self.steps = max(self.steps, event.step)
                self.rewards.append(event.metrics.get("mean_reward", float("nan")))
                staleness = int(event.metrics.get("staleness_max", 0))
                self.max_staleness_seen = max(self.max_staleness_seen, staleness)
                self.status = "running"
            case "dropped_stale" | "dropped_invalid":
                self.dropped_groups += 1
            case "accepted" | "resumed":
                self.status = "running"
            case _:
                self.status = event.event
                self.reason = event.reason
        if self.done:
            self.finished_at = event.at or time.time()

    def reward_window(self, first: bool, window: int) -> float | None:
        values = self.rewards[:window] if first else self.rewards[-window:]
        return sum(values) / len(values) if values else None

    def summary(self, window: int) -> dict[str, object]:
        return {
            "job_id": self.job_id,
            "tenant": self.tenant,
            "env": self.env,
            "status": self.status,
            "steps": self.steps,
            "reward_start": self.reward_window(True, window),
            "reward_end": self.reward_window(False, window),
            "max_staleness_seen": self.max_staleness_seen,
            "dropped_groups": self.dropped_groups,
            "wall_s": round(self.wall_s, 1),
            "rewards": self.rewards,
        }


async def submit_jobs(bootstrap: str, specs: Iterable[JobSpec], *, timeout_s: float = 60) -> None:
    producer = Producer(bootstrap, client_id="marlaas-cli")
    await producer.start(timeout_s=timeout_s)
    try:
        for spec in specs:
            await producer.send(spec)
    finally:
        await producer.stop()


async def watch_jobs(
    bootstrap: str,
    jobs: dict[str, JobProgress],
    *,
    timeout_s: float,
    on_event: Callable[[Event], None] | None = None,
) -> None:
    """Apply every event of `jobs` (from the topic's start) until all are done.

    Raises TimeoutError when they are not done within `timeout_s`.
    """
    consumer = AIOKafkaConsumer(
        Topic.EVENTS.value,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not all(job.done for job in jobs.values()):
            if time.monotonic() > deadline:
                pending = [j for j, p in jobs.items() if not p.done]
                raise TimeoutError(f"jobs not finished after {timeout_s:.0f}s: {pending}")
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    try:
                        event = decode(Topic.EVENTS, record.value)
                    except MessageDecodeError:
                        continue  # env_svc dead-letters those; a watcher just skips them
                    if isinstance(event, Event) and event.job_id in jobs:
                        jobs[event.job_id].apply(event)
                        if on_event is not None:
                            on_event(event)
            await asyncio.sleep(0)
    finally:
        await consumer.stop()
