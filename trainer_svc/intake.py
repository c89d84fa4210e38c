"""Reading trajectories: taking a job on (fencing its previous owner, resuming its adapter
from its latest checkpoint), assembling its groups, holding each trajectory's offset until
its group was trained or dropped, and handing jobs over when their partition moves."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial

from aiokafka.structs import TopicPartition

from common.bus.kafka import Delivery
from common.runtime.backoff import is_transient
from common.runtime.logs import job_logger
from common.state.dedup import DROPPED, TRAINED
from common.state.flow import group_index_of
from common.wire.lifecycle import TERMINAL_STATES
from common.wire.messages import JobSpec, Topic, Trajectory
from trainer_svc.checkpoints import CheckpointStore
from trainer_svc.compute import ComputeThread
from trainer_svc.groups import Group, checked, not_of_job
from trainer_svc.owned import OwnedJob
from trainer_svc.publish import Publisher
from trainer_svc.roster import Roster, retry_through_outages

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Intake:
    """Trajectories in, ready groups out (`OwnedJob.ready`; `wake` is set for each)."""

    roster: Roster
    publisher: Publisher
    checkpoints: CheckpointStore
    compute: ComputeThread
    wake: asyncio.Event

    async def on_trajectory(self, trajectory: Trajectory, delivery: Delivery) -> None:
        store = self.roster.io.require_store()
        job = self.roster.jobs.get(trajectory.job_id) or await self._own(
            trajectory.job_id, delivery
        )
        if job is None:
            return
        job_id, group_id = job.spec.job_id, trajectory.group_id
        if (foreign := not_of_job(trajectory, job.spec)) is not None:
            job_logger(log, job_id, job.spec.tenant).warning("trajectory ignored: %s", foreign)
            return
        # Redelivered after its group was trained (never train it twice), or of a group
        # dropped and replaced.
        if group_id in job.closed or await store.dedup.seen_in_any(
            (TRAINED, DROPPED), job_id, group_id
        ):
            return
        if group_id not in job.filling and (unissued := await self._unissued(job, group_id)):
            job_logger(log, job_id, job.spec.tenant).warning("trajectory ignored: %s", unissued)
            return
        group = job.filling.setdefault(group_id, Group(group_id))
        if trajectory.episode_id in group.trajectories:
            return  # a duplicate of one we hold; the first copy's commit covers it
        vocab_size = self.roster.policy.vocab_size
        group.add(checked(trajectory, job.spec, vocab_size), delivery.hold_commit())
        if group.complete(job.spec.rl.group_size):
            job.recent_signal.append(not group.uniform)
            job.closed.add(group_id)
            job.ready.append(job.filling.pop(group_id))
            self.wake.set()

    async def on_revoked(self, partitions: set[TopicPartition]) -> None:
        lost = {tp.partition for tp in partitions if tp.topic == Topic.TRAJECTORIES}
        async with self.roster.stepping:  # never take an adapter away from a step in progress
            for job in [job for job in self.roster.jobs.values() if job.partition in lost]:
                # Uncommitted trajectories go to the new owner, which resumes from the
                # checkpoint.
                self.roster.disown(job.spec.job_id)
                job_logger(log, job.spec.job_id, job.spec.tenant).info(
                    "partition revoked, job handed over"
                )

    async def _unissued(self, job: OwnedJob, group_id: str) -> str | None:
        """Why a group's first trajectory is not of a group env_svc issued (the ledger's
        count in Redis, which only env_svc writes), or None."""
        index = group_index_of(job.spec.job_id, group_id)
        issued = (await self.roster.io.require_store().flow.state(job.spec.job_id)).issued_groups
        if index is None or index >= issued:
            return f"group {group_id!r} was never issued ({issued} groups so far)"
        return None

    async def _own(self, job_id: str, delivery: Delivery) -> OwnedJob | None:
        """Take a job on: its adapter and optimizer, resumed from its latest checkpoint."""
        store = self.roster.io.require_store()
        record = await store.jobs.get(job_id)
        if record is None:
            raise ValueError(f"trajectory for unknown job {job_id!r}")
        if record.status in TERMINAL_STATES:
            return None
        spec = record.spec
        # First fence off any previous owner (a replica whose partition moved, or stalled):
        # from here on only this replica can publish the job's versions.
        epoch = await retry_through_outages(
            f"taking {job_id} over", partial(store.adapters.take_over, job_id)
        )
        # Adding an adapter changes the model's modules: never while a step (forward,
        # backward, a checkpoint's state_dict) runs in its thread.
        async with self.roster.stepping:
            return await self._take_on(spec, epoch, delivery.partition)

    async def _take_on(self, spec: JobSpec, epoch: int, partition: int) -> OwnedJob | None:
        job_id, policy = spec.job_id, self.roster.policy
        policy.add_job(job_id, spec.lora, spec.rl, seed=spec.env.seed)
        job = OwnedJob(spec=spec, partition=partition, version=0, epoch=epoch)
        try:
            checkpoint = await self.compute.run(self.checkpoints.resume, policy, job_id)
        except Exception as exc:
            policy.remove_job(job_id)
            if is_transient(exc):
                raise  # not owned after all: the next delivery tries again
            # A checkpoint that cannot be loaded never will be: fail the job with the reason
            # rather than dead-letter its trajectories one by one and stall it.
            reason = f"its checkpoint could not be loaded: {type(exc).__name__}: {exc}"
            await self.roster.fail(job, reason)
            return None
        self.roster.jobs[job_id] = job
        if checkpoint is not None:
            job.version = checkpoint.version
            job_logger(log, job_id, spec.tenant).info(
                "resumed from %s at v%d (epoch %d)", checkpoint.path, job.version, epoch
            )
            await self.publisher.reconcile(job, checkpoint)
        return self.roster.jobs.get(job_id)
