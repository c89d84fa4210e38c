"""Scoring rollouts: a generation's result advances its episode, into the next turn's request
or the finished trajectory (a training episode's to the trainer, an evaluation episode's
tallied); an episode whose environment, reward or encoding fails ends with the reason."""

from __future__ import annotations

import logging
from functools import partial

from common.runtime.backoff import is_transient
from common.runtime.faults import fault_point
from common.runtime.logs import job_logger
from common.runtime.service import Connections
from common.state.dedup import RESULTS
from common.state.evals import eval_version_of
from common.state.usage import UsageMeter
from common.wire.lifecycle import TERMINAL_STATES
from common.wire.messages import GenerationRequest, GenerationResult, JobSpec, Trajectory
from env_svc.episodes import advance_episode, failed_trajectory
from env_svc.jobs.environments import JobEnvironments
from env_svc.jobs.episode_part import EpisodePart
from env_svc.jobs.evaluations import NOT_EVALUATED, Evaluations
from env_svc.jobs.reasons import reason

log = logging.getLogger(__name__)


class ResultScorer(EpisodePart):
    """Takes each generation result to its episode's next step, once per request id."""

    def __init__(
        self,
        io: Connections,
        environments: JobEnvironments,
        evaluations: Evaluations,
        usage: UsageMeter,
    ) -> None:
        super().__init__(io, environments)
        self.evaluations = evaluations
        self.usage = usage

    async def on_result(self, result: GenerationResult) -> None:
        """One round trip (de-dup and status) before the turn, one after it; none for a
        result of a job known here to have ended (a terminal status sticks)."""
        store = self.io.require_store()
        version = eval_version_of(result.job_id, result.group_id)
        # A completed job's final version is evaluated after its last step.
        ended = NOT_EVALUATED if version is not None else TERMINAL_STATES
        if store.admitted.ended(result.job_id) in ended:
            return
        seen, record = await store.admitted.get_unless_seen(
            RESULTS, result.job_id, result.request_id
        )
        if seen:
            return  # redelivered: its successor was already sent
        if record is None or record.status in ended:
            return
        try:
            await self._advance(record.spec, result, version)
        except Exception as exc:  # environment, reward or encoding: the episode ends here
            if is_transient(exc):
                raise
            await self._fail(record.spec, result, version, reason(exc))
        fault_point("env.after_send")
        await store.dedup.mark_seen(RESULTS, result.job_id, result.request_id)

    async def _advance(self, spec: JobSpec, result: GenerationResult, version: int | None) -> None:
        """The episode's next request sent, or its end: sent, or tallied when it evaluates."""
        env = await self.environments.get(spec)
        follow_up: GenerationRequest | Trajectory = await self.calls.drive(
            f"episode {result.episode_id} turn {result.turn}",
            partial(advance_episode, env, self.tokenizer, spec, result),
            awaits=env.awaits,
        )
        if isinstance(follow_up, Trajectory):
            self._finished(spec, version)
        if version is not None and isinstance(follow_up, Trajectory):
            await self.evaluations.count(
                spec,
                version,
                follow_up.episode_id,
                follow_up.reward,
                dict(follow_up.reward_components),
                follow_up.error,
            )
        else:
            await self.io.producer.send(follow_up)

    async def _fail(
        self, spec: JobSpec, result: GenerationResult, version: int | None, error: str
    ) -> None:
        """The episode ends with `error`: a failed trajectory, or an unsolved evaluation."""
        job_logger(log, spec.job_id, spec.tenant).warning(
            "episode %s failed: %s", result.episode_id, error
        )
        self._finished(spec, version)
        if version is not None:
            await self.evaluations.count(spec, version, result.episode_id, 0.0, {}, error)
        else:
            await self.io.send(failed_trajectory(spec, result, error))

    def _finished(self, spec: JobSpec, version: int | None) -> None:
        """An episode ended here (scored or failed): counted as the job's usage."""
        kind = "episodes" if version is None else "eval_episodes"
        self.usage.add(spec.job_id, spec.tenant, **{kind: 1})
