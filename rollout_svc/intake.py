"""Rollout requests from `marlaas.prompts`: read ahead, held, served, and only then committed.

A request read holds its offset's commit and waits for an engine slot (rollout_svc/slots.py);
served, its result goes to `marlaas.rollouts` and only then may its offset be committed, so a
result that never reached the broker leaves its request to be read again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial

from common.bus.kafka import Delivery
from common.runtime.backoff import retry_transient
from common.runtime.faults import fault_point
from common.runtime.metrics import DEAD_LETTERS, ROLLOUT_GENERATED_TOKENS
from common.runtime.service import Connections
from common.state.flow import group_index_of
from common.wire.codec import dead_letter, encode
from common.wire.lifecycle import ServiceName
from common.wire.messages import (
    DeadLetter,
    GenerationRequest,
    GenerationResult,
    Topic,
    result_for,
)
from rollout_svc.adapters import JobAdapters
from rollout_svc.engine_protocol import GenerationEngine
from rollout_svc.jobs import JobsSeen
from rollout_svc.slots import EngineSlots
from rollout_svc.stopped import StoppedJobs

log = logging.getLogger(__name__)

SERVICE: ServiceName = "rollout_svc"
READ_AHEAD_PER_SLOT = 16
"""Requests read and waiting for an engine slot, per slot, before the poll loop stops reading
(docs/architecture.md, "Rollout admission"). Fair admission needs the waiting requests of every
tenant in hand, so the read-ahead must reach past one tenant's backlog: flow control already
caps each job at G x B x (S + 1) open episodes (one request each), and 16 x the default 64
slots (1,024) is a tenant's default `max_samples_in_flight` of them. The bound only caps
memory (a request is its context's token ids: ~40 MB per 1,000 requests of 1,000 tokens); a
longer backlog is served fairly within the read-ahead and in arrival order beyond it."""


def aborted(request: GenerationRequest) -> GenerationResult:
    """A result that tells env_svc this turn could not be sampled."""
    return result_for(
        request,
        completion_token_ids=[],
        logprobs=[],
        adapter_version=request.min_adapter_version,
        finish_reason="abort",
    )


class EngineDiedError(Exception):
    """The engine died under a request."""


class Intake:
    """Reads generation requests into the engine's slots and serves each once admitted."""

    def __init__(
        self,
        engine: GenerationEngine,
        io: Connections,
        slots: EngineSlots,
        adapters: JobAdapters,
        jobs: JobsSeen,
        stopped: StoppedJobs,
        *,
        stopping: asyncio.Event,
        engine_died: asyncio.Event,
    ) -> None:
        """`stopping`: set when the replica stops (the poll loop no longer waits for room);
        `engine_died`: set here when a request fails on an engine that is no longer ready."""
        self._engine, self._io = engine, io
        self._slots, self._adapters, self._jobs = slots, adapters, jobs
        self._stopped = stopped
        self._stopping, self._engine_died = stopping, engine_died
        self.read_ahead = READ_AHEAD_PER_SLOT * slots.max_in_flight

    async def on_request(self, request: GenerationRequest, delivery: Delivery) -> None:
        """Hold the request's commit and queue it by its job's tenant; the engine takes it
        when a slot frees and its turn comes (`EngineSlots.admit`)."""
        # Waiting here stops the poll loop: back-pressure instead of an unbounded buffer. A
        # stopping replica does not wait (nothing is admitted any more, so no room comes).
        while len(self._slots.waiting) >= self.read_ahead and not self._stopping.is_set():
            self._slots.room.clear()
            await self._room_or_stop()
        self._jobs.took(request)
        self._slots.queue(
            await self._jobs.tenant_of(request.job_id),
            request.job_id,
            partial(self.serve, request, delivery.hold_commit()),
            rank=group_index_of(request.job_id, request.group_id),  # None: an evaluation's
        )

    async def _room_or_stop(self) -> None:
        waits = {
            asyncio.ensure_future(self._slots.room.wait()),
            asyncio.ensure_future(self._stopping.wait()),
        }
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def serve(self, request: GenerationRequest, release_commit: Callable[[], None]) -> None:
        """Sample, send the result, and only then let the request's offset be committed: a
        result that never reached the broker leaves its request to be read again. A request
        of a job that has stopped is released unserved, also when its generation is stopped."""
        if request.job_id in self._stopped:
            release_commit()
            return
        try:
            result = await self._sample(request)
        except EngineDiedError:  # left uncommitted for the restarted replica
            log.warning("request %s not served: the engine died", request.request_id)
            return
        except asyncio.CancelledError:
            if request.job_id not in self._stopped:  # not stopped by `drop_stopped`
                raise
            release_commit()
            return
        ROLLOUT_GENERATED_TOKENS.inc(len(result.completion_token_ids))
        try:
            await self._io.send(result)
        except Exception as exc:  # the broker refuses it (e.g. too large): end the episode
            await self._give_up(request, exc)
            await self._io.send(aborted(request))
        fault_point("rollout.after_send")
        release_commit()

    async def _sample(self, request: GenerationRequest) -> GenerationResult:
        try:
            adapter = await retry_transient(
                f"adapter of {request.job_id}",
                lambda: self._adapters.adapter_for(request),
                logger=log,
            )
            return await self._adapters.generate_with(request, adapter)
        except Exception as exc:
            if not self._engine.ready:  # not this request's fault
                self._engine_died.set()
                raise EngineDiedError from exc
            await self._give_up(request, exc)
            return aborted(request)  # the episode ends with an error instead of hanging

    async def _give_up(self, request: GenerationRequest, exc: Exception) -> None:
        """Dead-letter a request that cannot be served (the episode ends with an error)."""
        (await self._jobs.job_log(request.job_id)).error(
            "request %s failed: %s", request.request_id, exc, exc_info=exc
        )
        await self._io.send(dead_letter_of(request, exc))
        DEAD_LETTERS.labels(SERVICE, Topic.PROMPTS).inc()


def dead_letter_of(request: GenerationRequest, exc: Exception) -> DeadLetter:
    return dead_letter(
        source_topic=Topic.PROMPTS,
        source_partition=-1,
        source_offset=-1,
        source_key=request.episode_id.encode(),
        raw_value=encode(request),
        error=f"{type(exc).__name__}: {exc}",
        service=SERVICE,
    )
