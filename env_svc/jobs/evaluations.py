"""Evaluations on held-out sets (common/state/evals.py): one per evaluated adapter version,
one of a job in flight at a time; each episode's result tallied, the last one's sending the
`eval` event; the sweep finishing, re-sending or starting what a lost replica left."""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from common.runtime.backoff import is_transient
from common.runtime.logs import job_logger
from common.runtime.service import Connections
from common.state.evals import (
    DONE,
    MAX_RESENDS,
    WAITING,
    below_base,
    eval_group_id,
    evaluated,
)
from common.state.registry import JobRecord
from common.wire.messages import GenerationRequest, JobSpec, job_event
from env_svc.episodes import start_eval_episode
from env_svc.jobs import SERVICE
from env_svc.jobs.environments import JobEnvironments
from env_svc.jobs.episode_part import EpisodePart
from env_svc.jobs.reasons import reason
from env_svc.protocol import RewardResult

log = logging.getLogger(__name__)

NOT_EVALUATED = frozenset({"cancelled", "failed", "rejected"})
"""States in which a job's evaluations stop (a completed job's final one goes on)."""


class Evaluations(EpisodePart):
    """Issues, tallies and sweeps a job's evaluations."""

    def __init__(
        self,
        io: Connections,
        environments: JobEnvironments,
        *,
        eval_timeout_s: float,
    ) -> None:
        super().__init__(io, environments)
        self.eval_timeout_s = eval_timeout_s

    async def evaluate(self, record: JobRecord, version: int) -> None:
        """Send the evaluation of adapter `version` when the job evaluates it, once: now, or
        when the job's evaluation in flight has finished (common/state/evals.py)."""
        if record.status in NOT_EVALUATED or not evaluated(record.spec, version):
            return
        if await self.io.require_store().evals.claim(record.spec.job_id, version):
            await self.send(record.spec, version)

    async def send(self, spec: JobSpec, version: int) -> None:
        """The first request of every evaluation episode not counted yet (all of them, but
        when sent again); one whose task cannot start, or whose request cannot be sent (over
        a record's size), is counted at once as unsolved with the reason. Finished at once
        when every episode was counted."""
        counted = await self.io.require_store().evals.seen(spec.job_id, version)
        if len(counted) >= spec.eval.tasks:
            await self.finish(spec, version)
            return
        firsts, failed = await self._first_requests(spec, version, counted)
        sent = await asyncio.gather(*map(self.io.send, firsts), return_exceptions=True)
        for request, outcome in zip(firsts, sent, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception) or is_transient(outcome):
                    raise outcome
                failed.append((request.episode_id, reason(outcome)))
        job_logger(log, spec.job_id, spec.tenant).info(
            "evaluating v%d on %d held-out tasks", version, len(firsts)
        )
        for episode_id, error in failed:
            await self.count(spec, version, episode_id, 0.0, {}, error)

    async def _first_requests(
        self, spec: JobSpec, version: int, counted: set[str]
    ) -> tuple[list[GenerationRequest], list[tuple[str, str]]]:
        """The first request of each episode not `counted`, and (episode id, reason) of
        those whose task cannot start."""
        group_id = eval_group_id(spec.job_id, version)
        firsts: list[GenerationRequest] = []
        failed: list[tuple[str, str]] = []
        for index in range(spec.eval.tasks):
            episode_id = f"{group_id}/{index}"
            if episode_id in counted:
                continue
            try:
                env = await self.environments.get(spec)
                start = partial(
                    start_eval_episode, env, self.tokenizer, spec, version=version, index=index
                )
                what = f"{spec.job_id}: eval {index}"
                firsts.append(await self.calls.drive(what, start, awaits=env.awaits))
            except Exception as exc:
                if is_transient(exc):
                    raise
                failed.append((episode_id, reason(exc)))
        return firsts, failed

    async def count(
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
        state = await self.io.require_store().evals.state(spec.job_id, version)
        if state is None or state in (DONE, WAITING):
            log.debug("result of %s ignored: its evaluation is %s", episode_id, state or "gone")
            return
        solved = not error and (await self.environments.get(spec)).solved(
            RewardResult(total=reward, components=components)
        )
        counted = await self.io.require_store().evals.record(
            spec.job_id, version, episode_id, reward=reward, solved=solved, components=components
        )
        if counted >= spec.eval.tasks:
            await self.finish(spec, version)

    async def finish(self, spec: JobSpec, version: int) -> None:
        """Send the `eval` event with the tally (compared with the base model's), and start
        the job's next evaluation, which waited for this one."""
        store = self.io.require_store()
        tally = await store.evals.tally(spec.job_id, version)
        metrics = tally.metrics()
        # Compared with the base model's (version 0): a job that learned the wrong thing
        # says so in its events, where status, the report and the tracking sinks read it.
        worse = ""
        if version > 0 and (base := await store.evals.tally(spec.job_id, 0)).episodes:
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
        waited = await store.evals.finish(spec.job_id, version)
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
        if waited is not None:
            await self.send(spec, waited)

    async def sweep(self, record: JobRecord) -> None:
        """Finish evaluations whose episodes are all in (their event was not sent), or that
        were sent `MAX_RESENDS` times (with the episodes they have); send the requests of
        other unfinished ones again (those of episodes not counted yet); start one that
        waits when none is in flight (its start was lost with a replica)."""
        store, spec = self.io.require_store(), record.spec
        if record.status in NOT_EVALUATED:
            await store.evals.abandon(spec.job_id)
            return
        for version in await store.evals.take_stale(spec.job_id, self.eval_timeout_s):
            if (await store.evals.tally(spec.job_id, version)).episodes >= spec.eval.tasks:
                await self.finish(spec, version)
            elif await store.evals.count_resend(spec.job_id, version) > MAX_RESENDS:
                await self.finish(spec, version)
            else:
                job_logger(log, spec.job_id, spec.tenant).warning(
                    "evaluation of v%d unfinished; sending its requests again", version
                )
                await self.send(spec, version)
        if (waiting := await store.evals.start_waiting(spec.job_id)) is not None:
            await self.send(spec, waiting)
