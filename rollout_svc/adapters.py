"""The adapters a rollout replica samples with: each job's newest version, kept current.

Every replica reads every `AdapterUpdate` (broadcast), after a snapshot of Redis' pointers at
start-up; a request asking for a newer version than the broadcast brought reads the pointer.
A newer version is loaded before its first request needs it and the older one retired; an
evaluation's pinned older version leaves the engine with its last request.
"""

from __future__ import annotations

from pathlib import Path

from common.files.artifacts import unpublished
from common.runtime.service import Connections
from common.state.usage import UsageMeter
from common.wire.adapters import AdapterRef
from common.wire.messages import AdapterUpdate, GenerationRequest, GenerationResult
from rollout_svc.engine_protocol import GenerationEngine
from rollout_svc.jobs import JobsSeen


class JobAdapters:
    """Newest adapter version per job, loaded into the engine; versions resolved for requests."""

    def __init__(
        self, engine: GenerationEngine, io: Connections, jobs: JobsSeen, *, artifacts: Path
    ) -> None:
        """`artifacts`: where published adapters live (an update naming another place is
        ignored, common/files/artifacts.py `unpublished`)."""
        self._engine = engine
        self._io = io
        self._jobs = jobs
        self._artifacts = artifacts
        self.latest: dict[str, AdapterRef] = {}
        """Newest adapter version per job; only moves forward."""
        self.usage = UsageMeter()
        """The tokens generated, by job (common/state/usage.py); flushed by the service."""

    async def read_pointers(self) -> int:
        """Take every job's newest version from Redis (start-up); returns how many."""
        for job_id, pointer in (await self._io.require_store().adapters.all()).items():
            self.latest[job_id] = pointer.ref
            self._jobs.touch(job_id)
        return len(self.latest)

    async def on_adapter(self, update: AdapterUpdate) -> None:
        await self.take(update.ref)

    async def take(self, new: AdapterRef) -> None:
        """Sample the job with `new` from now on, if it is newer and the trainer's."""
        current = self.latest.get(new.job_id)
        if current is not None and current.version >= new.version:
            return
        store = self._io.require_store()
        if untrusted := await unpublished(store.adapters, new, artifacts=self._artifacts):
            (await self._jobs.job_log(new.job_id)).error("adapter update ignored: %s", untrusted)
            return
        self.latest[new.job_id] = new
        self._jobs.touch(new.job_id)
        await self._engine.load(new)  # loaded before its first request needs it
        if current is not None:
            await self._engine.retire(current.job_id, current.version)
        (await self._jobs.job_log(new.job_id)).info("job now samples with v%d", new.version)

    async def adapter_for(self, request: GenerationRequest) -> AdapterRef | None:
        """The version `request` is sampled with: its pinned one, else its job's newest."""
        if request.pinned_adapter_version >= 0:
            return await self.pinned(request.job_id, request.pinned_adapter_version)
        current = self.latest.get(request.job_id)
        if (current.version if current else 0) < request.min_adapter_version:
            # The broadcast has not reached this replica yet; Redis already has the pointer.
            pointer = await self._io.require_store().adapters.get(request.job_id)
            if pointer is not None:
                await self.take(pointer.ref)
        return self.latest.get(request.job_id)

    async def pinned(self, job_id: str, version: int) -> AdapterRef | None:
        """Exactly adapter `version` of the job (an evaluation's); 0 is the base model."""
        current = self.latest.get(job_id)
        if version == 0 or (current is not None and current.version == version):
            return current if version else None
        uri = await self._io.require_store().adapters.published_uri(job_id, version)
        if uri is None:
            raise ValueError(f"adapter v{version} of job {job_id} was never published")
        return AdapterRef(job_id, version, uri, step=version)

    async def generate_with(
        self, request: GenerationRequest, adapter: AdapterRef | None, *, chat_for: str | None = None
    ) -> GenerationResult:
        """Sample `request` with `adapter`; an older version leaves the engine after it. The
        tokens are counted as the request's job's (training or evaluation), or for a chat as
        `chat_for`'s ("": of no job)."""
        try:
            result = await self._engine.generate(request, adapter)
        finally:
            if adapter is not None:
                await self._retire_if_old(adapter)
        tokens = len(result.completion_token_ids)
        if chat_for is not None:
            tenant = await self._jobs.tenant_of(chat_for) if chat_for else ""
            self.usage.add(chat_for, tenant, chat_tokens=tokens)
        else:
            kind = "eval_tokens" if request.pinned_adapter_version >= 0 else "tokens"
            tenant = request.tenant or await self._jobs.tenant_of(request.job_id)
            self.usage.add(request.job_id, tenant, **{kind: tokens})
        return result

    async def _retire_if_old(self, adapter: AdapterRef) -> None:
        """An older version loaded for an evaluation leaves the engine with its last request."""
        current = self.latest.get(adapter.job_id)
        if current is None or current.version != adapter.version:
            await self._engine.retire(adapter.job_id, adapter.version)

    async def forget(self, job_ids: list[str]) -> None:
        """Forget the jobs' newest versions; each leaves the engine."""
        for job_id in job_ids:
            if (adapter := self.latest.pop(job_id, None)) is not None:
                await self._engine.retire(adapter.job_id, adapter.version)
