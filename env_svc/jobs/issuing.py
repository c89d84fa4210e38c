"""Issuing groups of prompts: every group the staleness bound allows (flow control in Redis,
common/state/flow.py), each claimed, its G first requests sent, then the claim finished; a
claim never finished (its replica died mid-group) is sent again by the sweep."""

from __future__ import annotations

import logging
from functools import partial

import msgspec

from common.runtime.backoff import is_transient
from common.runtime.faults import fault_point
from common.runtime.logs import job_logger
from common.runtime.service import Connections
from common.state.flow import IssuedGroup, group_id_of
from common.state.registry import JobRecord
from common.wire.lifecycle import TERMINAL_STATES
from common.wire.messages import GenerationRequest, JobSpec, Trajectory
from env_svc.episodes import start_episode, unstarted_trajectory
from env_svc.jobs.environments import JobEnvironments
from env_svc.jobs.episode_part import EpisodePart
from env_svc.jobs.reasons import reason

log = logging.getLogger(__name__)


class GroupIssuer(EpisodePart):
    """Sends the groups of a job's training episodes."""

    def __init__(
        self,
        io: Connections,
        environments: JobEnvironments,
        *,
        claim_timeout_s: float,
    ) -> None:
        super().__init__(io, environments)
        self.claim_timeout_s = claim_timeout_s

    async def issue_groups(self, record: JobRecord) -> None:
        """Issue every group the staleness bound allows now: G requests each."""
        if record.status != "running":
            return
        store, spec = self.io.require_store(), record.spec
        job_id = spec.job_id
        rl = spec.rl
        while (
            group := await store.flow.try_issue_group(
                job_id,
                max_staleness=rl.max_staleness,
                groups_per_step=rl.groups_per_step,
                max_groups=record.job.max_groups,
            )
        ) is not None:
            fault_point("env.after_claim")
            await self.send_group(spec, group)
            job_logger(log, job_id, spec.tenant).debug("issued group %d", group.index)

    async def resend_stale_claims(self, record: JobRecord) -> int:
        """Send again every group of the job claimed more than `claim_timeout_s` ago and never
        finished (an ended job's are finished unsent); returns how many were sent again."""
        store, job_id, resent = self.io.require_store(), record.spec.job_id, 0
        for group in await store.flow.take_stale_claims(job_id, self.claim_timeout_s):
            if record.status in TERMINAL_STATES:
                await store.flow.finish_claim(job_id, group.index)
                continue
            job_logger(log, job_id, record.spec.tenant).warning(
                "group %d was claimed but not all sent; sending it again", group.index
            )
            await self.send_group(record.spec, group)
            resent += 1
        return resent

    async def send_group(self, spec: JobSpec, group: IssuedGroup) -> None:
        """The first request of each of the group's G episodes, then the claim is done.
        Episode ids are deterministic, so sending a group again only makes duplicates that
        env_svc (results by request id) and the trainer (episodes by id) de-duplicate."""
        firsts = []
        for sample_index in range(spec.rl.group_size):
            # Sample with at least the version training had reached when it was issued.
            first = await self.first_request(spec, group.index, sample_index)
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
            await self._fail_group(spec, group, exc)
        await self.io.require_store().flow.finish_claim(spec.job_id, group.index)

    async def _fail_group(self, spec: JobSpec, group: IssuedGroup, exc: Exception) -> None:
        """A group refused for good (e.g. a record over the broker's size limit) ends as
        failed with the reason, instead of a claim every sweep re-sends forever."""
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

    async def first_request(
        self, spec: JobSpec, group_index: int, sample_index: int
    ) -> GenerationRequest | Trajectory:
        """An episode's first request, or, when the environment raises, its failed end."""
        group_id = group_id_of(spec.job_id, group_index)
        try:
            env = await self.environments.get(spec)
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
            error = reason(exc)
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
