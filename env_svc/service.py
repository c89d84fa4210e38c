"""env_svc: accept jobs, issue groups within the staleness bound, step episodes.

Stateless replicas in one consumer group: episode state travels in the messages, flow-control
counters and the job registry live in Redis, so any replica can handle any record.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import Any

import msgspec

from common.bus import ConsumerLoop, Delivery
from common.config import EnvServiceSettings, SharedSettings
from common.health import redis_ready
from common.jobspec import JobSpecError, validate_job
from common.lifecycle import COMMAND_EVENT, CONSUMED_TOPICS, STATE_AFTER, ServiceName
from common.logs import job_logger
from common.messages import (
    AdapterUpdate,
    ContextTooLongError,
    GenerationRequest,
    GenerationResult,
    GroupDropped,
    JobCommand,
    JobSpec,
    Message,
    Trajectory,
    job_event,
)
from common.ports import Sender, StateStore
from common.service import Connections, Service
from common.store import JobRecord
from env_svc.episodes import (
    ChatTokenizer,
    EpisodeError,
    advance_episode,
    failed_trajectory,
    start_episode,
)
from env_svc.protocol import Environment, EnvSpecError, environment_for

log = logging.getLogger(__name__)

SERVICE: ServiceName = "env_svc"


class EnvService(Service):
    name = SERVICE

    def __init__(
        self,
        shared: SharedSettings,
        settings: EnvServiceSettings,
        tokenizer: ChatTokenizer,
        *,
        producer: Sender | None = None,
        store: StateStore | None = None,
    ) -> None:
        """`producer` / `store`: given (tests), they are used as they are; else `start()`
        connects to Kafka and Redis."""
        self.shared = shared
        self.settings = settings
        self.tokenizer = tokenizer
        self.io = Connections(shared, SERVICE, producer=producer, store=store)
        self.producer = self.io.producer
        self.consumer: ConsumerLoop[Message] | None = None
        # An environment is stateless after construction, so caching it per job is safe.
        self._envs: dict[str, Environment[Any]] = {}

    async def start(self) -> None:
        await self.io.open()
        self.consumer = ConsumerLoop[Message](
            bootstrap=self.shared.kafka_bootstrap,
            group_id=self.settings.consumer_group,
            topics=CONSUMED_TOPICS[SERVICE],
            handler=self.handle,
            dead_letters=self.producer,
            service=SERVICE,
        )
        await self.consumer.start(timeout_s=self.shared.connect_timeout_s)

    def tasks(self) -> dict[str, Coroutine[Any, Any, None]]:
        assert self.consumer is not None
        return {"env-consume": self.consumer.run()}

    def request_stop(self) -> None:
        if self.consumer is not None:
            self.consumer.stop()

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.close()
        await self.io.close()

    async def readiness(self) -> dict[str, bool]:
        return {
            "kafka": self.consumer is not None and await self.consumer.reachable(),
            "redis": await redis_ready(self.io.store),
        }

    # --- dispatch -------------------------------------------------------------------

    async def handle(self, message: Message, delivery: Delivery) -> None:
        match message:
            case JobSpec():
                await self.on_job(message)
            case JobCommand():
                await self.on_command(message)
            case GenerationResult():
                await self.on_result(message)
            case AdapterUpdate() | GroupDropped():
                # A trained version widens the job's window; a dropped group frees a slot.
                await self.issue_groups(message.job_id)

    # --- jobs -----------------------------------------------------------------------

    async def on_job(self, spec: JobSpec) -> None:
        store = self.io.require_store()
        job_log = job_logger(log, spec.job_id, spec.tenant)
        try:
            validate_job(
                spec,
                base_model=self.shared.base_model,
                max_lora_rank=self.shared.max_lora_rank,
                lora_target_modules=self.shared.lora_target_modules,
            )
            # A first episode proves the environment, its params and the prompt length.
            start_episode(
                environment_for(spec.env), self.tokenizer, spec, group_id="probe",
                group_index=0, sample_index=0,
            )  # fmt: skip
        except (JobSpecError, EnvSpecError, EpisodeError, ContextTooLongError) as exc:
            job_log.warning("job rejected: %s", exc)
            await self.producer.send(
                job_event(spec.job_id, "rejected", SERVICE, tenant=spec.tenant, reason=str(exc))
            )
            return
        if await store.register_job(spec, status=STATE_AFTER["accepted"]):
            job_log.info("job accepted: env %s", spec.env.name)
            await self.producer.send(
                job_event(spec.job_id, "accepted", SERVICE, tenant=spec.tenant)
            )
        await self.issue_groups(spec.job_id)  # also resumes issuing after a redelivery

    async def on_command(self, command: JobCommand) -> None:
        store = self.io.require_store()
        record = await store.job(command.job_id)
        if record is None:
            job_logger(log, command.job_id).warning(
                "command %s for an unknown job ignored", command.action
            )
            return
        kind = COMMAND_EVENT[command.action]
        if not await store.set_job_status(command.job_id, STATE_AFTER[kind]):
            return  # already finished: a late command changes nothing
        await self.producer.send(
            job_event(command.job_id, kind, SERVICE, tenant=record.spec.tenant)
        )
        job_logger(log, command.job_id, record.spec.tenant).info("job %s", kind)
        if command.action == "resume":
            await self.issue_groups(command.job_id)

    async def issue_groups(self, job_id: str) -> None:
        """Issue every group the staleness bound allows now: G requests each."""
        store = self.io.require_store()
        record = await store.job(job_id)
        if record is None or record.status != "running":
            return
        spec, env = self._job(record)
        rl = spec.rl
        while (
            group := await store.try_issue_group(
                job_id,
                max_staleness=rl.max_staleness,
                groups_per_step=rl.groups_per_step,
                max_groups=rl.max_steps * rl.groups_per_step,
            )
        ) is not None:
            group_id = f"{job_id}/g{group.index}"
            for sample_index in range(rl.group_size):
                request = start_episode(
                    env, self.tokenizer, spec, group_id=group_id, group_index=group.index,
                    sample_index=sample_index,
                )  # fmt: skip
                # Sample with at least the version training had reached when it was issued.
                await self.producer.send(
                    msgspec.structs.replace(request, min_adapter_version=group.trained_version)
                )
            job_logger(log, job_id, spec.tenant).debug("issued group %d", group.index)

    # --- episodes -------------------------------------------------------------------

    async def on_result(self, result: GenerationResult) -> None:
        store = self.io.require_store()
        if await store.seen("results", result.job_id, result.request_id):
            return  # redelivered: its successor was already sent
        record = await store.job(result.job_id)
        if record is None or record.status in ("cancelled", "completed", "failed"):
            return
        spec, env = self._job(record)
        follow_up: GenerationRequest | Trajectory
        try:
            follow_up = advance_episode(env, self.tokenizer, spec, result)
        except EpisodeError as exc:
            job_logger(log, spec.job_id, spec.tenant).warning(
                "episode %s failed: %s", result.episode_id, exc
            )
            follow_up = failed_trajectory(spec, result, str(exc))
        await self.producer.send(follow_up)
        await store.mark_seen("results", result.job_id, result.request_id)

    # --- helpers --------------------------------------------------------------------

    def _job(self, record: JobRecord) -> tuple[JobSpec, Environment[Any]]:
        job_id = record.spec.job_id
        if job_id not in self._envs:
            self._envs[job_id] = environment_for(record.spec.env)
        return record.spec, self._envs[job_id]
