"""Publishing a job's adapter versions: the Redis pointer (moved with the replica's fencing
epoch), the AdapterUpdate to rollout_svc and env_svc, the step event, metrics and log line,
and finishing what a crash cut short after a checkpoint."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial

from common.runtime.faults import fault_point
from common.runtime.logs import job_logger
from common.runtime.metrics import (
    TRAINER_BUSY_SECONDS,
    TRAINER_STEP_SECONDS,
    TRAINER_STEPS,
    TRAINER_TOKENS_PER_SECOND,
)
from common.state.pointers import FencedError
from common.wire.adapters import AdapterRef
from common.wire.lifecycle import StepMetrics
from common.wire.messages import AdapterUpdate, job_event
from trainer_svc.checkpoints import Checkpoint, CheckpointStore
from trainer_svc.groups import Group
from trainer_svc.owned import OwnedJob
from trainer_svc.roster import SERVICE, Roster, retry_through_outages

log = logging.getLogger(__name__)


class Publisher:
    """Makes a saved version the job's published one, and tells everyone who follows it."""

    def __init__(self, roster: Roster, checkpoints: CheckpointStore) -> None:
        self.roster = roster
        self.io = roster.io
        self.checkpoints = checkpoints

    async def publish(
        self, job: OwnedJob, adapter: AdapterRef, groups: list[Group], metrics: StepMetrics
    ) -> bool:
        """Move the pointer (the job's trained version) and mark the groups trained in one
        atomic step, announce the version to rollout_svc and env_svc, release the commits."""
        if not await self.publish_pointer(job, adapter, [g.group_id for g in groups]):
            return False
        fault_point("trainer.after_pointer")
        job.version = adapter.version
        fault_point("trainer.before_update")
        await self.announce(adapter, metrics)
        fault_point("trainer.after_update")
        for group in groups:
            group.release()
        return True

    async def announce(self, adapter: AdapterRef, metrics: StepMetrics | None = None) -> None:
        """Tell rollout_svc and env_svc that `adapter` is published (with the step's
        metrics; none when a restart announces it again)."""
        await self.io.send(
            AdapterUpdate.of(
                adapter, metrics=metrics.as_map() if metrics else {}, published_at=time.time()
            )
        )

    async def publish_pointer(
        self, job: OwnedJob, adapter: AdapterRef, group_ids: Sequence[str]
    ) -> bool:
        """Move the pointer with this replica's epoch; False (the job given up, its groups
        left to the new owner) when another replica took the job over meanwhile."""
        store, job_id, version = self.io.require_store(), adapter.job_id, adapter.version
        try:
            moved = await retry_through_outages(
                f"publishing {job_id} v{version}",
                lambda: store.adapters.publish(
                    job_id, version, adapter.uri, adapter.step, group_ids, epoch=job.epoch
                ),
            )
        except FencedError as exc:
            job_logger(log, job_id, job.spec.tenant).warning("%s; job given up", exc)
            self.roster.disown(job_id)
            return False
        if moved:
            return True
        # Not newer: our own publish whose answer a Redis blip lost (the same version and
        # URI), or someone else's; then this replica's version must not be announced.
        pointer = await retry_through_outages(
            f"reading {job_id}'s pointer", partial(store.adapters.get, job_id)
        )
        if pointer is not None and (pointer.version, pointer.uri) == (version, adapter.uri):
            return True
        job_logger(log, job_id, job.spec.tenant).warning(
            "v%d not published: the pointer holds v%d from another writer; job given up",
            version,
            pointer.version if pointer else -1,
        )
        self.roster.disown(job_id)
        return False

    async def report(self, job: OwnedJob, metrics: StepMetrics, group_ids: list[str]) -> None:
        """The step event, metrics and log line; the job's completion after its last step."""
        spec, version = job.spec, job.version
        await self.step_event(job, version, metrics, group_ids)
        TRAINER_STEPS.labels(spec.job_id, spec.tenant).inc()
        TRAINER_STEP_SECONDS.observe(metrics.wall_step_s or 0.0)
        TRAINER_BUSY_SECONDS.inc(metrics.step_s or 0.0)
        if (tokens_per_s := metrics.trainer_tokens_per_s) is not None:
            TRAINER_TOKENS_PER_SECOND.labels(spec.job_id).set(tokens_per_s)
        job_logger(log, spec.job_id, spec.tenant).info(
            "step %d/%d reward %.3f loss %.4f staleness %d zero-advantage %.0f%% "
            "entropy %s kl %s (fresh %s) clip %s (%.1fs)",
            version,
            spec.rl.max_steps,
            metrics.mean_reward,
            metrics.loss or 0.0,
            metrics.staleness_max or 0,
            100 * (metrics.zero_advantage_share or 0.0),
            shown(metrics.entropy, "{:.2f}"),
            shown(metrics.approx_kl, "{:.4f}"),
            shown(metrics.fresh_kl, "{:.4f}"),
            shown(
                None if metrics.clip_fraction is None else 100 * metrics.clip_fraction, "{:.0f}%"
            ),
            metrics.wall_step_s or 0.0,
        )
        if version >= spec.rl.max_steps:
            await self.roster.complete(job)

    async def step_event(
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
        await retry_through_outages(
            f"marking {spec.job_id} v{version} announced",
            partial(store.adapters.mark_announced, spec.job_id, version),
        )

    async def reconcile(self, job: OwnedJob, checkpoint: Checkpoint) -> None:
        """Finish what a crash may have cut short after the checkpoint of `job.version`: move
        the pointer (with its groups) if it is behind, announce the version again (readers
        ignore versions they have), and complete a job whose last step was saved."""
        store, job_id, version = self.io.require_store(), job.spec.job_id, job.version
        adapter = self.checkpoints.adapter_ref(checkpoint, job_id)
        pointer = await retry_through_outages(
            f"reading {job_id}'s pointer", partial(store.adapters.get, job_id)
        )
        if pointer is None or pointer.version < version:
            job_logger(log, job_id, job.spec.tenant).warning(
                "v%d was saved but not published; publishing it", version
            )
            if not await self.publish_pointer(job, adapter, checkpoint.group_ids):
                return
        if pointer is None or pointer.version <= version:
            await self.announce(adapter)
            if version > 0 and (pointer is None or pointer.announced < version):
                # Published, its step event not sent (the crash came between): sent now,
                # with the metrics saved with it, so the job's history has every step.
                metrics = StepMetrics.of(checkpoint.step_metrics)
                await self.step_event(job, version, metrics, list(checkpoint.group_ids))
        if version >= job.spec.rl.max_steps:
            await self.roster.complete(job)


def shown(value: float | None, form: str) -> str:
    """A metric for the step line; "-" where the step did not measure it."""
    return "-" if value is None else form.format(value)
