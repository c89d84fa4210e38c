"""trainer_svc: assemble groups, drop stale ones, train one GRPO step per B groups, publish.

Trajectories are keyed by job, so each job's trajectories reach one replica, which owns the
job's adapter and optimizer. A trajectory's offset stays uncommitted (held) until its group
was trained and the step is durable (checkpoint + Redis pointer), or the group was dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from aiokafka.structs import TopicPartition

from common.bus.kafka import ConsumerLoop, Delivery
from common.bus.sender import Sender
from common.runtime.backoff import is_transient, retry_transient
from common.runtime.config import SharedSettings, TrainerSettings
from common.runtime.faults import fault_point
from common.runtime.hardware import Precision, detect
from common.runtime.health import redis_ready
from common.runtime.logs import job_logger
from common.runtime.metrics import (
    TRAINER_GROUPS_DROPPED,
    TRAINER_STEP_SECONDS,
    TRAINER_STEPS,
    TRAINER_TOKENS_PER_SECOND,
    export_service_metrics,
    forget_job,
)
from common.runtime.service import Connections, Service, announce_runtime, runtime_fields
from common.state.dedup import DROPPED, TRAINED
from common.state.flow import group_index_of
from common.state.keyspace import dedup_key, fence_key, flow_key, ledger_key
from common.state.pointers import FencedError
from common.state.store import RedisStore
from common.wire.lifecycle import (
    STATE_AFTER,
    TERMINAL_STATES,
    TOOL_METRICS,
    ServiceName,
    StepMetrics,
)
from common.wire.messages import (
    AdapterUpdate,
    DropKind,
    GroupDropped,
    JobSpec,
    Topic,
    Trajectory,
    job_event,
)
from trainer_svc.checkpoints import Checkpoint, CheckpointStore
from trainer_svc.compute import ComputeThread
from trainer_svc.groups import (
    SIGNAL_WINDOW,
    Group,
    checked,
    not_of_job,
    verdict,
    worth_resampling,
)
from trainer_svc.grpo import group_advantages_of
from trainer_svc.policy import MultiAdapterPolicy

log = logging.getLogger(__name__)

SERVICE: ServiceName = "trainer_svc"

T = TypeVar("T")


async def durably(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """An effect of a trained step, retried while Redis or Kafka is briefly away: a step
    that was trained must be published, not lost to a restart of either."""
    return await retry_transient(what, call, logger=log)


def working_state_keys(job_id: str) -> list[str]:
    """What trainer_svc keeps of a job while it trains it (its Redis user's keys), to expire
    when it has ended; the adapter pointers stay (exports)."""
    return [
        dedup_key(TRAINED, job_id),
        dedup_key(DROPPED, job_id),
        fence_key(job_id),
        ledger_key(job_id),
        flow_key(job_id),
    ]


UNSAVED_RETRY_S = 10.0
"""How long a job whose step could not be saved waits before it is trained again."""


@dataclass
class OwnedJob:
    """A job this replica trains: its spec, the adapter version it has reached, its groups."""

    spec: JobSpec
    partition: int
    version: int
    epoch: int = 0
    """This replica's fencing epoch for the job: its publishes are refused once another
    replica has taken the job over."""
    filling: dict[str, Group] = field(default_factory=dict)
    ready: deque[Group] = field(default_factory=deque)
    closed: set[str] = field(default_factory=set)
    """Groups that left `filling` here (ready, trained or dropped): late copies of their
    trajectories are not held, so they cannot pin the partition's commits."""
    not_before: float = 0.0
    """Monotonic time before which the job is not stepped (after a step it could not save)."""
    waiting_since: float | None = None
    """Monotonic time since which the job's ready step waits for an older group (`waits`)."""
    resampled: int = 0
    """Groups dropped as uniform since the job's last step (`rl.resample_uniform_groups`
    caps it; kept here only, so a replica that takes the job over starts again at 0)."""
    recent_signal: deque[bool] = field(default_factory=lambda: deque(maxlen=SIGNAL_WINDOW))
    """Whether each of the job's last complete groups had a signal: resampling stops while
    few did (`groups.worth_resampling`). Kept here only, as `resampled` is."""

    def waits(self, now: float, limit_s: float) -> bool:
        """Whether the job's next step waits for a group still filling that the step would
        leave too stale to train (sampled with a version S + 1 behind the one the step makes)
        while it takes a younger ready group in its place; at most `limit_s`. Were the step
        to take only groups as old, the filling one could not be trained anyway."""
        bound = self.version + 1 - self.spec.rl.max_staleness
        doomed = [
            group.oldest_version
            for group in self.filling.values()
            if group.trajectories and group.oldest_version < bound
        ]
        taken = self._oldest_first()[: self.spec.rl.groups_per_step]
        if not doomed or not taken or taken[-1].oldest_version <= min(doomed):
            self.waiting_since = None
            return False
        if self.waiting_since is None:
            self.waiting_since = now
        return now - self.waiting_since < limit_s

    def _oldest_first(self) -> list[Group]:
        """The ready groups in the order steps take them: sampled with the oldest version
        first, then in the order they became ready. A group left behind one sampled later
        would wait a step more and could outrun the staleness bound (dropped, its samples
        wasted)."""
        return sorted(self.ready, key=lambda group: group.oldest_version)

    def take_ready(self) -> list[Group]:
        """The step's B groups, the first of `_oldest_first`."""
        ordered = self._oldest_first()
        count = self.spec.rl.groups_per_step
        self.waiting_since = None
        self.ready = deque(ordered[count:])
        return ordered[:count]


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
        self.jobs: dict[str, OwnedJob] = {}
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._turn = itertools.count()
        self._stepping = asyncio.Lock()
        """Held by a training step; a revocation waits for it before giving jobs up."""

    @property
    def policy(self) -> MultiAdapterPolicy:
        if self._policy is None:
            raise RuntimeError("trainer_svc: base model not loaded")
        return self._policy

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
        await self.io.close()

    async def readiness(self) -> dict[str, bool]:
        return {
            "model": self._policy is not None,
            "kafka": self.consumer is not None and await self.consumer.reachable(),
            "redis": await redis_ready(self.io.store),
        }

    # --- intake ---------------------------------------------------------------------

    async def on_trajectory(self, trajectory: Trajectory, delivery: Delivery) -> None:
        store = self.io.require_store()
        job = self.jobs.get(trajectory.job_id) or await self._own(trajectory.job_id, delivery)
        if job is None:
            return
        job_id, group_id = job.spec.job_id, trajectory.group_id
        if (foreign := not_of_job(trajectory, job.spec)) is not None:
            job_logger(log, job_id, job.spec.tenant).warning("trajectory ignored: %s", foreign)
            return
        if group_id in job.closed or await store.seen(TRAINED, job_id, group_id):
            return  # redelivered after its group was trained: never train it twice
        if await store.seen(DROPPED, job_id, group_id):
            return  # its group was dropped and replaced
        if group_id not in job.filling and (unissued := await self._unissued(job, group_id)):
            job_logger(log, job_id, job.spec.tenant).warning("trajectory ignored: %s", unissued)
            return
        group = job.filling.setdefault(group_id, Group(group_id))
        if trajectory.episode_id in group.trajectories:
            return  # a duplicate of one we hold; the first copy's commit covers it
        group.add(checked(trajectory, job.spec, self.policy.vocab_size), delivery.hold_commit())
        if group.complete(job.spec.rl.group_size):
            job.recent_signal.append(not group.uniform)
            job.closed.add(group_id)
            job.ready.append(job.filling.pop(group_id))
            self._wake.set()

    async def _unissued(self, job: OwnedJob, group_id: str) -> str | None:
        """Why a group's first trajectory is not of a group env_svc issued (the ledger's
        count in Redis, which only env_svc writes), or None."""
        index = group_index_of(job.spec.job_id, group_id)
        issued = (await self.io.require_store().flow(job.spec.job_id)).issued_groups
        if index is None or index >= issued:
            return f"group {group_id!r} was never issued ({issued} groups so far)"
        return None

    async def _own(self, job_id: str, delivery: Delivery) -> OwnedJob | None:
        """Take a job on: its adapter and optimizer, resumed from its latest checkpoint."""
        store = self.io.require_store()
        record = await store.job(job_id)
        if record is None:
            raise ValueError(f"trajectory for unknown job {job_id!r}")
        if record.status in TERMINAL_STATES:
            return None
        spec = record.spec
        # First fence off any previous owner (a replica whose partition moved, or stalled):
        # from here on only this replica can publish the job's versions.
        epoch = await durably(f"taking {job_id} over", partial(store.take_over, job_id))
        # Adding an adapter changes the model's modules: never while a step (forward,
        # backward, a checkpoint's state_dict) runs in its thread.
        async with self._stepping:
            return await self._take_on(spec, epoch, delivery.partition)

    async def _take_on(self, spec: JobSpec, epoch: int, partition: int) -> OwnedJob | None:
        job_id = spec.job_id
        self.policy.add_job(job_id, spec.lora, spec.rl, seed=spec.env.seed)
        job = OwnedJob(spec=spec, partition=partition, version=0, epoch=epoch)
        try:
            checkpoint = await self.compute.run(self.checkpoints.resume, self.policy, job_id)
        except Exception as exc:
            self.policy.remove_job(job_id)
            if is_transient(exc):
                raise  # not owned after all: the next delivery tries again
            # A checkpoint that cannot be loaded never will be: fail the job with the reason
            # rather than dead-letter its trajectories one by one and stall it.
            reason = f"its checkpoint could not be loaded: {type(exc).__name__}: {exc}"
            await self._fail(job, reason)
            return None
        self.jobs[job_id] = job
        if checkpoint is not None:
            job.version = checkpoint.version
            job_logger(log, job_id, spec.tenant).info(
                "resumed from %s at v%d (epoch %d)", checkpoint.path, job.version, epoch
            )
            await self._reconcile(job, checkpoint)
        return self.jobs.get(job_id)

    async def _reconcile(self, job: OwnedJob, checkpoint: Checkpoint) -> None:
        """Finish what a crash may have cut short after the checkpoint of `job.version`: move
        the pointer (with its groups) if it is behind, announce the version again (readers
        ignore versions they have), and complete a job whose last step was saved."""
        store, job_id, version = self.io.require_store(), job.spec.job_id, job.version
        uri = self.checkpoints.adapter_uri(checkpoint, job_id)
        pointer = await durably(f"reading {job_id}'s pointer", partial(store.adapter, job_id))
        if pointer is None or pointer.version < version:
            job_logger(log, job_id, job.spec.tenant).warning(
                "v%d was saved but not published; publishing it", version
            )
            if not await self._publish_pointer(job, version, uri, checkpoint.group_ids):
                return
        if pointer is None or pointer.version <= version:
            await self._announce(job_id, version, uri)
            if version > 0 and (pointer is None or pointer.announced < version):
                # Published, its step event not sent (the crash came between): sent now,
                # with the metrics saved with it, so the job's history has every step.
                metrics = StepMetrics.of(checkpoint.step_metrics)
                await self._step_event(job, version, metrics, list(checkpoint.group_ids))
        if version >= job.spec.rl.max_steps:
            await self._complete(job)

    async def on_revoked(self, partitions: set[TopicPartition]) -> None:
        lost = {tp.partition for tp in partitions if tp.topic == Topic.TRAJECTORIES}
        async with self._stepping:  # never take an adapter away from a step in progress
            self._hand_over(lost)

    def _hand_over(self, lost: set[int]) -> None:
        for job in [job for job in self.jobs.values() if job.partition in lost]:
            # Uncommitted trajectories go to the new owner, which resumes from the checkpoint.
            self._disown(job.spec.job_id)
            job_logger(log, job.spec.job_id, job.spec.tenant).info(
                "partition revoked, job handed over"
            )

    def _disown(self, job_id: str) -> None:
        """Forget a job and remove its adapter; callers hold `_stepping`."""
        self.jobs.pop(job_id, None)
        if job_id in self.policy.jobs:
            self.policy.remove_job(job_id)
        forget_job(job_id)  # its series, which would otherwise pile up with every job

    # --- training -------------------------------------------------------------------

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
        async with self._stepping:
            jobs = await self._ready_jobs()
            if not jobs:
                return False
            await self._step(jobs)
            return True

    async def sweep_finished(self) -> None:
        """Let go of jobs that ended elsewhere (cancelled, failed): their groups' commits
        would otherwise be held forever, stopping commits of the whole partition. Drop the
        lost groups of running jobs that stopped moving."""
        for job in list(self.jobs.values()):
            try:
                await self._sweep(job)
            except Exception as exc:  # Redis down: the loop goes on training what it has
                if not is_transient(exc):
                    raise
                log.warning("sweep stopped (%r); the next sweep retries", exc)
                return

    async def _sweep(self, job: OwnedJob) -> None:
        job_id = job.spec.job_id
        record = await self.io.require_store().job(job_id)
        if record is None or record.status in TERMINAL_STATES:
            async with self._stepping:  # an adapter is not removed under a resume
                await self._ended(job)
            job_logger(log, job_id, job.spec.tenant).info(
                "job %s: its held groups released", record.status if record else "gone"
            )
        else:  # running, or paused: a paused job's lost groups must not pin the partition
            async with self._stepping:
                await self._drop_lost(job)

    async def _drop_lost(self, job: OwnedJob) -> None:
        """Drop the live groups of a job whose ledger has not moved for `group_timeout_s`
        (nothing issued, trained or dropped) but those complete here, once this replica has
        read the job's partition to its end: their missing trajectories are not coming (a
        record the broker lost; an episode that never ended), and a job whose window is
        full would wait for them forever. env_svc issues replacements; late trajectories
        find the groups dropped. The time is the ledger's, so it outlives hand-overs between
        replicas."""
        store, job_id = self.io.require_store(), job.spec.job_id
        last = await store.last_activity(job_id)
        quiet = time.time() - last if last is not None else 0.0
        if quiet <= self.settings.group_timeout_s or job_id not in self.jobs:
            return
        if self.consumer is not None and not await self.consumer.caught_up(
            Topic.TRAJECTORIES.value, job.partition
        ):
            # Chaos run 12: a replica replaying a backlog after a hand-over dropped groups
            # whose trajectories sat unread behind it, env_svc issued more, the backlog grew,
            # and jobs stopped moving. Trajectories not read yet are late, not lost.
            return
        for group_id in await store.live_groups(job_id):
            # Closed here: complete (ready or trained) or dropped. Checked at each group, not
            # once: a group may complete while an earlier drop is being recorded.
            if group_id in job.closed or job.spec.job_id not in self.jobs:
                continue
            group = job.filling.pop(group_id, None) or Group(group_id)
            job.closed.add(group_id)
            have = f"{len(group.trajectories)} of {job.spec.rl.group_size} trajectories"
            reason = f"{have} after {quiet:.0f}s without progress; the rest are lost"
            await self._drop(job, group, "dropped_stale", reason)

    async def _ready_jobs(self) -> list[OwnedJob]:
        """Jobs with B usable groups, round-robin from a moving start: no tenant waits
        behind another when there are more ready jobs than one step takes."""
        candidates = list(self.jobs.values())
        if not candidates:
            return []
        start = next(self._turn) % len(candidates)
        ready: list[OwnedJob] = []
        for job in candidates[start:] + candidates[:start]:
            await self._drop_unusable(job)
            now = time.monotonic()
            if (
                len(job.ready) >= job.spec.rl.groups_per_step
                and job.not_before <= now
                and not job.waits(now, self.settings.stale_wait_s)
            ):
                ready.append(job)
                if len(ready) == self.settings.max_jobs_per_step:
                    break
        return ready

    async def _drop_unusable(self, job: OwnedJob) -> None:
        """Drop ready groups that cannot be trained, and filling ones already too stale to
        ever be (their late samples then find the group closed). Trajectories keep arriving
        while a drop is sent: a group may complete, and new ones become ready, meanwhile."""
        for group in list(job.filling.values()):
            if job.filling.get(group.group_id) is not group:
                continue  # it completed while an earlier drop was sent
            lag = job.version - group.oldest_version if group.trajectories else 0
            if lag <= job.spec.rl.max_staleness:
                continue
            del job.filling[group.group_id]
            job.closed.add(group.group_id)
            await self._drop(job, group, "dropped_stale", f"{lag} versions behind, unfinished")
            if job.spec.job_id not in self.jobs:
                return  # the drop failed the job
        # A group dropped elsewhere (a replica that owned the job before, dropping it as lost
        # while its trajectories were only late) was replaced: it must never be trained too.
        store, ready_ids = self.io.require_store(), [g.group_id for g in job.ready]
        elsewhere = await durably(
            "checking for groups dropped elsewhere",
            lambda: store.dropped_among(job.spec.job_id, ready_ids),
        )
        pending, job.ready = job.ready, deque()
        for group in [g for g in pending if g.group_id in elsewhere]:
            pending.remove(group)
            job.closed.add(group.group_id)
            group.release()
            job_logger(log, job.spec.job_id, job.spec.tenant).info(
                "group %s was dropped elsewhere; not trained", group.group_id
            )
        keep: deque[Group] = deque()
        while pending:
            group = pending.popleft()
            kind, reason = verdict(
                group,
                trained_version=job.version,
                max_staleness=job.spec.rl.max_staleness,
                resample_uniform=job.resampled < job.spec.rl.resample_uniform_groups
                and worth_resampling(job.recent_signal),
            )
            if kind == "train":
                keep.append(group)
            else:
                job.resampled += kind == "dropped_uniform"
                await self._drop(job, group, kind, reason)
            if job.spec.job_id not in self.jobs:
                # The drop failed the job (or it was handed over): nothing of it stays held.
                for left in [*keep, *pending]:
                    left.release()
                return
        job.ready.extendleft(reversed(keep))  # ahead of groups that became ready meanwhile

    async def _drop(self, job: OwnedJob, group: Group, kind: DropKind, reason: str) -> None:
        """Count the group out of the job's window (it is replaced), have env_svc replace it,
        tell dashboards; fail the job after too many unusable groups in a row."""
        job_id, store = job.spec.job_id, self.io.require_store()
        try:
            counted = await durably(
                "counting a dropped group",
                lambda: store.record_dropped_group(
                    job_id,
                    group.group_id,
                    invalid=kind == "dropped_invalid",
                    kind=kind,
                    epoch=job.epoch,
                ),
            )
        except FencedError as exc:  # another replica owns the job now: its groups are its own
            job_logger(log, job_id, job.spec.tenant).warning("%s; job given up", exc)
            self._disown(job_id)
            return
        await self.io.send(
            GroupDropped(
                job_id=job_id,
                group_id=group.group_id,
                verdict=kind,
                reason=reason,
                dropped_at=time.time(),
            )
        )
        await self.io.send(
            job_event(
                job_id,
                kind,
                SERVICE,
                tenant=job.spec.tenant,
                step=job.version,
                reason=f"group {group.group_id}: {reason}",
            )
        )
        TRAINER_GROUPS_DROPPED.labels(job_id, kind).inc()
        job_logger(log, job_id, job.spec.tenant).info(
            "%s group %s (%s)", kind, group.group_id, reason
        )
        group.release()
        if counted.failed_in_a_row >= self.settings.max_failed_groups:
            await self._fail(
                job,
                f"{counted.failed_in_a_row} groups in a row had no usable rewards; "
                f"the last: {reason}",
            )

    async def _fail(self, job: OwnedJob, reason: str) -> None:
        """End a job that cannot make progress, with the reason (instead of re-issuing its
        groups forever)."""
        spec, store = job.spec, self.io.require_store()
        changed = await durably(
            f"failing {spec.job_id}",
            lambda: store.set_job_status(spec.job_id, STATE_AFTER["failed"], reason),
        )
        if changed:
            await self.io.send(
                job_event(
                    spec.job_id,
                    "failed",
                    SERVICE,
                    tenant=spec.tenant,
                    step=job.version,
                    reason=reason,
                )
            )
            job_logger(log, spec.job_id, spec.tenant).error("job failed: %s", reason)
        await self._ended(job)

    async def _step(self, jobs: list[OwnedJob]) -> None:
        """Train B groups of each job in one shared step; then save, publish and report each
        job's new version."""
        live: list[OwnedJob] = []
        store = self.io.require_store()
        for job in jobs:
            job_id = job.spec.job_id
            record = await durably(f"reading job {job_id}", partial(store.job, job_id))
            if record is None or record.status in TERMINAL_STATES:
                await self._ended(job)
            else:
                live.append(job)
        if not live:
            return
        started = time.monotonic()
        taken = {job.spec.job_id: job.take_ready() for job in live}
        try:
            metrics = await self._train(live, taken)
        except Exception as exc:  # a bad batch or a full disk must not stop other tenants
            await self._untrainable(live, taken, exc)
            return
        for job in live:
            job_id, groups = job.spec.job_id, taken[job.spec.job_id]
            version = job.version + 1
            try:
                uri = await self.compute.run(
                    self.checkpoints.save,
                    self.policy,
                    job_id,
                    version,
                    [g.group_id for g in groups],
                    job.epoch,
                    metrics[job_id].as_map(),
                )
            except OSError as exc:  # a full disk: this job's step is lost, not the trainer
                await self._unsaved(job, groups, exc)
                continue
            metrics[job_id].wall_step_s = time.monotonic() - started
            if await self._publish(job, version, uri, groups, metrics[job_id]):
                await self._report(job, metrics[job_id], [g.group_id for g in groups])

    async def _unsaved(self, job: OwnedJob, groups: list[Group], exc: OSError) -> None:
        """A step whose checkpoint could not be written (a full disk, a volume gone): the
        job's adapter goes back to its last saved version and its groups wait to be trained
        again, after `UNSAVED_RETRY_S`; the trainer and the other jobs' steps go on."""
        spec = job.spec
        job_logger(log, spec.job_id, spec.tenant).error(
            "v%d could not be saved (%s: %s); its groups are trained again in %.0fs",
            job.version + 1,
            type(exc).__name__,
            exc,
            UNSAVED_RETRY_S,
        )
        self.policy.remove_job(spec.job_id)
        self.policy.add_job(spec.job_id, spec.lora, spec.rl, seed=spec.env.seed)
        await self.compute.run(self.checkpoints.resume, self.policy, spec.job_id)
        job.ready.extendleft(reversed(groups))
        job.not_before = time.monotonic() + UNSAVED_RETRY_S

    async def _untrainable(
        self, jobs: list[OwnedJob], taken: dict[str, list[Group]], exc: Exception
    ) -> None:
        """A step that raised: with several jobs, each is tried again alone (so one job's
        bad batch does not cost the others their step); a job alone drops its groups with
        the error, which counts towards failing the job."""
        if len(jobs) > 1:
            log.warning("shared step of %d jobs failed (%r); training each alone", len(jobs), exc)
            for job in jobs:
                job.ready.extendleft(reversed(taken[job.spec.job_id]))
                await self._step([job])
            return
        (job,) = jobs
        reason = f"training failed: {type(exc).__name__}: {exc}"
        job_logger(log, job.spec.job_id, job.spec.tenant).error("%s", reason, exc_info=exc)
        for group in taken[job.spec.job_id]:
            if job.spec.job_id in self.jobs:
                await self._drop(job, group, "dropped_invalid", reason)

    async def _train(
        self, jobs: list[OwnedJob], taken: dict[str, list[Group]]
    ) -> dict[str, StepMetrics]:
        """One optimizer step per job on its groups' rewarded trajectories (advantages per
        group), all jobs in one `train_steps` call."""
        batches: dict[str, tuple[list[Trajectory], list[float]]] = {}
        for job in jobs:
            trajectories: list[Trajectory] = []
            advantages: list[float] = []
            for group in taken[job.spec.job_id]:
                valid = group.valid
                trajectories += valid
                advantages += group_advantages_of(
                    [t.reward for t in valid], std_normalize=job.spec.rl.std_normalize
                )
            batches[job.spec.job_id] = (trajectories, advantages)
        versions = {job.spec.job_id: job.version for job in jobs}
        policy_metrics = await self.compute.run(self.policy.train_steps, batches, versions)
        out: dict[str, StepMetrics] = {}
        for job in jobs:
            job_id = job.spec.job_id
            trajectories = batches[job_id][0]
            lags = [job.version - group.oldest_version for group in taken[job_id]]
            metrics = StepMetrics.of(policy_metrics[job_id])
            metrics.mean_reward = sum(t.reward for t in trajectories) / len(trajectories)
            metrics.staleness_max = float(max(lags))
            metrics.staleness_mean = sum(lags) / len(lags)
            metrics.samples = float(len(trajectories))
            metrics.resampled_groups = float(job.resampled)
            metrics.tool_calls, metrics.tool_errors = _tool_means(trajectories)
            job.resampled = 0
            out[job_id] = metrics
        return out

    async def _publish(
        self, job: OwnedJob, version: int, uri: str, groups: list[Group], metrics: StepMetrics
    ) -> bool:
        """Move the pointer (the job's trained version) and mark the groups trained in one
        atomic step, announce the version to rollout_svc and env_svc, release the commits."""
        job_id = job.spec.job_id
        if not await self._publish_pointer(job, version, uri, [g.group_id for g in groups]):
            return False
        fault_point("trainer.after_pointer")
        job.version = version
        fault_point("trainer.before_update")
        await self._announce(job_id, version, uri, metrics)
        fault_point("trainer.after_update")
        for group in groups:
            group.release()
        return True

    async def _announce(
        self, job_id: str, version: int, uri: str, metrics: StepMetrics | None = None
    ) -> None:
        """Tell rollout_svc and env_svc that `version` is published (with the step's
        metrics; none when a restart announces it again)."""
        await self.io.send(
            AdapterUpdate(
                job_id=job_id,
                version=version,
                uri=uri,
                step=version,
                metrics=metrics.as_map() if metrics else {},
                published_at=time.time(),
            )
        )

    async def _publish_pointer(
        self, job: OwnedJob, version: int, uri: str, group_ids: Sequence[str]
    ) -> bool:
        """Move the pointer with this replica's epoch; False (the job given up, its groups
        left to the new owner) when another replica took the job over meanwhile."""
        store, job_id = self.io.require_store(), job.spec.job_id
        try:
            moved = await durably(
                f"publishing {job_id} v{version}",
                lambda: store.publish_adapter(
                    job_id, version, uri, version, group_ids, epoch=job.epoch
                ),
            )
        except FencedError as exc:
            job_logger(log, job_id, job.spec.tenant).warning("%s; job given up", exc)
            self._disown(job_id)
            return False
        if moved:
            return True
        # Not newer: our own publish whose answer a Redis blip lost (the same version and
        # URI), or someone else's; then this replica's version must not be announced.
        pointer = await durably(f"reading {job_id}'s pointer", partial(store.adapter, job_id))
        if pointer is not None and (pointer.version, pointer.uri) == (version, uri):
            return True
        job_logger(log, job_id, job.spec.tenant).warning(
            "v%d not published: the pointer holds v%d from another writer; job given up",
            version,
            pointer.version if pointer else -1,
        )
        self._disown(job_id)
        return False

    async def _report(self, job: OwnedJob, metrics: StepMetrics, group_ids: list[str]) -> None:
        """The step event, metrics and log line; the job's completion after its last step."""
        spec, version = job.spec, job.version
        await self._step_event(job, version, metrics, group_ids)
        TRAINER_STEPS.labels(spec.job_id, spec.tenant).inc()
        TRAINER_STEP_SECONDS.observe(metrics.wall_step_s or 0.0)
        if (tokens_per_s := metrics.trainer_tokens_per_s) is not None:
            TRAINER_TOKENS_PER_SECOND.labels(spec.job_id).set(tokens_per_s)
        job_log = job_logger(log, spec.job_id, spec.tenant)
        job_log.info(
            "step %d/%d reward %.3f loss %.4f staleness %d zero-advantage %.0f%% "
            "entropy %s kl %s (fresh %s) clip %s (%.1fs)",
            version,
            spec.rl.max_steps,
            metrics.mean_reward,
            metrics.loss or 0.0,
            metrics.staleness_max or 0,
            100 * (metrics.zero_advantage_share or 0.0),
            _shown(metrics.entropy, "{:.2f}"),
            _shown(metrics.approx_kl, "{:.4f}"),
            _shown(metrics.fresh_kl, "{:.4f}"),
            _shown(
                None if metrics.clip_fraction is None else 100 * metrics.clip_fraction, "{:.0f}%"
            ),
            metrics.wall_step_s or 0.0,
        )
        if version >= spec.rl.max_steps:
            await self._complete(job)

    async def _step_event(
        self, job: OwnedJob, version: int, metrics: StepMetrics, group_ids: list[str]
    ) -> None:
        """The `step` event of `version`, then its mark in the pointer (`announced`)."""
        spec, store = job.spec, self.io.require_store()
        await self.io.send(
            job_event(
                spec.job_id,
                "step",
                SERVICE,
                tenant=spec.tenant,
                step=version,
                metrics=metrics.as_map(),
                groups=group_ids,
            )
        )
        await durably(
            f"marking {spec.job_id} v{version} announced",
            partial(store.mark_announced, spec.job_id, version),
        )

    async def _complete(self, job: OwnedJob) -> None:
        spec, store = job.spec, self.io.require_store()
        changed = await durably(
            f"completing {spec.job_id}",
            lambda: store.set_job_status(spec.job_id, STATE_AFTER["completed"]),
        )
        if changed:
            await self.io.send(
                job_event(spec.job_id, "completed", SERVICE, tenant=spec.tenant, step=job.version)
            )
            job_logger(log, spec.job_id, spec.tenant).info("completed after %d steps", job.version)
        await self._ended(job)

    async def _ended(self, job: OwnedJob) -> None:
        """The job has ended: let go of it, and its working state here expires in a week."""
        job_id = job.spec.job_id
        self._release_all(job)
        self._disown(job_id)
        await durably(
            f"expiring {job_id}'s state",
            lambda: self.io.require_store().expire_after_end(working_state_keys(job_id)),
        )

    def _release_all(self, job: OwnedJob) -> None:
        for group in [*job.ready, *job.filling.values()]:
            group.release()
        job.ready.clear()
        job.filling.clear()


def _tool_means(trajectories: Sequence[Trajectory]) -> tuple[float | None, float | None]:
    """Tool calls and errors per episode, from the tool layer's weight-0 reward components;
    (None, None) for environments without tools."""
    calls = [t.reward_components.get(f"{TOOL_METRICS}.calls") for t in trajectories]
    errors = [t.reward_components.get(f"{TOOL_METRICS}.errors", 0.0) for t in trajectories]
    if not trajectories or any(c is None for c in calls):
        return None, None
    return sum(c or 0.0 for c in calls) / len(calls), sum(errors) / len(errors)


def _shown(value: float | None, form: str) -> str:
    """A metric for the step line; "-" where the step did not measure it."""
    return "-" if value is None else form.format(value)
