"""env_svc: accept jobs, issue groups within the staleness bound, step episodes.

Stateless replicas in one consumer group: episode state travels in the messages, flow-control
counters and the job registry live in Redis, so any replica can handle any record. The work
is done by the parts in env_svc/jobs/; `EnvService` wires them to the bus and runs the sweep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Coroutine
from typing import Any

from common.bus.kafka import ConsumerLoop, Delivery
from common.bus.sender import Sender
from common.files.artifacts import unpublished
from common.runtime.backoff import is_transient
from common.runtime.config import EnvServiceSettings, SharedSettings
from common.runtime.health import redis_ready
from common.runtime.service import Connections, Service, announce_runtime, wait_any
from common.state.registry import REJECTION_TTL_S
from common.state.replicas import ENVIRONMENTS_FIELD
from common.state.store import RedisStore
from common.state.usage import UsageMeter, flush_usage
from common.wire.messages import (
    AdapterUpdate,
    GenerationResult,
    GroupDropped,
    JobCommand,
    JobSpec,
    Message,
    MessageDecodeError,
)
from env_svc.calls import EnvCalls
from env_svc.chat_template import ChatTokenizer
from env_svc.jobs import SERVICE
from env_svc.jobs.admission import Admission
from env_svc.jobs.commands import LifecycleCommands
from env_svc.jobs.environments import JobEnvironments
from env_svc.jobs.evaluations import Evaluations
from env_svc.jobs.issuing import GroupIssuer
from env_svc.jobs.retirement import Retirement, working_state_keys
from env_svc.jobs.scoring import ResultScorer
from env_svc.jobs.sweep import Sweep
from env_svc.mcp import close_mcp_hub
from env_svc.protocol import available_environments

__all__ = ["SERVICE", "EnvService", "working_state_keys"]

log = logging.getLogger(__name__)


class EnvService(Service):
    name = SERVICE

    def __init__(
        self,
        shared: SharedSettings,
        settings: EnvServiceSettings,
        tokenizer: ChatTokenizer,
        *,
        producer: Sender | None = None,
        store: RedisStore | None = None,
    ) -> None:
        self.shared = shared
        self.settings = settings
        self.tokenizer = tokenizer
        self.io = Connections(shared, SERVICE, producer=producer, store=store)
        self.replica = f"{socket.gethostname()}-{os.getpid()}"
        self.consumer: ConsumerLoop[Message] | None = None
        self._stopping = asyncio.Event()
        self.calls = EnvCalls(timeout_s=settings.env_call_timeout_s, workers=settings.env_workers)
        self.environments = JobEnvironments(self.calls, tokenizer)
        self.usage = UsageMeter()
        """The episodes finished, by job (common/state/usage.py)."""
        self._wire(shared, settings)

    def _wire(self, shared: SharedSettings, settings: EnvServiceSettings) -> None:
        io, environments = self.io, self.environments
        self.issuer = GroupIssuer(io, environments, claim_timeout_s=settings.claim_timeout_s)
        self.evaluations = Evaluations(io, environments, eval_timeout_s=settings.eval_timeout_s)
        self.admission = Admission(
            shared, io, environments, issuer=self.issuer, evaluations=self.evaluations
        )
        self.scorer = ResultScorer(io, environments, self.evaluations, self.usage)
        self.commands = LifecycleCommands(io, self.issuer)
        self.sweep = Sweep(
            io,
            environments,
            issuer=self.issuer,
            evaluations=self.evaluations,
            retirement=Retirement(io),
        )

    async def start(self) -> None:
        asyncio.get_running_loop().set_default_executor(self.calls.executor)
        await self.io.open()
        if (taken := await self.io.require_store().jobs.backfill_active()) is not None:
            log.info("active jobs and tenants' counters filled from %d registered jobs", taken)
        self.consumer = await self.io.consume(
            SERVICE,
            self.settings.consumer_group,
            self.handle,
            on_undecodable=self.on_undecodable,
            max_in_flight=self.settings.records_in_flight,
        )

    def tasks(self) -> dict[str, Coroutine[Any, Any, None]]:
        assert self.consumer is not None
        return {
            "env-consume": self.consumer.run(),
            "env-claims": self._sweep_loop(),
            "env-usage": self.usage.run(lambda: self.io.require_store().usage, self._stopping),
            # The environments this replica serves: a job naming none of them is refused at
            # submission (marlaas.Client.submit, the API) instead of failing here later.
            "env-runtime": announce_runtime(
                self.io,
                SERVICE,
                self.replica,
                self._served_environments,
                self._stopping,
            ),
        }

    def _served_environments(self) -> dict[str, str]:
        """This replica's runtime record: the environments it serves (none said where the
        registry cannot be read, e.g. a malformed MARLAAS_ENVIRONMENTS: submissions are then
        left to this service's own checks)."""
        try:
            return {ENVIRONMENTS_FIELD: ",".join(available_environments())}
        except Exception as exc:
            log.warning("the environments served cannot be listed (%s)", exc)
            return {"environments_unlisted": type(exc).__name__}

    def request_stop(self) -> None:
        self._stopping.set()
        if self.consumer is not None:
            self.consumer.stop()

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.close()
        await asyncio.to_thread(close_mcp_hub)  # before the workers (the loop's executor) end
        self.calls.close()
        await flush_usage(self.usage, self.io.store)
        await self.io.close()

    async def readiness(self) -> dict[str, bool]:
        return {
            "kafka": self.consumer is not None and await self.consumer.reachable(),
            "redis": await redis_ready(self.io.store),
        }

    async def handle(self, message: Message, delivery: Delivery) -> None:
        if isinstance(message, JobSpec | JobCommand) and (stale := _stale(delivery)):
            raise ValueError(stale)  # dead-lettered with the reason
        match message:
            case JobSpec():
                await self.admission.on_job(message)
            case JobCommand():
                await self.commands.on_command(message)
            case GenerationResult():
                await self.scorer.on_result(message)
            case AdapterUpdate():
                await self._on_adapter(message)
            case GroupDropped():
                # A dropped group frees a slot.
                if (record := await self.io.require_store().jobs.get(message.job_id)) is not None:
                    await self.issuer.issue_groups(record)

    async def on_undecodable(
        self, topic: str, raw: bytes | None, error: MessageDecodeError
    ) -> None:
        """A record that does not decode: a job spec that names its job is rejected
        (env_svc/jobs/admission.py); every such record is dead-lettered as well."""
        await self.admission.on_undecodable(topic, raw, error)

    async def _on_adapter(self, update: AdapterUpdate) -> None:
        """A trained version widens the window, and is evaluated when the job evaluates it."""
        store = self.io.require_store()
        if (record := await store.jobs.get(update.job_id)) is None:
            return
        await self.issuer.issue_groups(record)
        if (untrusted := await unpublished(store.adapters, update.ref)) is not None:
            raise ValueError(f"adapter update not evaluated: {untrusted}")
        await self.evaluations.evaluate(record, update.version)

    async def sweep_claims(self) -> int:
        """One sweep of the active jobs (env_svc/jobs/sweep.py); returns how many groups were
        sent again."""
        return await self.sweep.run()

    async def _sweep_loop(self) -> None:
        interval = self.settings.claim_sweep_s
        while not await wait_any(self._stopping, timeout_s=interval):
            try:
                await self.sweep_claims()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("claim sweep skipped (%r); next in %.0fs", exc, interval)


def _stale(delivery: Delivery) -> str:
    """Why a job or command record is too old to act on ("" if it is not): older than env_svc
    remembers a rejected job's id (`REJECTION_TTL_S`), a replay (a consumer group's offsets
    lost with a week's outage, a producer's retry) could start a job that was refused, or
    take a freed id. Submitted within the week, a record is de-duplicated by its job's
    record and by the rejection; past it, refused by its age."""
    age_s = time.time() - delivery.timestamp_ms / 1000
    if delivery.timestamp_ms <= 0 or age_s <= REJECTION_TTL_S:
        return ""
    return (
        f"a {delivery.topic} record produced {age_s / 86400:.1f} days ago is past the "
        f"{REJECTION_TTL_S // 86400} days a job's id and rejection are remembered: send it again"
    )
