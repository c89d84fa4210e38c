"""One training step: B groups of each ready job through the policy in shared passes, each
job's new version saved as a checkpoint, then published. A step that cannot train or save
costs its own jobs their step, never the trainer."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from common.runtime.logs import job_logger
from common.state.usage import UsageMeter
from common.wire.lifecycle import TERMINAL_STATES, TOOL_METRICS, StepMetrics
from common.wire.messages import Trajectory
from trainer_svc.checkpoints import CheckpointStore
from trainer_svc.compute import ComputeThread
from trainer_svc.groups import Group
from trainer_svc.grpo import group_advantages_of
from trainer_svc.owned import OwnedJob
from trainer_svc.publish import Publisher
from trainer_svc.roster import Roster, retry_through_outages

log = logging.getLogger(__name__)

UNSAVED_RETRY_S = 10.0
"""How long a job whose step could not be saved waits before it is trained again."""


@dataclass(eq=False)
class Stepper:
    """Trains, saves and publishes one step of the jobs it is given."""

    roster: Roster
    publisher: Publisher
    checkpoints: CheckpointStore
    compute: ComputeThread
    usage: UsageMeter = field(default_factory=UsageMeter)
    """Each job's trainer seconds and published bytes (common/state/usage.py)."""

    async def step(self, jobs: list[OwnedJob]) -> None:
        """Train B groups of each job in one shared step; then save, publish and report each
        job's new version."""
        live = await self._live(jobs)
        if not live:
            return
        started = time.monotonic()
        taken = {job.spec.job_id: job.take_ready() for job in live}
        try:
            metrics = await self.train(live, taken)
        except Exception as exc:  # a bad batch or a full disk must not stop other tenants
            await self._untrainable(live, taken, exc)
            return
        self._count_pass(live, taken, time.monotonic() - started)
        policy = self.roster.policy
        for job in live:
            job_id, groups = job.spec.job_id, taken[job.spec.job_id]
            version = job.version + 1
            saving = time.monotonic()
            try:
                adapter = await self.compute.run(
                    self.checkpoints.save,
                    policy,
                    job_id,
                    version,
                    [g.group_id for g in groups],
                    job.epoch,
                    metrics[job_id].as_map(),
                )
            except OSError as exc:  # a full disk: this job's step is lost, not the trainer
                await self._unsaved(job, groups, exc)
                continue
            self.usage.add(
                job_id,
                job.spec.tenant,
                trainer_s=time.monotonic() - saving,
                stored_bytes=directory_bytes(
                    self.checkpoints.adapter_dir(job_id, version, job.epoch)
                ),
            )
            metrics[job_id].wall_step_s = time.monotonic() - started
            if await self.publisher.publish(job, adapter, groups, metrics[job_id]):
                await self.publisher.report(job, metrics[job_id], [g.group_id for g in groups])

    def _count_pass(
        self, jobs: list[OwnedJob], taken: dict[str, list[Group]], seconds: float
    ) -> None:
        """A pass's seconds, split among its jobs by the tokens each trained."""
        tokens = {
            job.spec.job_id: sum(len(t.token_ids) for g in taken[job.spec.job_id] for t in g.valid)
            for job in jobs
        }
        total = sum(tokens.values())
        for job in jobs:
            share = tokens[job.spec.job_id] / total if total else 1 / len(jobs)
            self.usage.add(job.spec.job_id, job.spec.tenant, trainer_s=seconds * share)

    async def _live(self, jobs: list[OwnedJob]) -> list[OwnedJob]:
        """The jobs still running, their statuses read in one round trip; the others (ended
        elsewhere) are let go."""
        live: list[OwnedJob] = []
        store = self.roster.io.require_store()
        statuses = await retry_through_outages(
            "reading the jobs' statuses",
            partial(store.jobs.statuses, [job.spec.job_id for job in jobs]),
        )
        for job in jobs:
            status = statuses[job.spec.job_id]
            if status is None or status in TERMINAL_STATES:
                await self.roster.ended(job)
            else:
                live.append(job)
        return live

    async def train(
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
        policy_metrics = await self.compute.run(self.roster.policy.train_steps, batches, versions)
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
            metrics.tool_calls, metrics.tool_errors = tool_means(trajectories)
            job.resampled = 0
            out[job_id] = metrics
        return out

    async def _unsaved(self, job: OwnedJob, groups: list[Group], exc: OSError) -> None:
        """A step whose checkpoint could not be written (a full disk, a volume gone): the
        job's adapter goes back to its last saved version and its groups wait to be trained
        again, after `UNSAVED_RETRY_S`; the trainer and the other jobs' steps go on."""
        spec, policy = job.spec, self.roster.policy
        job_logger(log, spec.job_id, spec.tenant).error(
            "v%d could not be saved (%s: %s); its groups are trained again in %.0fs",
            job.version + 1,
            type(exc).__name__,
            exc,
            UNSAVED_RETRY_S,
        )
        policy.remove_job(spec.job_id)
        policy.add_job(spec.job_id, spec.lora, spec.rl, seed=spec.env.seed)
        await self.compute.run(self.checkpoints.resume, policy, spec.job_id)
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
                await self.step([job])
            return
        (job,) = jobs
        reason = f"training failed: {type(exc).__name__}: {exc}"
        job_logger(log, job.spec.job_id, job.spec.tenant).error("%s", reason, exc_info=exc)
        for group in taken[job.spec.job_id]:
            if self.roster.owns(job):
                await self.roster.drop(job, group, "dropped_invalid", reason)


def tool_means(trajectories: Sequence[Trajectory]) -> tuple[float | None, float | None]:
    """Tool calls and errors per episode, from the tool layer's weight-0 reward components;
    (None, None) for environments without tools."""
    calls = [t.reward_components.get(f"{TOOL_METRICS}.calls") for t in trajectories]
    errors = [t.reward_components.get(f"{TOOL_METRICS}.errors", 0.0) for t in trajectories]
    if not trajectories or any(c is None for c in calls):
        return None, None
    return sum(c or 0.0 for c in calls) / len(calls), sum(errors) / len(errors)


def directory_bytes(directory: Path) -> int:
    """Bytes of the regular files under `directory` (0 when it is gone)."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
