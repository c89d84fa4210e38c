"""env_svc: accept jobs, issue groups within the staleness bound, step episodes.

Stateless replicas in one consumer group: episode state travels in the messages, flow-control
counters and the job registry live in Redis, so any replica can handle any record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Coroutine, Iterable
from functools import partial
from typing import Any

import msgspec

from common.bus.kafka import ConsumerLoop, Delivery
from common.bus.sender import Sender
from common.files.artifacts import unpublished
from common.runtime.backoff import is_transient
from common.runtime.config import EnvServiceSettings, SharedSettings
from common.runtime.faults import fault_point
from common.runtime.health import redis_ready
from common.runtime.logs import job_logger
from common.runtime.service import Connections, Service, wait_any
from common.state.audit import audit
from common.state.dedup import COMMANDS, RESULTS
from common.state.evals import (
    DONE,
    MAX_RESENDS,
    WAITING,
    below_base,
    eval_group_id,
    eval_version_of,
    evaluated,
)
from common.state.flow import IssuedGroup, group_id_of
from common.state.keyspace import (
    claims_key,
    dedup_key,
    eval_resends_key,
    eval_seen_key,
    eval_tally_key,
    evals_key,
    flow_key,
    ledger_key,
)
from common.state.registry import REJECTION_TTL_S, JobRecord
from common.state.store import RedisStore
from common.state.tenants import QuotaError
from common.wire.codec import job_named_in
from common.wire.jobspec import JobSpecError, validate_job
from common.wire.lifecycle import (
    COMMAND_EVENT,
    STATE_AFTER,
    TERMINAL_STATES,
    ServiceName,
)
from common.wire.messages import (
    AdapterUpdate,
    ContextTooLongError,
    GenerationRequest,
    GenerationResult,
    GroupDropped,
    JobCommand,
    JobSpec,
    Message,
    MessageDecodeError,
    Topic,
    Trajectory,
    job_event,
)
from env_svc.calls import EnvCalls
from env_svc.chat_template import ChatTokenizer
from env_svc.episodes import (
    EpisodeError,
    advance_episode,
    failed_trajectory,
    start_episode,
    start_eval_episode,
    unstarted_trajectory,
)
from env_svc.mcp import close_mcp_hub
from env_svc.protocol import Environment, EnvSpecError, RewardResult, environment_for

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
        store: RedisStore | None = None,
    ) -> None:
        self.shared = shared
        self.settings = settings
        self.tokenizer = tokenizer
        self.io = Connections(shared, SERVICE, producer=producer, store=store)
        self.producer = self.io.producer
        self.consumer: ConsumerLoop[Message] | None = None
        # An environment is stateless after construction, so caching it per job is safe.
        self._envs: dict[str, Environment[Any]] = {}
        self._stopping = asyncio.Event()
        self.calls = EnvCalls(timeout_s=settings.env_call_timeout_s, workers=settings.env_workers)

    async def start(self) -> None:
        asyncio.get_running_loop().set_default_executor(self.calls.executor)
        await self.io.open()
        if (taken := await self.io.require_store().backfill_active()) is not None:
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
        return {"env-consume": self.consumer.run(), "env-claims": self._sweep_loop()}

    def request_stop(self) -> None:
        self._stopping.set()
        if self.consumer is not None:
            self.consumer.stop()

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.close()
        await asyncio.to_thread(close_mcp_hub)  # before the workers (the loop's executor) end
        self.calls.close()
        await self.io.close()

    async def readiness(self) -> dict[str, bool]:
        return {
            "kafka": self.consumer is not None and await self.consumer.reachable(),
            "redis": await redis_ready(self.io.store),
        }

    # --- dispatch -------------------------------------------------------------------

    async def handle(self, message: Message, delivery: Delivery) -> None:
        if isinstance(message, JobSpec | JobCommand) and (stale := _stale(delivery)):
            raise ValueError(stale)  # dead-lettered with the reason
        match message:
            case JobSpec():
                await self.on_job(message)
            case JobCommand():
                await self.on_command(message)
            case GenerationResult():
                await self.on_result(message)
            case AdapterUpdate():
                store = self.io.require_store()
                if (record := await store.job(message.job_id)) is None:
                    return
                await self.issue_groups(record)  # a trained version widens the window
                if (untrusted := await unpublished(store, message)) is not None:
                    raise ValueError(f"adapter update not evaluated: {untrusted}")
                await self.evaluate(record, message.version)
            case GroupDropped():
                # A dropped group frees a slot.
                if (record := await self.io.require_store().job(message.job_id)) is not None:
                    await self.issue_groups(record)

    async def on_undecodable(
        self, topic: str, raw: bytes | None, error: MessageDecodeError
    ) -> None:
        """A job spec that names its job but does not decode (a field misspelt or of the
        wrong type, e.g. in JSON from another Kafka client) is `rejected` with the reason,
        so its sender sees why in `marlaas logs`; the record is dead-lettered as well."""
        if topic != Topic.JOBS or (named := job_named_in(raw)) is None:
            return
        job_id, tenant = named
        store = self.io.require_store()
        if await store.job(job_id) is not None or await store.owner(job_id) not in (None, tenant):
            # Not this sender's job to reject: a `rejected` event would end the owner's view
            # of a job that runs (`logs --follow`). The dead letter says what came.
            job_logger(log, job_id, tenant).warning("undecodable spec for a taken job id")
            return
        job_logger(log, job_id, tenant).warning("job rejected: %s", error.reason)
        await store.record_rejection(job_id, error.reason)
        await self.io.send(
            job_event(job_id, "rejected", SERVICE, tenant=tenant, reason=error.reason)
        )

    # --- jobs -----------------------------------------------------------------------

    async def on_job(self, spec: JobSpec) -> None:
        store = self.io.require_store()
        job_log = job_logger(log, spec.job_id, spec.tenant)
        # A job id is bound to the tenant that first sent it, for good: a spec of another
        # tenant under it is dead-lettered with no event, since a `rejected` event would end
        # the owner's view of its job (docs/architecture.md, "Tenants").
        if (owner := await store.bind_owner(spec.job_id, spec.tenant)) != spec.tenant:
            raise ForeignJobError(
                f"job id {spec.job_id!r} belongs to tenant {owner!r}; "
                f"a spec for it from tenant {spec.tenant!r} is refused"
            )
        if (known := await store.job(spec.job_id)) is not None:
            # Redelivered, or sent again under its id: the registered spec stands, checked when
            # it came. Checked again, it could be `rejected` (its tenant's limits lowered since,
            # an environment gone) while it runs, ending its owner's view of it.
            job_log.info("job already registered; its registered spec stands")
            await self.issue_groups(known)  # also resumes issuing after a redelivery
            await self.evaluate(known, 0)
            return
        if not spec.base_model:  # "the one this deployment serves"
            spec = msgspec.structs.replace(spec, base_model=self.shared.base_model)
        limits = await store.tenants.limits(spec.tenant)
        try:
            validate_job(
                spec,
                base_model=self.shared.base_model,
                max_lora_rank=self.shared.max_lora_rank,
                lora_target_modules=self.shared.lora_target_modules,
                max_model_len=await self._engine_context(),
                limits=limits,
            )
            # A first episode proves the environment, its params and the prompt length.
            probed = await self._probe(spec)
            registered = await store.register_job(
                spec, status=STATE_AFTER["accepted"], limits=limits
            )
        except Exception as exc:  # whatever the spec or its environment raised: rejected
            if is_transient(exc):
                raise
            reason = _reason(exc)
            job_log.warning("job rejected: %s", reason)
            await store.record_rejection(spec.job_id, reason)
            await self.io.send(
                job_event(spec.job_id, "rejected", SERVICE, tenant=spec.tenant, reason=reason)
            )
            return
        if registered:
            self._envs[spec.job_id] = probed  # the registered spec's environment
            job_log.info("job accepted: env %s", spec.env.name)
            await self.io.send(job_event(spec.job_id, "accepted", SERVICE, tenant=spec.tenant))
        # Its status as registered (a redelivered spec of a paused job stays paused).
        if (record := await store.job(spec.job_id)) is not None:
            await self.issue_groups(record)  # also resumes issuing after a redelivery
            await self.evaluate(record, 0)  # the base model, to compare the adapters with

    async def _engine_context(self) -> int | None:
        """The shortest `max_model_len` of the live rollout replicas (None: none reports)."""
        stats = await self.io.require_store().replica_stats()
        limits = [int(s.max_model_len) for s in stats.values() if s.max_model_len]
        return min(limits, default=None)

    async def _probe(self, spec: JobSpec) -> Environment[Any]:
        """The job's environment, proven by starting a first episode."""
        env = await self.calls.run(
            f"job {spec.job_id}: environment", partial(environment_for, spec)
        )
        await self.calls.drive(
            f"job {spec.job_id}: first episode",
            partial(
                start_episode,
                env,
                self.tokenizer,
                spec,
                group_id="probe",
                group_index=0,
                sample_index=0,
            ),
            awaits=env.awaits,
        )
        return env

    async def on_command(self, command: JobCommand) -> None:
        store = self.io.require_store()
        record = await store.job(command.job_id)
        if record is None:
            job_logger(log, command.job_id).warning(
                "command %s for an unknown job ignored", command.action
            )
            return
        if await store.seen(COMMANDS, command.job_id, command.command_id):
            return  # applied before: a redelivered or replayed command changes nothing
        kind = COMMAND_EVENT[command.action]
        changed = await store.set_job_status(command.job_id, STATE_AFTER[kind])
        # Marked once applied: a crash before this applies it again, which changes nothing.
        await store.mark_seen(COMMANDS, command.job_id, command.command_id)
        if not changed:
            return  # already finished: a late command changes nothing
        await self.io.send(job_event(command.job_id, kind, SERVICE, tenant=record.spec.tenant))
        job_logger(log, command.job_id, record.spec.tenant).info("job %s", kind)
        if command.action == "resume":
            await self.issue_groups(dataclasses.replace(record, status=STATE_AFTER[kind]))

    async def issue_groups(self, record: JobRecord) -> None:
        """Issue every group the staleness bound allows now: G requests each."""
        if record.status != "running":
            return
        store, spec = self.io.require_store(), record.spec
        job_id = spec.job_id
        rl = spec.rl
        while (
            group := await store.try_issue_group(
                job_id,
                max_staleness=rl.max_staleness,
                groups_per_step=rl.groups_per_step,
                max_groups=rl.max_steps * rl.groups_per_step,
            )
        ) is not None:
            fault_point("env.after_claim")
            await self._send_group(spec, group)
            job_logger(log, job_id, spec.tenant).debug("issued group %d", group.index)

    async def _send_group(self, spec: JobSpec, group: IssuedGroup) -> None:
        """The first request of each of the group's G episodes, then the claim is done.
        Episode ids are deterministic, so sending a group again only makes duplicates that
        env_svc (results by request id) and the trainer (episodes by id) de-duplicate."""
        firsts = []
        for sample_index in range(spec.rl.group_size):
            # Sample with at least the version training had reached when it was issued.
            first = await self._first_request(spec, group.index, sample_index)
            if isinstance(first, GenerationRequest):
                first = msgspec.structs.replace(first, min_adapter_version=group.trained_version)
            firsts.append(first)
        try:
            await self.io.send(firsts[0])
            fault_point("env.mid_group")
            await self.io.send_all(firsts[1:])  # one round trip, not G - 1
        except Exception as exc:
            if is_transient(exc):
                raise
            # Refused for good (e.g. a record over the broker's size limit): the group ends
            # as failed with the reason, instead of a claim every sweep re-sends forever.
            error = f"group {group.index} could not be sent: {type(exc).__name__}: {exc}"
            job_logger(log, spec.job_id, spec.tenant).error("%s", error)
            await self.io.send_all(
                [
                    unstarted_trajectory(
                        spec,
                        group_id=group_id_of(spec.job_id, group.index),
                        group_index=group.index,
                        sample_index=sample_index,
                        error=error,
                    )
                    for sample_index in range(spec.rl.group_size)
                ]
            )
        await self.io.require_store().finish_claim(spec.job_id, group.index)

    # --- evaluation (common/state/evals.py) ----------------------------------------------

    async def evaluate(self, record: JobRecord, version: int) -> None:
        """Send the evaluation of adapter `version` when the job evaluates it, once: now, or
        when the job's evaluation in flight has finished (common/state/evals.py)."""
        if record.status in _NOT_EVALUATED or not evaluated(record.spec, version):
            return
        if await self.io.require_store().claim_eval(record.spec.job_id, version):
            await self._send_eval(record.spec, version)

    async def _send_eval(self, spec: JobSpec, version: int) -> None:
        """The first request of every evaluation episode not counted yet (all of them, but
        when sent again); one whose task cannot start, or whose request cannot be sent (over
        a record's size), is counted at once as unsolved with the reason. Finished at once
        when every episode was counted."""
        group_id = eval_group_id(spec.job_id, version)
        counted = await self.io.require_store().eval_seen(spec.job_id, version)
        if len(counted) >= spec.eval.tasks:
            await self._finish_eval(spec, version)
            return
        firsts: list[GenerationRequest] = []
        failed: list[tuple[str, str]] = []
        for index in range(spec.eval.tasks):
            episode_id = f"{group_id}/{index}"
            if episode_id in counted:
                continue
            try:
                env = await self._env(spec)
                start = partial(
                    start_eval_episode, env, self.tokenizer, spec, version=version, index=index
                )
                what = f"{spec.job_id}: eval {index}"
                firsts.append(await self.calls.drive(what, start, awaits=env.awaits))
            except Exception as exc:
                if is_transient(exc):
                    raise
                failed.append((episode_id, _reason(exc)))
        sent = await asyncio.gather(*map(self.io.send, firsts), return_exceptions=True)
        for request, outcome in zip(firsts, sent, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception) or is_transient(outcome):
                    raise outcome
                failed.append((request.episode_id, _reason(outcome)))
        job_logger(log, spec.job_id, spec.tenant).info(
            "evaluating v%d on %d held-out tasks", version, len(firsts)
        )
        for episode_id, reason in failed:
            await self._count_eval(spec, version, episode_id, 0.0, {}, reason)

    async def _count_eval(
        self,
        spec: JobSpec,
        version: int,
        episode_id: str,
        reward: float,
        components: dict[str, float],
        error: str,
    ) -> None:
        """Tally one finished evaluation episode; the last one sends the `eval` event. One of
        an evaluation not in flight (finished, or gone with an ended job's state: a replayed
        result) is not counted, nor does it bring back the state that went."""
        state = await self.io.require_store().eval_state(spec.job_id, version)
        if state is None or state in (DONE, WAITING):
            log.debug("result of %s ignored: its evaluation is %s", episode_id, state or "gone")
            return
        solved = not error and (await self._env(spec)).solved(
            RewardResult(total=reward, components=components)
        )
        counted = await self.io.require_store().record_eval(
            spec.job_id, version, episode_id, reward=reward, solved=solved, components=components
        )
        if counted >= spec.eval.tasks:
            await self._finish_eval(spec, version)

    async def _finish_eval(self, spec: JobSpec, version: int) -> None:
        store = self.io.require_store()
        tally = await store.eval_tally(spec.job_id, version)
        metrics = tally.metrics()
        # Compared with the base model's (version 0): a job that learned the wrong thing
        # says so in its events, where status, the report and the tracking sinks read it.
        worse = ""
        if version > 0 and (base := await store.eval_tally(spec.job_id, 0)).episodes:
            metrics["eval_base_accuracy"] = base.accuracy
            worse = below_base(tally, base)
            metrics["eval_below_base"] = 1.0 if worse else 0.0
        await self.io.send(
            job_event(
                spec.job_id,
                "eval",
                SERVICE,
                tenant=spec.tenant,
                step=version,
                metrics=metrics,
                reason=worse,
            )
        )
        waited = await store.finish_eval(spec.job_id, version)
        logger = job_logger(log, spec.job_id, spec.tenant)
        logger.info(
            "eval v%d: accuracy %.3f +- %.3f, reward %.3f (%d episodes)",
            version,
            tally.accuracy,
            tally.accuracy_stderr,
            tally.reward_sum / max(tally.episodes, 1),
            tally.episodes,
        )
        if worse:
            logger.warning("eval v%d: %s", version, worse)
        if waited is not None:  # the job's next evaluation, which waited for this one
            await self._send_eval(spec, waited)

    async def _sweep_evals(self, record: JobRecord) -> None:
        """Finish evaluations whose episodes are all in (their event was not sent), or that
        were sent `MAX_RESENDS` times (with the episodes they have); send the requests of
        other unfinished ones again (those of episodes not counted yet); start one that
        waits when none is in flight (its start was lost with a replica)."""
        store, spec = self.io.require_store(), record.spec
        if record.status in _NOT_EVALUATED:
            await store.abandon_evals(spec.job_id)
            return
        for version in await store.take_stale_evals(spec.job_id, self.settings.eval_timeout_s):
            if (await store.eval_tally(spec.job_id, version)).episodes >= spec.eval.tasks:
                await self._finish_eval(spec, version)
            elif await store.count_eval_resend(spec.job_id, version) > MAX_RESENDS:
                await self._finish_eval(spec, version)
            else:
                job_logger(log, spec.job_id, spec.tenant).warning(
                    "evaluation of v%d unfinished; sending its requests again", version
                )
                await self._send_eval(spec, version)
        if (waiting := await store.start_waiting_eval(spec.job_id)) is not None:
            await self._send_eval(spec, waiting)

    async def sweep_claims(self) -> int:
        """Send again every group claimed more than `claim_timeout_s` ago and never finished
        (its replica died or lost Kafka mid-group), and issue what each running job's window
        allows (in case the record that should have prompted it, an AdapterUpdate or a
        GroupDropped, never arrived); returns how many groups were sent again."""
        store, resent = self.io.require_store(), 0
        await store.drop_expired_listings()
        active = await store.active_job_ids()
        for job_id in set(self._envs) - set(active):  # retired, maybe by another replica
            del self._envs[job_id]
        for job_id in active:
            record = await store.job(job_id)
            if record is None:
                await store.retire(job_id)
                continue
            if record.status in TERMINAL_STATES:
                self._envs.pop(job_id, None)  # a cache: rebuilt should a late result need it
                if await self._expire_when_done(record):
                    continue
            await self.issue_groups(record)
            await self._sweep_evals(record)
            for group in await store.take_stale_claims(job_id, self.settings.claim_timeout_s):
                if record.status in TERMINAL_STATES:
                    await store.finish_claim(job_id, group.index)
                    continue
                job_logger(log, job_id, record.spec.tenant).warning(
                    "group %d was claimed but not all sent; sending it again", group.index
                )
                await self._send_group(record.spec, group)
                resent += 1
        return resent

    async def _expire_when_done(self, record: JobRecord) -> bool:
        """An ended job whose evaluations are all done: its audit is kept in its record, its
        state here expires in a week, and it is retired (no sweep visits it again). False
        while something is left to finish."""
        store, job_id = self.io.require_store(), record.spec.job_id
        evals = await store.evals(job_id)
        if any(state != DONE for state in evals.values()):
            return False
        pointer = await store.adapter(job_id)
        summary = audit(
            job_id,
            await store.ledger(job_id),
            status=record.status,
            groups_per_step=record.spec.rl.groups_per_step,
            pointer_version=pointer.version if pointer else 0,
        )
        await store.put_audit_summary(job_id, summary.to_json())
        await store.expire_after_end(working_state_keys(job_id, evals))
        if pointer is None:  # nothing to export: its record goes too
            await store.expire_unkept(job_id, record.spec.tenant)
        await store.retire(job_id)
        return True

    async def _sweep_loop(self) -> None:
        interval = self.settings.claim_sweep_s
        while not await wait_any(self._stopping, timeout_s=interval):
            try:
                await self.sweep_claims()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("claim sweep skipped (%r); next in %.0fs", exc, interval)

    async def _first_request(
        self, spec: JobSpec, group_index: int, sample_index: int
    ) -> GenerationRequest | Trajectory:
        """An episode's first request, or, when the environment raises, its failed end."""
        group_id = group_id_of(spec.job_id, group_index)
        try:
            env = await self._env(spec)
            return await self.calls.drive(
                f"{spec.job_id}: start of group {group_index}",
                partial(
                    start_episode,
                    env,
                    self.tokenizer,
                    spec,
                    group_id=group_id,
                    group_index=group_index,
                    sample_index=sample_index,
                ),
                awaits=env.awaits,
            )
        except Exception as exc:
            error = _reason(exc)
            job_logger(log, spec.job_id, spec.tenant).warning(
                "group %d sample %d cannot start: %s", group_index, sample_index, error
            )
            return unstarted_trajectory(
                spec,
                group_id=group_id,
                group_index=group_index,
                sample_index=sample_index,
                error=error,
            )

    # --- episodes -------------------------------------------------------------------

    async def on_result(self, result: GenerationResult) -> None:
        store = self.io.require_store()
        if await store.seen(RESULTS, result.job_id, result.request_id):
            return  # redelivered: its successor was already sent
        record = await store.job(result.job_id)
        version = eval_version_of(result.job_id, result.group_id)
        # A completed job's final version is evaluated after its last step.
        ended = _NOT_EVALUATED if version is not None else TERMINAL_STATES
        if record is None or record.status in ended:
            return
        spec = record.spec
        follow_up: GenerationRequest | Trajectory
        try:
            env = await self._env(spec)
            follow_up = await self.calls.drive(
                f"episode {result.episode_id} turn {result.turn}",
                partial(advance_episode, env, self.tokenizer, spec, result),
                awaits=env.awaits,
            )
            if version is not None and isinstance(follow_up, Trajectory):
                await self._count_eval(
                    spec,
                    version,
                    follow_up.episode_id,
                    follow_up.reward,
                    dict(follow_up.reward_components),
                    follow_up.error,
                )
            else:
                await self.producer.send(follow_up)
        except Exception as exc:  # environment, reward or encoding: the episode ends here
            if is_transient(exc):
                raise
            error = _reason(exc)
            job_logger(log, spec.job_id, spec.tenant).warning(
                "episode %s failed: %s", result.episode_id, error
            )
            if version is not None:
                await self._count_eval(spec, version, result.episode_id, 0.0, {}, error)
            else:
                await self.io.send(failed_trajectory(spec, result, error))
        fault_point("env.after_send")
        await store.mark_seen(RESULTS, result.job_id, result.request_id)

    # --- helpers --------------------------------------------------------------------

    async def _env(self, spec: JobSpec) -> Environment[Any]:
        """The job's environment (stateless after construction, so built once per job), built
        in a worker: its params are the tenant's, its code may read files or hang."""
        if (env := self._envs.get(spec.job_id)) is None:
            env = await self.calls.run(
                f"job {spec.job_id}: environment", partial(environment_for, spec)
            )
            env.template_takes_tools = self.tokenizer.takes_tools
            self._envs[spec.job_id] = env
        return env


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


def working_state_keys(job_id: str, evaluated: Iterable[int]) -> list[str]:
    """What env_svc keeps of a job while it runs (its Redis user's keys), to expire when it
    has ended and its `evaluated` versions are done."""
    versions = list(evaluated)
    return [
        claims_key(job_id),
        flow_key(job_id),
        ledger_key(job_id),
        evals_key(job_id),
        eval_resends_key(job_id),
        dedup_key(RESULTS, job_id),
        dedup_key(COMMANDS, job_id),
        *(eval_seen_key(job_id, v) for v in versions),
        *(eval_tally_key(job_id, v) for v in versions),
    ]


class ForeignJobError(ValueError):
    """A job spec under a job id bound to another tenant (dead-lettered, no event)."""


_NOT_EVALUATED = frozenset({"cancelled", "failed", "rejected"})
"""States in which a job's evaluations stop (a completed job's final one goes on)."""


def _reason(exc: BaseException) -> str:
    """Our own errors say what is wrong; anything else also names its type."""
    if isinstance(
        exc, JobSpecError | QuotaError | EnvSpecError | EpisodeError | ContextTooLongError
    ):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
