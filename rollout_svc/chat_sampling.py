"""The chat endpoint's samples in the rollouts' engine (rollout_svc/chat_api.py serves them).

A completion names a job's latest adapter, an exact version, or the base model. Made for a
job (a judged reward's, env_svc/judge.py), it waits in the fair queue as that job's tenant's
and takes one of the rollouts' slots; otherwise one of the endpoint's own few.
"""

from __future__ import annotations

import asyncio

from common.runtime.service import Connections
from common.wire.adapters import AdapterRef
from common.wire.messages import GenerationRequest, GenerationResult
from rollout_svc.adapters import JobAdapters
from rollout_svc.jobs import JobsSeen
from rollout_svc.slots import EngineSlots
from rollout_svc.stopped import StoppedJobs

CHAT_SLOTS = 4
"""Chat requests in the engine at once, beside (not out of) the rollouts' slots."""


class ChatSampling:
    """Samples one chat completion with the adapter it names, admitted as its job's tenant's."""

    def __init__(
        self,
        io: Connections,
        slots: EngineSlots,
        adapters: JobAdapters,
        jobs: JobsSeen,
        stopped: StoppedJobs,
    ) -> None:
        self._io, self._slots, self._adapters = io, slots, adapters
        self._jobs, self._stopped = jobs, stopped
        self._own_slots = asyncio.Semaphore(CHAT_SLOTS)

    async def sample(
        self, request: GenerationRequest, job_id: str, version: int | None, for_job: str = ""
    ) -> GenerationResult:
        """One chat completion with the job's latest adapter (`version` None), exactly
        `version`, or the base model (no job); in the engine beside the rollouts. Made for a
        job (`for_job`: a judged reward's), it waits in the fair queue as that job's tenant's
        and takes one of the rollouts' slots; otherwise one of the endpoint's own few."""
        adapter = await self._adapter(job_id, version) if job_id else None
        if for_job:
            return await self._admitted_for(for_job, request, adapter)
        async with self._own_slots:
            return await self._adapters.generate_with(request, adapter, chat_for=job_id)

    async def _adapter(self, job_id: str, version: int | None) -> AdapterRef | None:
        """The job's adapter `version` (None: its pointer's); LookupError when there is none."""
        store = self._io.require_store()
        if await self._jobs.job(job_id) is None:  # known here, or found so lately: no read
            raise LookupError(f"unknown job {job_id!r}")
        if version is None:  # the pointer: newer than a broadcast this replica awaits
            pointer = await store.adapters.get(job_id)
            version = pointer.version if pointer is not None else 0
        try:
            return await self._adapters.pinned(job_id, version)
        except ValueError as exc:
            raise LookupError(str(exc)) from None

    async def _admitted_for(
        self, job_id: str, request: GenerationRequest, adapter: AdapterRef | None
    ) -> GenerationResult:
        """Sample `request` once the fair queue admits it as `job_id`'s tenant's."""
        done: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()

        async def serve() -> None:
            try:
                if job_id in self._stopped:
                    raise LookupError(f"job {job_id!r} has stopped")
                done.set_result(
                    await self._adapters.generate_with(request, adapter, chat_for=job_id)
                )
            except Exception as exc:
                done.set_exception(exc)
            except asyncio.CancelledError:  # its job stopped (`drop_stopped`)
                done.set_exception(LookupError(f"job {job_id!r} has stopped"))
                if job_id not in self._stopped:
                    raise

        self._slots.queue(await self._jobs.tenant_of(job_id), job_id, serve, rank=None)
        return await done
