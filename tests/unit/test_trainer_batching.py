"""trainer_svc/batching.py: which ready jobs a step takes, in turn."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import Any

from common.runtime.config import TrainerSettings
from common.wire.messages import EnvSettings, JobSpec
from trainer_svc.batching import Batching
from trainer_svc.owned import OwnedJob


class Turns(Batching):
    """Batching over jobs whose ready groups are all usable (nothing to drop)."""

    async def drop_unusable(self, job: OwnedJob) -> None:
        return None


def groups(count: int) -> list[Any]:
    """Ready groups of version 0 (all a step's choice reads of them)."""
    return [SimpleNamespace(oldest_version=0) for _ in range(count)]


def owned(job_id: str, ready: bool = True) -> OwnedJob:
    spec = JobSpec(job_id=job_id, tenant="t", env=EnvSettings(name="arithmetic"))
    return OwnedJob(
        spec=spec, partition=0, version=0, ready=deque(groups(spec.rl.groups_per_step * ready))
    )


def batching(jobs: list[OwnedJob], max_jobs: int) -> Turns:
    roster = SimpleNamespace(
        jobs={job.spec.job_id: job for job in jobs},
        settings=TrainerSettings(max_jobs_per_step=max_jobs),
    )
    return Turns(roster, caught_up=lambda _: asyncio.sleep(0, True))  # type: ignore[arg-type]


def taken(turns: Batching) -> list[str]:
    return [job.spec.job_id for job in asyncio.run(turns.ready_jobs())]


def test_steps_take_ready_jobs_in_turn_from_after_the_last_taken() -> None:
    jobs = [owned(name) for name in "abcde"]
    two = batching(jobs, max_jobs=2)
    assert [taken(two) for _ in range(4)] == [["a", "b"], ["c", "d"], ["e", "a"], ["b", "c"]]
    one = batching(jobs, max_jobs=1)
    assert [taken(one) for _ in range(6)] == [["a"], ["b"], ["c"], ["d"], ["e"], ["a"]]


def test_a_job_just_taken_waits_for_the_others_even_when_ready_again_first() -> None:
    jobs = [owned("a"), owned("b", ready=False), owned("c", ready=False), owned("d")]
    turns = batching(jobs, max_jobs=1)
    assert taken(turns) == ["a"]
    jobs[2].ready.extend(groups(jobs[2].spec.rl.groups_per_step))
    assert [taken(turns) for _ in range(3)] == [["c"], ["d"], ["a"]]


def test_the_turn_goes_on_where_a_job_that_ended_stood() -> None:
    jobs = [owned(name) for name in "abcd"]
    turns = batching(jobs, max_jobs=1)
    assert [taken(turns) for _ in range(2)] == [["a"], ["b"]]
    del turns.roster.jobs["b"]  # ended
    assert [taken(turns) for _ in range(3)] == [["c"], ["d"], ["a"]]
    assert taken(batching([], max_jobs=1)) == []
