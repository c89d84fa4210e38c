"""trainer_svc: assemble groups, drop stale ones, train one GRPO step per B groups, publish.

Trajectories are keyed by job, so each job's trajectories reach one replica, which owns the
job's adapter and optimizer. A trajectory's offset stays uncommitted (held) until its group
was trained and the step is durable (checkpoint + Redis pointer), or the group was dropped.

The service wires its parts: `Intake` (trajectories in, groups assembled, jobs taken on),
`Batching` (which jobs a step takes, unusable groups dropped), `Stepper` (train, save),
`Publisher` (pointer, AdapterUpdate, events, metrics), all over one `Roster` (the jobs this
replica owns and how it lets them go).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka.structs import TopicPartition

from common.bus.kafka import ConsumerLoop, Delivery
from common.bus.sender import Sender
from common.runtime.config import SharedSettings, TrainerSettings
from common.runtime.hardware import Precision, detect
from common.runtime.health import redis_ready
from common.runtime.metrics import export_service_metrics
from common.runtime.service import Connections, Service, announce_runtime, runtime_fields
from common.state.store import RedisStore
from common.state.usage import flush_usage
from common.wire.messages import Topic, Trajectory
from trainer_svc.batching import Batching
from trainer_svc.checkpoints import CheckpointStore
from trainer_svc.compute import ComputeThread
from trainer_svc.intake import Intake
from trainer_svc.owned import OwnedJob
from trainer_svc.policy import MultiAdapterPolicy
from trainer_svc.publish import Publisher
from trainer_svc.roster import SERVICE, Roster
from trainer_svc.step import Stepper


class TrainerService(Service):
    name = SERVICE

    def __init__(
        self,
        shared: SharedSettings,
        settings: TrainerSettings,
        load_policy: Callable[[], MultiAdapterPolicy],
        *,
        producer: Sender | None = None,
        store: RedisStore | None = None,
        precision: Precision | None = None,
        compute: ComputeThread | None = None,
    ) -> None:
        """`load_policy` loads the base model; `start()` calls it in a thread.

        `producer` / `store`: given (tests), they are used as they are; else `start()`
        connects to Kafka and Redis. `precision`: what the policy computes in and why, for
        this replica's runtime record (`marlaas status`). `compute`: the thread every model
        call runs on (trainer_svc/compute.py; default: one on this process's cores)."""
        self.shared = shared
        self.settings = settings
        self.precision = precision
        self.replica = f"{socket.gethostname()}-{os.getpid()}"
        self._load_policy = load_policy
        self.compute = compute or ComputeThread(set(), set(), 0)
        self._policy: MultiAdapterPolicy | None = None
        export_service_metrics(SERVICE)
        self.artifacts = shared.artifacts
        self.checkpoints = CheckpointStore(self.artifacts)
        self.io = Connections(shared, SERVICE, producer=producer, store=store)
        self.producer = self.io.producer
        self.consumer: ConsumerLoop[Trajectory] | None = None
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self.roster = Roster(self.io, settings, lambda: self.policy)
        self.publisher = Publisher(self.roster, self.checkpoints)
        self.intake = Intake(
            self.roster, self.publisher, self.checkpoints, self.compute, self._wake
        )
        self.batching = Batching(self.roster, self._caught_up)
        self.stepper = Stepper(self.roster, self.publisher, self.checkpoints, self.compute)
        self.usage = self.stepper.usage

    @property
    def policy(self) -> MultiAdapterPolicy:
        if self._policy is None:
            raise RuntimeError("trainer_svc: base model not loaded")
        return self._policy

    @property
    def jobs(self) -> dict[str, OwnedJob]:
        """The jobs this replica trains now."""
        return self.roster.jobs

    async def start(self) -> None:
        await self.load_model()
        await self.io.open()
        self.consumer = await self.io.consume(
            SERVICE,
            self.settings.consumer_group,
            self.on_trajectory,
            on_revoked=self.on_revoked,
            sticky=True,
        )

    async def load_model(self) -> None:
        if self._policy is None:
            self._policy = await self.compute.run(self._load_policy)

    def tasks(self) -> dict[str, Coroutine[Any, Any, None]]:
        assert self.consumer is not None
        return {
            "trainer-consume": self.consumer.run(),
            "trainer-usage": self.usage.run(lambda: self.io.require_store().usage, self._stopping),
            "trainer-steps": self.train_loop(),
            "trainer-runtime": announce_runtime(
                self.io,
                SERVICE,
                self.replica,
                lambda: runtime_fields(detect(), self.precision),
                self._stopping,
            ),
        }

    def request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self.consumer is not None:
            self.consumer.stop()

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.close()
        await flush_usage(self.usage, self.io.store)
        await self.io.close()

    async def readiness(self) -> dict[str, bool]:
        return {
            "model": self._policy is not None,
            "kafka": self.consumer is not None and await self.consumer.reachable(),
            "redis": await redis_ready(self.io.store),
        }

    async def on_trajectory(self, trajectory: Trajectory, delivery: Delivery) -> None:
        await self.intake.on_trajectory(trajectory, delivery)

    async def on_revoked(self, partitions: set[TopicPartition]) -> None:
        await self.intake.on_revoked(partitions)

    async def train_loop(self) -> None:
        swept_at = time.monotonic()
        while not self._stopping.is_set():
            if time.monotonic() - swept_at > self.settings.sweep_interval_s:
                await self.sweep_finished()
                swept_at = time.monotonic()
            if await self.train_once():
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 1.0)
            except TimeoutError:
                pass

    async def train_once(self) -> bool:
        """Drop unusable groups, then train one step of every job that has B groups ready
        (up to `max_jobs_per_step`), all of them in shared forward/backward passes.

        Returns whether a step ran.
        """
        async with self.roster.stepping:
            jobs = await self.batching.ready_jobs()
            if not jobs:
                return False
            await self.stepper.step(jobs)
            return True

    async def sweep_finished(self) -> None:
        """Let go of jobs that ended elsewhere; drop lost groups of jobs that stopped moving
        (`Batching.sweep_finished`)."""
        await self.batching.sweep_finished()

    async def _caught_up(self, partition: int) -> bool:
        """Whether this replica has read the partition's trajectories to its end."""
        if self.consumer is None:
            return True
        return await self.consumer.caught_up(Topic.TRAJECTORIES.value, partition)
