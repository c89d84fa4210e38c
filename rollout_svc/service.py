"""rollout_svc: sample every job's requests in one engine, each with its job's newest adapter.

Prompts come from a consumer group (replicas split the partitions); adapter updates are read
by every replica (broadcast), after a snapshot of Redis' pointers at start-up. A prompt's
offset is committed only once its result is on `marlaas.rollouts`.

`RolloutService` wires the parts: the intake (rollout_svc/intake.py: reading, read-ahead,
held commits), fair admission into the engine's slots (rollout_svc/slots.py), the adapters
(rollout_svc/adapters.py), the jobs seen (rollout_svc/jobs.py), stopped jobs
(rollout_svc/stopped.py), the chat endpoint's samples (rollout_svc/chat_sampling.py) and the
stats report (rollout_svc/stats.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

from common.bus.broadcast import BroadcastReader
from common.bus.kafka import ConsumerLoop, Delivery
from common.bus.sender import Sender
from common.runtime.backoff import is_transient
from common.runtime.config import RolloutSettings, SharedSettings
from common.runtime.hardware import detect
from common.runtime.health import redis_ready
from common.runtime.metrics import (
    ROLLOUT_ADAPTERS_LOADED,
    ROLLOUT_REQUESTS_IN_FLIGHT,
    export_service_metrics,
)
from common.runtime.service import Connections, Service, announce_runtime, runtime_fields, wait_any
from common.state.store import RedisStore
from common.state.usage import flush_usage
from common.wire.adapters import AdapterRef
from common.wire.chat import CHAT
from common.wire.messages import AdapterUpdate, GenerationRequest, GenerationResult, Topic
from rollout_svc.adapters import JobAdapters
from rollout_svc.chat_api import ChatAPI
from rollout_svc.chat_sampling import ChatSampling
from rollout_svc.engine_protocol import GenerationEngine
from rollout_svc.intake import SERVICE, Intake
from rollout_svc.jobs import JobsSeen
from rollout_svc.slots import EngineSlots
from rollout_svc.stats import StatsReport
from rollout_svc.stopped import StoppedJobs

__all__ = ["GenerationEngine", "RolloutService"]

log = logging.getLogger(__name__)

ENGINE_LOOK_S = 5.0
"""How often the replica looks whether its engine is still alive while no request fails."""
STOPPED_LOOK_S = 1.0
"""How often the replica looks whether the jobs it has work of have stopped."""


class RolloutService(Service):
    name = SERVICE

    def __init__(
        self,
        shared: SharedSettings,
        settings: RolloutSettings,
        engine: GenerationEngine,
        *,
        producer: Sender | None = None,
        store: RedisStore | None = None,
    ) -> None:
        self.shared, self.settings, self.engine = shared, settings, engine
        self.replica = f"{socket.gethostname()}-{os.getpid()}"
        self.io = Connections(shared, SERVICE, producer=producer, store=store)
        self.producer = self.io.producer
        self.consumer: ConsumerLoop[GenerationRequest] | None = None
        self.clock: Callable[[], float] = time.monotonic
        self._started_at = time.monotonic()
        self._stopping = asyncio.Event()
        self._engine_died = asyncio.Event()
        self.jobs = JobsSeen(lambda: self.io.store)
        self.adapters = JobAdapters(engine, self.io, self.jobs, artifacts=shared.artifacts)
        self.updates = BroadcastReader[AdapterUpdate](
            bootstrap=shared.kafka_bootstrap,
            topic=Topic.ADAPTERS,
            handler=self.adapters.on_adapter,
            service=SERVICE,
            signing=shared.signer,
        )
        self.slots = EngineSlots(
            settings.max_in_flight,
            settings.fair_share_grace_s,
            closed=lambda: self._stopping.is_set() or self._engine_died.is_set(),
            clock=lambda: self.clock(),
        )
        self.stopped = StoppedJobs(
            lambda jobs: self.io.require_store().jobs.statuses(jobs), lambda: self.clock()
        )
        self.intake = Intake(
            engine,
            self.io,
            self.slots,
            self.adapters,
            self.jobs,
            self.stopped,
            stopping=self._stopping,
            engine_died=self._engine_died,
        )
        self.chat_sampling = ChatSampling(
            self.io, self.slots, self.adapters, self.jobs, self.stopped
        )
        self.chat: ChatAPI | None = None
        self.stats = StatsReport(
            engine, self.replica, settings.max_model_len, lambda: self._started_at
        )
        export_service_metrics(SERVICE)
        # Read at scrape time: both change with every request.
        ROLLOUT_REQUESTS_IN_FLIGHT.set_function(lambda: engine.in_flight)
        ROLLOUT_ADAPTERS_LOADED.set_function(lambda: engine.loaded_adapters)

    @property
    def latest(self) -> dict[str, AdapterRef]:
        """Newest adapter version per job (rollout_svc/adapters.py)."""
        return self.adapters.latest

    async def start(self) -> None:
        await self.io.open()
        await self.updates.start(timeout_s=self.shared.connect_timeout_s)
        count = await self.adapters.read_pointers()
        log.info("rollout_svc: %d adapters from Redis at start-up", count)
        await self.engine.start()
        if self.settings.api_port is not None:
            self.chat = await self._start_chat(self.settings.api_port)
        self.consumer = await self.io.consume(
            SERVICE, self.settings.consumer_group, self.on_request
        )
        self._started_at = time.monotonic()

    async def _start_chat(self, port: int) -> ChatAPI:
        from transformers import AutoTokenizer

        from common.files.models import resolve_tokenizer

        directory = await asyncio.to_thread(
            resolve_tokenizer, self.shared.base_model, self.shared.cache_dir
        )
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(directory))
        chat = ChatAPI(
            tokenizer,
            self.sample_for_chat,
            lambda: list(self.adapters.latest),
            host=self.shared.metrics_host,
            port=port,
            token=self.shared.internal_token(CHAT),
        )
        await chat.start()
        return chat

    async def sample_for_chat(
        self, request: GenerationRequest, job_id: str, version: int | None, for_job: str = ""
    ) -> GenerationResult:
        """One chat completion (rollout_svc/chat_sampling.py `ChatSampling.sample`)."""
        return await self.chat_sampling.sample(request, job_id, version, for_job)

    async def on_request(self, request: GenerationRequest, delivery: Delivery) -> None:
        """Hold the request's commit and queue it (rollout_svc/intake.py `Intake.on_request`)."""
        await self.intake.on_request(request, delivery)

    async def on_adapter(self, update: AdapterUpdate) -> None:
        """Take a job's newer adapter version (rollout_svc/adapters.py)."""
        await self.adapters.on_adapter(update)

    def tasks(self) -> dict[str, Coroutine[Any, Any, None]]:
        assert self.consumer is not None
        return {
            "rollout-consume": self.consumer.run(),
            "rollout-adapters": self.updates.run(),
            "rollout-stats": self.stats.run(
                self.io.require_store(), self._stopping, self.forget_idle
            ),
            "rollout-engine": self._watch_engine(),
            "rollout-usage": self.adapters.usage.run(
                lambda: self.io.require_store().usage, self._stopping
            ),
            "rollout-stopped": self._watch_stopped_jobs(),
            "rollout-runtime": announce_runtime(
                self.io,
                SERVICE,
                self.replica,
                self._runtime_fields,
                self._stopping,
            ),
        }

    def _runtime_fields(self) -> dict[str, str]:
        """The engine's hardware and precision (an engine other than vLLM's reports none)."""
        hardware = getattr(self.engine, "hardware", None) or detect(gpus=False)
        return runtime_fields(hardware, getattr(self.engine, "precision", None))

    async def _watch_engine(self, look_every_s: float = ENGINE_LOOK_S) -> None:
        """End the replica when its engine dies: a restart serves the requests it held (their
        offsets were not committed), where staying up would fail every request it reads. A
        request failing says so at once; an engine that died idle (its core process killed,
        say by the kernel's OOM killer) only in its state, looked at every `look_every_s`:
        the replica stayed up, unready, and no orchestrator restarts an unready container.
        Returns when the replica stops."""
        while not self._stopping.is_set():
            if self._engine_died.is_set() or not self.engine.ready:
                self._engine_died.set()
                raise RuntimeError("the generation engine died; the replica stops to be restarted")
            await wait_any(self._engine_died, self._stopping, timeout_s=look_every_s)

    def request_stop(self) -> None:
        self._stopping.set()
        self.updates.stop()
        if self.consumer is not None:
            self.consumer.stop()

    async def stop(self) -> None:
        self._stopping.set()  # nothing new enters the engine, also without request_stop()
        waiting = self.slots.waiting
        if waiting:  # their commits stay held: the next owner of the partition reads them
            log.info(
                "rollout_svc: %d requests not started are left to a restart (by tenant: %s)",
                len(waiting),
                waiting.waiting(),
            )
        if self.slots.generations:  # finish what is in the engine, so its results are not lost
            await asyncio.wait(self.slots.generations, timeout=30)
        if self.consumer is not None:
            await self.consumer.close()
        await self.updates.close()
        if self.chat is not None:
            await self.chat.stop()
        await self.engine.stop()
        await flush_usage(self.adapters.usage, self.io.store)
        await self.io.close()

    async def readiness(self) -> dict[str, bool]:
        return {
            "engine": self.engine.ready,
            "kafka": self.consumer is not None and await self.consumer.reachable(),
            "redis": await redis_ready(self.io.store),
        }

    async def drop_stopped(self) -> int:
        """Drop the work of the jobs here that have stopped (rollout_svc/stopped.py): their
        generations in the engine now, their waiting requests as their turns come (each
        released unserved). Returns the generations stopped."""
        stopped = 0
        for job_id in await self.stopped.look(self.slots.job_ids()):
            cancelled = self.slots.cancel(job_id)
            stopped += cancelled
            (await self.jobs.job_log(job_id)).info(
                "job stopped: %d generations stopped, its waiting requests released", cancelled
            )
        return stopped

    async def _watch_stopped_jobs(self, look_every_s: float = STOPPED_LOOK_S) -> None:
        while not await wait_any(self._stopping, timeout_s=look_every_s):
            try:
                await self.drop_stopped()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("stopped jobs not looked up (%r); next in %.0fs", exc, look_every_s)

    async def forget_idle(self, now: float) -> None:
        """Forget the jobs idle here for `IDLE_JOB_S` (monotonic `now`) with nothing waiting
        (rollout_svc/jobs.py); their newest adapters leave the engine."""
        await self.adapters.forget(self.jobs.forget_idle(now, self.slots.waiting.job_ids()))
