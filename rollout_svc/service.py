"""rollout_svc: sample every job's requests in one engine, each with its job's newest adapter.

Prompts come from a consumer group (replicas split the partitions); adapter updates are read
by every replica (broadcast), after a snapshot of Redis' pointers at start-up. A prompt's
offset is committed only once its result is on `marlaas.rollouts`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, Protocol

from common.bus.broadcast import BroadcastReader
from common.bus.kafka import ConsumerLoop, Delivery
from common.bus.sender import Sender
from common.files.artifacts import adapter_path, unpublished
from common.runtime.backoff import is_transient, retry_transient
from common.runtime.config import RolloutSettings, SharedSettings
from common.runtime.faults import fault_point
from common.runtime.hardware import detect
from common.runtime.health import redis_ready
from common.runtime.logs import job_logger
from common.runtime.metrics import (
    DEAD_LETTERS,
    ROLLOUT_ADAPTERS_LOADED,
    ROLLOUT_BUSY_FRACTION,
    ROLLOUT_GENERATED_TOKENS,
    ROLLOUT_REQUESTS_IN_FLIGHT,
    ROLLOUT_TOKENS_PER_SECOND,
    export_service_metrics,
)
from common.runtime.service import Connections, Service, announce_runtime, runtime_fields, wait_any
from common.state.flow import group_index_of
from common.state.store import RedisStore
from common.wire.chat import CHAT
from common.wire.codec import dead_letter, encode
from common.wire.lifecycle import RolloutReplicaStats, ServiceName
from common.wire.messages import (
    AdapterUpdate,
    DeadLetter,
    GenerationRequest,
    GenerationResult,
    Topic,
    result_for,
)
from rollout_svc.admission import FairQueue, water_fill
from rollout_svc.chat_api import ChatAPI
from rollout_svc.engine import AdapterRef
from rollout_svc.stopped import StoppedJobs

log = logging.getLogger(__name__)

SERVICE: ServiceName = "rollout_svc"
STATS_INTERVAL_S = 5.0
ENGINE_LOOK_S = 5.0
"""How often the replica looks whether its engine is still alive while no request fails."""
STOPPED_LOOK_S = 1.0
"""How often the replica looks whether the jobs it has work of have stopped."""
IDLE_JOB_S = 600.0
"""A job with no request here for this long (and none waiting) is forgotten: its newest
adapter leaves the engine and its entries go, which would otherwise pile up with every job
ever served. A later request of it reads its pointer again (`_adapter_for`)."""
READ_AHEAD_PER_SLOT = 16
"""Requests read and waiting for an engine slot, per slot, before the poll loop stops reading
(docs/architecture.md, "Rollout admission"). Fair admission needs the waiting requests of every
tenant in hand, so the read-ahead must reach past one tenant's backlog: flow control already
caps each job at G x B x (S + 1) open episodes (one request each), and 16 x the default 64
slots (1,024) is a tenant's default `max_samples_in_flight` of them. The bound only caps
memory (a request is its context's token ids: ~40 MB per 1,000 requests of 1,000 tokens); a
longer backlog is served fairly within the read-ahead and in arrival order beyond it."""


class GenerationEngine(Protocol):
    """What the service needs of its engine: `rollout_svc.engine.RolloutEngine` (vLLM), or
    a deterministic stand-in in handler tests."""

    @property
    def ready(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def loaded_adapters(self) -> int: ...

    @property
    def busy_seconds(self) -> float: ...

    @property
    def generated_tokens(self) -> int: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_prompt_tokens(self) -> int: ...

    @property
    def preemptions(self) -> int: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(
        self, request: GenerationRequest, adapter: AdapterRef | None = None
    ) -> GenerationResult: ...

    async def load(self, adapter: AdapterRef) -> None: ...

    async def retire(self, job_id: str, version: int) -> None: ...


def aborted(request: GenerationRequest) -> GenerationResult:
    """A result that tells env_svc this turn could not be sampled."""
    return result_for(
        request,
        completion_token_ids=[],
        logprobs=[],
        adapter_version=request.min_adapter_version,
        finish_reason="abort",
    )


class _EngineDied(Exception):
    """The engine died under a request."""


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
        self.shared = shared
        self.settings = settings
        self.engine = engine
        self.replica = f"{socket.gethostname()}-{os.getpid()}"
        self.io = Connections(shared, SERVICE, producer=producer, store=store)
        self.producer = self.io.producer
        self.consumer: ConsumerLoop[GenerationRequest] | None = None
        self.adapters = BroadcastReader[AdapterUpdate](
            bootstrap=shared.kafka_bootstrap,
            topic=Topic.ADAPTERS,
            handler=self.on_adapter,
            service=SERVICE,
            signing=shared.signer,
        )
        self.latest: dict[str, AdapterRef] = {}
        """Newest adapter version per job; only moves forward."""
        self._used_at: dict[str, float] = {}
        """When each job in `latest` (or `_tenants`) last had a request or an update here."""
        self._waiting: FairQueue[tuple[Callable[[], Awaitable[None]], str, str]] = FairQueue()
        """Work not yet in the engine, with its tenant and job: requests read (their commits
        held) and chat requests made for a job (a judge's). Each is served once admitted."""
        self._job_tasks: dict[str, set[asyncio.Task[None]]] = {}
        """Each job's work in the engine, stopped when the job stops."""

        self._tenant_in_engine: dict[str, int] = {}
        self._tenant_peak: dict[str, tuple[int, float]] = {}
        """Each tenant's recent peak demand (waiting + in the engine) and when it was seen: its
        claim on the slots for `fair_share_grace_s` (rollout_svc/admission.py `water_fill`)."""
        self.clock: Callable[[], float] = time.monotonic
        self.stopped = StoppedJobs(
            lambda jobs: self.io.require_store().job_statuses(jobs), lambda: self.clock()
        )
        self._read_ahead = READ_AHEAD_PER_SLOT * settings.max_in_flight
        self._room = asyncio.Event()
        """Set when a request left `_waiting`: a poll loop held back may read again."""
        self._in_engine = 0
        """Rollout requests admitted and not finished: at most `max_in_flight`."""
        self._generations: set[asyncio.Task[None]] = set()
        self._started_at = time.monotonic()
        self._stopping = asyncio.Event()
        self._engine_died = asyncio.Event()
        self.chat: ChatAPI | None = None
        self._slots_for_chat = asyncio.Semaphore(4)
        """Chat requests in the engine at once, beside (not out of) the rollouts' slots."""
        self._tenants: dict[str, str] = {}
        """Tenant of each job this replica logged about, read from the registry once."""
        export_service_metrics(SERVICE)
        # Read at scrape time: both change with every request.
        ROLLOUT_REQUESTS_IN_FLIGHT.set_function(lambda: engine.in_flight)
        ROLLOUT_ADAPTERS_LOADED.set_function(lambda: engine.loaded_adapters)

    async def start(self) -> None:
        await self.io.open()
        await self.adapters.start(timeout_s=self.shared.connect_timeout_s)
        for job_id, pointer in (await self.io.require_store().adapters()).items():
            self.latest[job_id] = AdapterRef(
                job_id, pointer.version, str(adapter_path(pointer.uri))
            )
            self._used_at[job_id] = time.monotonic()
        log.info("rollout_svc: %d adapters from Redis at start-up", len(self.latest))
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
            lambda: list(self.latest),
            host=self.shared.metrics_host,
            port=port,
            token=self.shared.internal_token(CHAT),
        )
        await chat.start()
        return chat

    async def sample_for_chat(
        self, request: GenerationRequest, job_id: str, version: int | None, for_job: str = ""
    ) -> GenerationResult:
        """One chat completion with the job's latest adapter (`version` None), exactly
        `version`, or the base model (no job); in the engine beside the rollouts. Made for a
        job (`for_job`: a judged reward's), it waits in the fair queue as that job's tenant's
        and takes one of the rollouts' slots; otherwise one of the endpoint's own few."""
        adapter: AdapterRef | None = None
        if job_id:
            store = self.io.require_store()
            if await store.job(job_id) is None:
                raise LookupError(f"unknown job {job_id!r}")
            if version is None:  # the pointer: newer than a broadcast this replica awaits
                pointer = await store.adapter(job_id)
                version = pointer.version if pointer is not None else 0
            try:
                adapter = await self._pinned(job_id, version)
            except ValueError as exc:
                raise LookupError(str(exc)) from None
        if for_job:
            return await self._admitted_for(for_job, request, adapter)
        async with self._slots_for_chat:
            return await self._generate_with(request, adapter)

    async def _admitted_for(
        self, job_id: str, request: GenerationRequest, adapter: AdapterRef | None
    ) -> GenerationResult:
        """Sample `request` once the fair queue admits it as `job_id`'s tenant's."""
        done: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()

        async def serve() -> None:
            try:
                if job_id in self.stopped:
                    raise LookupError(f"job {job_id!r} has stopped")
                done.set_result(await self._generate_with(request, adapter))
            except Exception as exc:
                done.set_exception(exc)
            except asyncio.CancelledError:  # its job stopped (`drop_stopped`)
                done.set_exception(LookupError(f"job {job_id!r} has stopped"))
                if job_id not in self.stopped:
                    raise

        self._queue(await self._tenant_of(job_id), job_id, serve, rank=None)
        return await done

    def tasks(self) -> dict[str, Coroutine[Any, Any, None]]:
        assert self.consumer is not None
        return {
            "rollout-consume": self.consumer.run(),
            "rollout-adapters": self.adapters.run(),
            "rollout-stats": self._report_stats(),
            "rollout-engine": self._watch_engine(),
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
        self.adapters.stop()
        if self.consumer is not None:
            self.consumer.stop()

    async def stop(self) -> None:
        self._stopping.set()  # nothing new enters the engine, also without request_stop()
        if self._waiting:  # their commits stay held: the next owner of the partition reads them
            log.info(
                "rollout_svc: %d requests not started are left to a restart (by tenant: %s)",
                len(self._waiting),
                self._waiting.waiting(),
            )
        if self._generations:  # finish what is in the engine, so its results are not lost
            await asyncio.wait(self._generations, timeout=30)
        if self.consumer is not None:
            await self.consumer.close()
        await self.adapters.close()
        if self.chat is not None:
            await self.chat.stop()
        await self.engine.stop()
        await self.io.close()

    async def readiness(self) -> dict[str, bool]:
        return {
            "engine": self.engine.ready,
            "kafka": self.consumer is not None and await self.consumer.reachable(),
            "redis": await redis_ready(self.io.store),
        }

    async def on_request(self, request: GenerationRequest, delivery: Delivery) -> None:
        """Hold the request's commit and queue it by its job's tenant; the engine takes it
        when a slot frees and its turn comes (`_admit`)."""
        # Waiting here stops the poll loop: back-pressure instead of an unbounded buffer. A
        # stopping replica does not wait (nothing is admitted any more, so no room comes).
        while len(self._waiting) >= self._read_ahead and not self._stopping.is_set():
            self._room.clear()
            await self._room_or_stop()
        self._used_at[request.job_id] = time.monotonic()
        if request.tenant:  # schema 4 on: carried, no registry read
            self._tenants.setdefault(request.job_id, request.tenant)
        self._queue(
            await self._tenant_of(request.job_id),
            request.job_id,
            partial(self._serve_rollout, request, delivery.hold_commit()),
            rank=group_index_of(request.job_id, request.group_id),  # None: an evaluation's
        )

    def _queue(
        self, tenant: str, job_id: str, serve: Callable[[], Awaitable[None]], *, rank: int | None
    ) -> None:
        """Queue `serve` as `tenant`'s (for `job_id`) and start what the free slots allow."""
        self._waiting.put(tenant, job_id, (serve, tenant, job_id), rank=rank)
        self._note_demand(tenant)
        self._admit()

    async def _room_or_stop(self) -> None:
        waits = {
            asyncio.ensure_future(self._room.wait()),
            asyncio.ensure_future(self._stopping.wait()),
        }
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    def _admit(self) -> None:
        """Start the next waiting requests (rollout_svc/admission.py: the rule) while engine
        slots are free. Called whenever either changes: a request queued, a generation ended.

        A stopping replica, or one whose engine died, starts none: their held commits are never
        released, so a restart reads them again."""
        while (
            self._waiting
            and self._in_engine < self.settings.max_in_flight
            and not self._stopping.is_set()
            and not self._engine_died.is_set()
        ):
            try:
                serve, tenant, job_id = self._waiting.pop(partial(self._below, self._shares()))
            except LookupError:  # every waiting tenant holds its share: keep the rest free
                return
            self._room.set()
            self._in_engine += 1
            self._tenant_in_engine[tenant] = self._tenant_in_engine.get(tenant, 0) + 1
            task = asyncio.create_task(self._in_engine_slot(serve, tenant), name="generate")
            self._generations.add(task)
            task.add_done_callback(self._generations.discard)
            tasks = self._job_tasks.setdefault(job_id, set())
            tasks.add(task)
            task.add_done_callback(partial(self._task_done, job_id))

    def _task_done(self, job_id: str, task: asyncio.Task[None]) -> None:
        tasks = self._job_tasks.get(job_id, set())
        tasks.discard(task)
        if not tasks:
            self._job_tasks.pop(job_id, None)

    async def drop_stopped(self) -> int:
        """Drop the work of the jobs here that have stopped (rollout_svc/stopped.py): their
        generations in the engine now, their waiting requests as their turns come (each
        released unserved). Returns the generations stopped."""
        jobs = await self.stopped.look(self._waiting.job_ids() | set(self._job_tasks))
        stopped = 0
        for job_id in jobs:
            tasks = self._job_tasks.get(job_id, set())
            for task in tasks:
                task.cancel()
            stopped += len(tasks)
            (await self._job_log(job_id)).info(
                "job stopped: %d generations stopped, its waiting requests released", len(tasks)
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

    def _below(self, shares: dict[str, int], tenant: str) -> bool:
        return self._tenant_in_engine.get(tenant, 0) < shares.get(tenant, 0)

    def _note_demand(self, tenant: str) -> None:
        """Keep the tenant's peak demand of the last `fair_share_grace_s`."""
        now = self.clock()
        demand = self._tenant_in_engine.get(tenant, 0) + self._waiting.waiting_of(tenant)
        peak, at = self._tenant_peak.get(tenant, (0, now))
        if demand >= peak or now - at > self.settings.fair_share_grace_s:
            self._tenant_peak[tenant] = (demand, now)

    def _shares(self) -> dict[str, int]:
        """Slots each tenant may hold: `max_in_flight` water-filled over the tenants' demands
        (waiting + in the engine, or their peak within `fair_share_grace_s`, so a job between
        two steps keeps its claim), docs/architecture.md, "Rollout admission"."""
        now, grace = self.clock(), self.settings.fair_share_grace_s
        demands = {}
        for tenant, (peak, at) in list(self._tenant_peak.items()):
            current = self._tenant_in_engine.get(tenant, 0) + self._waiting.waiting_of(tenant)
            if now - at > grace and not current:
                del self._tenant_peak[tenant]
                continue
            demands[tenant] = max(current, peak if now - at <= grace else 0)
        return water_fill(demands, self.settings.max_in_flight)

    async def _in_engine_slot(self, serve: Callable[[], Awaitable[None]], tenant: str) -> None:
        """Serve admitted work in its engine slot, then free the slot for the next."""
        try:
            await serve()
        finally:
            self._in_engine -= 1
            self._tenant_in_engine[tenant] = self._tenant_in_engine.get(tenant, 1) - 1
            self._note_demand(tenant)
            self._admit()

    async def _serve_rollout(
        self, request: GenerationRequest, release_commit: Callable[[], None]
    ) -> None:
        """Sample, send the result, and only then let the request's offset be committed: a
        result that never reached the broker leaves its request to be read again. A request
        of a job that has stopped is released unserved, also when its generation is stopped."""
        if request.job_id in self.stopped:
            release_commit()
            return
        try:
            result = await self._sample(request)
        except _EngineDied:  # left uncommitted for the restarted replica
            log.warning("request %s not served: the engine died", request.request_id)
            return
        except asyncio.CancelledError:
            if request.job_id not in self.stopped:  # not stopped by `drop_stopped`
                raise
            release_commit()
            return
        ROLLOUT_GENERATED_TOKENS.inc(len(result.completion_token_ids))
        try:
            await self.io.send(result)
        except Exception as exc:  # the broker refuses it (e.g. too large): end the episode
            await self._give_up(request, exc)
            await self.io.send(aborted(request))
        fault_point("rollout.after_send")
        release_commit()

    async def _sample(self, request: GenerationRequest) -> GenerationResult:
        try:
            adapter = await retry_transient(
                f"adapter of {request.job_id}", lambda: self._adapter_for(request), logger=log
            )
            return await self._generate_with(request, adapter)
        except Exception as exc:
            if not self.engine.ready:  # not this request's fault
                self._engine_died.set()
                raise _EngineDied from exc
            await self._give_up(request, exc)
            return aborted(request)  # the episode ends with an error instead of hanging

    async def _give_up(self, request: GenerationRequest, exc: Exception) -> None:
        """Dead-letter a request that cannot be served (the episode ends with an error)."""
        (await self._job_log(request.job_id)).error(
            "request %s failed: %s", request.request_id, exc, exc_info=exc
        )
        await self.io.send(self._dead_letter(request, exc))
        DEAD_LETTERS.labels(SERVICE, Topic.PROMPTS).inc()

    @staticmethod
    def _dead_letter(request: GenerationRequest, exc: Exception) -> DeadLetter:
        return dead_letter(
            source_topic=Topic.PROMPTS,
            source_partition=-1,
            source_offset=-1,
            source_key=request.episode_id.encode(),
            raw_value=encode(request),
            error=f"{type(exc).__name__}: {exc}",
            service=SERVICE,
        )

    async def _adapter_for(self, request: GenerationRequest) -> AdapterRef | None:
        if request.pinned_adapter_version >= 0:
            return await self._pinned(request.job_id, request.pinned_adapter_version)
        current = self.latest.get(request.job_id)
        if (current.version if current else 0) < request.min_adapter_version:
            # The broadcast has not reached this replica yet; Redis already has the pointer.
            pointer = await self.io.require_store().adapter(request.job_id)
            if pointer is not None:
                await self.on_adapter(
                    AdapterUpdate(
                        job_id=pointer.job_id,
                        version=pointer.version,
                        uri=pointer.uri,
                        step=pointer.step,
                    )
                )
        return self.latest.get(request.job_id)

    async def _pinned(self, job_id: str, version: int) -> AdapterRef | None:
        """Exactly adapter `version` of the job (an evaluation's); 0 is the base model."""
        current = self.latest.get(job_id)
        if version == 0 or (current is not None and current.version == version):
            return current if version else None
        uri = await self.io.require_store().published_uri(job_id, version)
        if uri is None:
            raise ValueError(f"adapter v{version} of job {job_id} was never published")
        return AdapterRef(job_id, version, str(adapter_path(uri)))

    async def _generate_with(
        self, request: GenerationRequest, adapter: AdapterRef | None
    ) -> GenerationResult:
        try:
            return await self.engine.generate(request, adapter)
        finally:
            if adapter is not None:
                await self._retire_if_old(adapter)

    async def _retire_if_old(self, adapter: AdapterRef) -> None:
        """An older version loaded for an evaluation leaves the engine with its last request."""
        current = self.latest.get(adapter.job_id)
        if current is None or current.version != adapter.version:
            await self.engine.retire(adapter.job_id, adapter.version)

    async def on_adapter(self, update: AdapterUpdate) -> None:
        current = self.latest.get(update.job_id)
        if current is not None and current.version >= update.version:
            return
        store = self.io.require_store()
        if untrusted := await unpublished(store, update, artifacts=self.shared.artifacts):
            (await self._job_log(update.job_id)).error("adapter update ignored: %s", untrusted)
            return
        new = AdapterRef(update.job_id, update.version, str(adapter_path(update.uri)))
        self.latest[update.job_id] = new
        self._used_at[update.job_id] = time.monotonic()
        await self.engine.load(new)  # loaded before its first request needs it
        if current is not None:
            await self.engine.retire(current.job_id, current.version)
        (await self._job_log(update.job_id)).info("job now samples with v%d", update.version)

    async def forget_idle(self, now: float) -> None:
        """Forget the jobs idle here for `IDLE_JOB_S` (monotonic `now`) with nothing waiting."""
        waiting = self._waiting.job_ids()
        idle = [j for j, at in self._used_at.items() if now - at > IDLE_JOB_S and j not in waiting]
        for job_id in idle:
            del self._used_at[job_id]
            self._tenants.pop(job_id, None)
            if (adapter := self.latest.pop(job_id, None)) is not None:
                await self.engine.retire(adapter.job_id, adapter.version)

    async def _job_log(self, job_id: str) -> logging.LoggerAdapter[logging.Logger]:
        """A logger tagged with the job and its tenant."""
        return job_logger(log, job_id, await self._tenant_of(job_id) or None)

    async def _tenant_of(self, job_id: str) -> str:
        """The job's tenant: the one its requests carry, else from the registry (one read per
        job, ever, for requests of writers before schema 4); "" while unknown.

        "" is a tenant of its own for admission. An unregistered job, or a registry that
        does not answer, is asked again next time: neither logging nor admission fails on it."""
        if job_id not in self._tenants and self.io.store is not None:
            try:
                record = await self.io.store.job(job_id)
            except Exception as exc:
                log.debug("no tenant for job %s: %r", job_id, exc)
                record = None
            if record is not None:
                self._tenants[job_id] = record.spec.tenant
                self._used_at.setdefault(job_id, time.monotonic())
        return self._tenants.get(job_id, "")

    async def _report_stats(self) -> None:
        store = self.io.require_store()
        engine = self.engine
        last_at, last_busy_s, last_tokens = (
            time.monotonic(),
            engine.busy_seconds,
            engine.generated_tokens,
        )
        while not self._stopping.is_set():
            # Over the last interval, not since start: the dashboards' "now".
            now, busy_s, tokens = time.monotonic(), engine.busy_seconds, engine.generated_tokens
            interval = now - last_at
            recent_busy = (busy_s - last_busy_s) / interval if interval > 0 else 0.0
            recent_tokens_per_s = (tokens - last_tokens) / interval if interval > 0 else 0.0
            ROLLOUT_BUSY_FRACTION.set(recent_busy)
            ROLLOUT_TOKENS_PER_SECOND.set(recent_tokens_per_s)
            last_at, last_busy_s, last_tokens = now, busy_s, tokens
            uptime = now - self._started_at
            stats = RolloutReplicaStats(
                busy_s=busy_s,
                uptime_s=uptime,
                utilisation=busy_s / uptime if uptime > 0 else 0.0,
                recent_utilisation=recent_busy,
                generated_tokens=float(tokens),
                prompt_tokens=float(engine.prompt_tokens),
                cached_prompt_tokens=float(engine.cached_prompt_tokens),
                preemptions=float(engine.preemptions),
                tokens_per_s=recent_tokens_per_s,
                in_flight=float(engine.in_flight),
                max_model_len=float(self.settings.max_model_len),
            )
            try:
                await store.put_replica_stats(self.replica, stats, ttl_s=60)
            except Exception as exc:  # telemetry: a Redis restart skips a report, no more
                if not is_transient(exc):
                    raise
                log.warning(
                    "rollout stats not published (%r); next try in %.0fs", exc, STATS_INTERVAL_S
                )
            await self.forget_idle(now)
            try:
                await asyncio.wait_for(self._stopping.wait(), STATS_INTERVAL_S)
            except TimeoutError:
                pass
