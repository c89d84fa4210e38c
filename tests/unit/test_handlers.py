"""Each service's handlers, driven message by message, on an in-memory bus and store.

The same scenarios run twice: on `MemoryBus` + the store over fakeredis (`memory`), and on
the real producer to Tansu + Valkey (`kafka`, marker `kafka`), reading back what was
produced. Only rollout_svc's engine is a stand-in (a gated, deterministic engine): its
real counterpart is tested in tests/integration/test_rollout_engine.py and the pipeline test.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from common.state.flow import issue_limit
from common.state.keyspace import evals_key
from common.state.tenants import samples_in_flight
from common.wire import codec as wire
from common.wire.messages import (
    AdapterUpdate,
    EvalSettings,
    GenerationRequest,
    GroupDropped,
    JobCommand,
    JobSpec,
    Message,
    Topic,
    Trajectory,
    new_id,
    result_for,
)
from env_svc.chat_template import ChatTokenizer
from env_svc.protocol import environment_for
from env_svc.service import EnvService
from rollout_svc.jobs import IDLE_JOB_S
from tests.fakes import Backend, Inbox
from tests.handler_kit import (
    GatedEngine,
    adapter_update,
    adapter_uri,
    env_service,
    events,
    job_spec,
    register_running,
    request_for,
    rollout_service,
    trainer_service,
    trajectory,
)
from trainer_svc.service import TrainerService

# --- env_svc ----------------------------------------------------------------------------


async def test_env_svc_issues_exactly_the_groups_the_window_allows(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    service = env_service(backend, tokenizer)
    jobs, rollouts = Inbox(Topic.JOBS), Inbox(Topic.ADAPTERS)
    G, B, S = 3, 2, 1
    spec = job_spec("window", group_size=G, groups_per_step=B, max_staleness=S, max_steps=10)
    job_id = spec.job_id

    async def requests(expect: int) -> list[GenerationRequest]:
        sent = await backend.sent(Topic.PROMPTS, job_id, expect=expect)
        assert all(isinstance(m, GenerationRequest) for m in sent)
        return sent  # type: ignore[return-value]

    await jobs.hand(service.handle, spec)
    issued = await requests(issue_limit(0, S, B) * G)
    assert len(issued) == 4 * G  # (0 + S + 1) * B groups of G
    assert sorted({r.group_id for r in issued}) == [f"{job_id}/g{i}" for i in range(4)]
    assert {r.min_adapter_version for r in issued} == {0}
    assert len(events(await backend.sent(Topic.EVENTS, job_id, expect=1), "accepted")) == 1
    record = await backend.store.jobs.get(job_id)
    assert record is not None and record.status == "running"

    await jobs.hand(service.handle, spec)  # redelivered: nothing new
    assert len(await requests(4 * G)) == 4 * G

    # The trainer moved the pointer (the trained version) and announced it: B more groups.
    await backend.store.adapters.publish(job_id, 1, adapter_uri(job_id, 1), 1)
    await rollouts.hand(service.handle, adapter_update(job_id, 1))
    issued = await requests(6 * G)
    assert len(issued) == 6 * G
    assert {r.min_adapter_version for r in issued[4 * G :]} == {1}

    # A dropped group is counted out of the window and replaced, once.
    await backend.store.flow.record_dropped_group(job_id, f"{job_id}/g0", invalid=False)
    await rollouts.hand(
        service.handle,
        GroupDropped(job_id=job_id, group_id=f"{job_id}/g0", verdict="dropped_stale"),
    )
    assert len(await requests(7 * G)) == 7 * G

    # Paused: a new version issues nothing until the job is resumed.
    await jobs.hand(service.handle, JobCommand(command_id=new_id(), job_id=job_id, action="pause"))
    await backend.store.adapters.publish(job_id, 2, adapter_uri(job_id, 2), 2)
    await rollouts.hand(service.handle, adapter_update(job_id, 2))
    assert len(await requests(7 * G)) == 7 * G
    await jobs.hand(service.handle, JobCommand(command_id=new_id(), job_id=job_id, action="resume"))
    issued = await requests(9 * G)
    assert len(issued) == 9 * G  # 9 issued - 1 dropped = (2 + S + 1) * B live
    kinds = [e.event for e in await backend.sent(Topic.EVENTS, job_id, expect=3)]  # type: ignore[union-attr]
    assert kinds == ["accepted", "paused", "resumed"]
    assert jobs.committable == 4 and rollouts.committable == 3  # nothing held


async def test_env_svc_rejects_a_bad_job_with_its_reason_and_issues_nothing(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    service = env_service(backend, tokenizer)
    spec = job_spec(
        "bad", env="no-such-env", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1
    )
    await Inbox(Topic.JOBS).hand(service.handle, spec)
    (rejected,) = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=1), "rejected")
    assert "unknown environment 'no-such-env'" in rejected.reason
    assert await backend.sent(Topic.PROMPTS, spec.job_id, expect=0) == []
    assert await backend.store.jobs.get(spec.job_id) is None


async def test_env_svc_turns_a_result_into_a_trajectory_once(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    service = env_service(backend, tokenizer)
    spec = job_spec("episode", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1)
    await Inbox(Topic.JOBS).hand(service.handle, spec)
    first, _ = await backend.sent(Topic.PROMPTS, spec.job_id, expect=2)
    assert isinstance(first, GenerationRequest)
    completion = [*tokenizer.encode("7"), tokenizer.eos_token_id]
    result = result_for(
        first,
        completion_token_ids=completion,
        logprobs=[-0.5] * len(completion),
        adapter_version=0,
        finish_reason="stop",
    )
    results = Inbox(Topic.ROLLOUTS)
    await results.hand(service.handle, result)
    await results.hand(service.handle, result)  # redelivered: its trajectory was sent
    (trajectory,) = await backend.sent(Topic.TRAJECTORIES, spec.job_id, expect=1)
    assert isinstance(trajectory, Trajectory)
    assert trajectory.episode_id == first.episode_id and not trajectory.error
    assert trajectory.token_ids == [*first.context_token_ids, *completion]
    assert sum(trajectory.loss_mask) == len(completion)


async def answer_evaluation(
    service: EnvService, tokenizer: ChatTokenizer, requests: list[GenerationRequest]
) -> None:
    """Each evaluation episode's one turn, answered (wrongly: "0")."""
    results = Inbox(Topic.ROLLOUTS)
    completion = [*tokenizer.encode("0"), tokenizer.eos_token_id]
    for request in requests:
        result = result_for(
            request,
            completion_token_ids=completion,
            logprobs=[-0.1] * len(completion),
            adapter_version=request.pinned_adapter_version,
            finish_reason="stop",
        )
        await results.hand(service.handle, result)


async def test_env_svc_evaluates_the_base_every_k_versions_and_the_final_one_greedily(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """One evaluation of a job in flight at a time: versions reached meanwhile wait their
    turn, in order, so its evaluation episodes in flight never pass `eval.tasks`."""
    service = env_service(backend, tokenizer)
    spec = job_spec(
        "evals",
        group_size=2,
        groups_per_step=1,
        max_staleness=0,
        max_steps=3,
        evals=EvalSettings(tasks=3, every_steps=2, seed=4),
    )
    job_id = spec.job_id

    async def evaluations(expect: int) -> dict[str, list[GenerationRequest]]:
        sent = await backend.sent(Topic.PROMPTS, job_id, expect=expect)
        found: dict[str, list[GenerationRequest]] = {}
        for request in sent:
            assert isinstance(request, GenerationRequest)
            if "/eval" in request.group_id:
                found.setdefault(request.group_id, []).append(request)
        for requests in found.values():  # the bus keeps no order across episodes
            requests.sort(key=lambda r: r.episode_id)
        return found

    await Inbox(Topic.JOBS).hand(service.handle, spec)
    (base,) = (await evaluations(2 + 3)).values()
    assert [r.episode_id for r in base] == [f"{job_id}/eval0/{i}" for i in range(3)]
    assert {(r.pinned_adapter_version, r.sampling.temperature) for r in base} == {(0, 0.0)}
    assert base[0].context_token_ids != base[1].context_token_ids  # three distinct tasks
    adapters = Inbox(Topic.ADAPTERS)
    for version in (1, 2, 2, 3):  # v2 redelivered: evaluated once
        await backend.store.adapters.publish(job_id, version, adapter_uri(job_id, version), version)
        await adapters.hand(service.handle, adapter_update(job_id, version))
    found = await evaluations(2 * 3 + 3)
    assert sorted(found) == [f"{job_id}/eval0"]  # v2 and v3 wait for the base's
    states = await backend.store.evals.versions(job_id)
    assert (states[2], states[3]) == ("waiting", "waiting") and float(states[0]) > 0
    await answer_evaluation(service, tokenizer, base)
    found = await evaluations(2 * 3 + 2 * 3)
    assert sorted(found) == [f"{job_id}/eval0", f"{job_id}/eval2"]
    assert {r.pinned_adapter_version for r in found[f"{job_id}/eval2"]} == {2}
    await answer_evaluation(service, tokenizer, found[f"{job_id}/eval2"])
    found = await evaluations(2 * 3 + 3 * 3)
    assert sorted(found) == [f"{job_id}/eval{v}" for v in (0, 2, 3)]
    assert all(len(requests) == 3 for requests in found.values())
    # The same held-out tasks for every version.
    assert [r.context_token_ids for r in found[f"{job_id}/eval3"]] == [
        r.context_token_ids for r in base
    ]
    await answer_evaluation(service, tokenizer, found[f"{job_id}/eval3"])
    steps = [e.step for e in events(await backend.sent(Topic.EVENTS, job_id, expect=4), "eval")]
    assert steps == [0, 2, 3]
    assert await backend.store.evals.versions(job_id) == {0: "done", 2: "done", 3: "done"}


async def test_a_job_evaluating_every_version_has_one_evaluation_in_flight(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """A tenant's job evaluating 16 tasks at every one of 10 fast versions: its evaluation
    episodes in flight stay within the 16 its quota counts (the review saw 176 with 18
    counted), and every version is evaluated in the end."""
    service = env_service(backend, tokenizer)
    spec = job_spec(
        "often",
        group_size=2,
        groups_per_step=1,
        max_staleness=0,
        max_steps=10,
        evals=EvalSettings(tasks=16, every_steps=1),
    )
    job_id = spec.job_id
    assert samples_in_flight(spec) == 2 + 16
    await Inbox(Topic.JOBS).hand(service.handle, spec)
    adapters, answered = Inbox(Topic.ADAPTERS), 0
    for version in range(1, 11):
        await backend.store.adapters.publish(job_id, version, adapter_uri(job_id, version), version)
        await adapters.hand(service.handle, adapter_update(job_id, version))
    for _ in range(11):
        sent = await backend.sent(Topic.PROMPTS, job_id, expect=10 * 2 + answered + 16)
        evaluating = [r for r in sent if isinstance(r, GenerationRequest) and "/eval" in r.group_id]
        assert len(evaluating) - answered == 16  # in flight: one evaluation's tasks
        await answer_evaluation(service, tokenizer, evaluating[answered:])
        answered += 16
    evals = events(await backend.sent(Topic.EVENTS, job_id, expect=12), "eval")
    assert [e.step for e in evals] == list(range(11))


async def evaluated_job(
    backend: Backend, tokenizer: ChatTokenizer, name: str, tasks: int, **settings: Any
) -> tuple[EnvService, JobSpec, list[Message]]:
    """env_svc (`settings`) and a 2-step job evaluated on `tasks` held-out tasks, accepted:
    the service, the spec and the requests it sent (two episodes, the base's evaluation)."""
    service = env_service(backend, tokenizer, **settings)
    spec = job_spec(
        name,
        group_size=2,
        groups_per_step=1,
        max_staleness=0,
        max_steps=2,
        evals=EvalSettings(tasks=tasks),
    )
    await Inbox(Topic.JOBS).hand(service.handle, spec)
    return service, spec, await backend.sent(Topic.PROMPTS, spec.job_id, expect=2 + tasks)


async def test_env_svc_tallies_evaluation_episodes_once_and_sends_one_eval_event(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """Evaluation episodes never reach the trainer; the last one in sends `eval` with the
    accuracy and its standard error; a redelivered result is not counted twice."""
    service, spec, sent = await evaluated_job(backend, tokenizer, "tally", 4)
    evals = [r for r in sent if isinstance(r, GenerationRequest) and "/eval0/" in r.episode_id]
    env = environment_for(spec)
    results = Inbox(Topic.ROLLOUTS)
    for request in evals:
        index = int(request.episode_id.rsplit("/", 1)[1])
        task = env.eval_task_for(spec.eval.seed, index)
        answer = str(task.answer) if index < 3 else "no idea"  # type: ignore[attr-defined]
        completion = [*tokenizer.encode(answer), tokenizer.eos_token_id]
        result = result_for(
            request,
            completion_token_ids=completion,
            logprobs=[-0.1] * len(completion),
            adapter_version=0,
            finish_reason="stop",
        )
        await results.hand(service.handle, result)
        if index == 0:
            await results.hand(service.handle, result)  # redelivered: counted once
    assert await backend.sent(Topic.TRAJECTORIES, spec.job_id, expect=0) == []
    (event,) = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=2), "eval")
    assert event.step == 0
    assert event.metrics["eval_episodes"] == 4 and event.metrics["eval_accuracy"] == 0.75
    assert event.metrics["eval_accuracy_stderr"] == pytest.approx((0.75 * 0.25 / 4) ** 0.5)
    assert event.metrics["eval_reward/correct"] == 0.75
    assert await backend.store.evals.versions(spec.job_id) == {0: "done"}


async def test_env_svc_sweep_finishes_or_resends_an_evaluation_left_behind(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """A replica died after the last episode was counted (no event), or requests were lost:
    the sweep sends the missing event, or sends the evaluation's requests again."""
    service, spec, first_sent = await evaluated_job(
        backend, tokenizer, "sweep", 2, eval_timeout_s=0.2
    )
    job_id = spec.job_id
    for index in range(2):  # both counted, the event never sent
        await backend.store.evals.record(
            job_id, 0, f"{job_id}/eval0/{index}", reward=1.0, solved=index == 0, components={}
        )
    await backend.store.adapters.publish(job_id, 2, adapter_uri(job_id, 2), 2)
    # Reached while the base's evaluation is in flight: v2 waits for it.
    assert not await backend.store.evals.claim(job_id, 2)
    await asyncio.sleep(0.3)
    await service.sweep_claims()
    (event,) = events(await backend.sent(Topic.EVENTS, job_id, expect=2), "eval")
    assert (event.step, event.metrics["eval_accuracy"]) == (0, 0.5)
    sent = await backend.sent(Topic.PROMPTS, job_id, expect=len(first_sent) + 2)
    evaluating = sorted(r.episode_id for r in sent if "/eval" in r.episode_id)  # type: ignore[union-attr]
    assert evaluating == [
        f"{job_id}/eval0/0",
        f"{job_id}/eval0/1",
        f"{job_id}/eval2/0",
        f"{job_id}/eval2/1",
    ]
    evals = await backend.store.evals.versions(job_id)
    assert evals[0] == "done" and evals[2] != "done"
    # One episode of v2 is counted, the other's result never comes (lost mid-episode): its
    # request alone is sent again, twice, then the evaluation ends with the episodes it has,
    # so a watcher waiting for it is not left waiting forever.
    await backend.store.evals.record(
        job_id, 2, f"{job_id}/eval2/0", reward=0.0, solved=False, components={}
    )
    for _ in range(3):
        await asyncio.sleep(0.3)
        await service.sweep_claims()
    # Besides: v2's first sending, and the job's second (last) group of 2, issued at v2.
    sent = await backend.sent(Topic.PROMPTS, job_id, expect=len(first_sent) + 2 + 2 + 2)
    v2 = [r.episode_id for r in sent if "/eval2/" in r.episode_id]  # type: ignore[union-attr]
    assert len(sent) == len(first_sent) + 2 + 2 + 2
    assert v2[2:] == [f"{job_id}/eval2/1"] * 2
    final = events(await backend.sent(Topic.EVENTS, job_id, expect=3), "eval")[-1]
    assert (final.step, final.metrics["eval_episodes"]) == (2, 1)
    assert (await backend.store.evals.versions(job_id))[2] == "done"


async def test_an_evaluation_request_too_large_to_send_is_an_unsolved_episode(
    backend: Backend, tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record over the broker's size limit is refused before it is sent; an evaluation's
    becomes an unsolved episode with the reason, as a training group's becomes a failed
    group, and the replica goes on (the review saw one crash a replica from the sweep)."""
    monkeypatch.setattr(wire, "MAX_RECORD_BYTES", 400)  # its requests (~500 bytes) are over it
    _, spec, sent = await evaluated_job(backend, tokenizer, "large", 2)
    assert not [m for m in sent if isinstance(m, GenerationRequest)]
    (event,) = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=2), "eval")
    assert (event.metrics["eval_episodes"], event.metrics["eval_accuracy"]) == (2, 0.0)
    assert await backend.store.evals.versions(spec.job_id) == {0: "done"}
    failed = await backend.sent(Topic.TRAJECTORIES, spec.job_id, expect=2)
    assert all("over the 400-byte limit" in t.error for t in failed)  # type: ignore[union-attr]


async def test_a_waiting_evaluation_whose_start_was_lost_is_started_by_the_sweep(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """The replica that finished an evaluation died before it started the next: the sweep
    starts it; a cancelled job's waiting evaluations end instead of holding its state."""
    service, spec, first_sent = await evaluated_job(backend, tokenizer, "lost", 2)
    job_id = spec.job_id
    assert not await backend.store.evals.claim(job_id, 2)  # waits behind the base's
    await backend.store.client.hset(evals_key(job_id), "0", "done")  # finished, v2 not started
    await service.sweep_claims()
    sent = await backend.sent(Topic.PROMPTS, job_id, expect=len(first_sent) + 2)
    assert sorted(r.episode_id for r in sent[len(first_sent) :]) == [  # type: ignore[union-attr]
        f"{job_id}/eval2/0",
        f"{job_id}/eval2/1",
    ]
    assert not await backend.store.evals.claim(job_id, 3)
    await Inbox(Topic.JOBS).hand(
        service.handle, JobCommand(command_id=new_id(), job_id=job_id, action="cancel")
    )
    await service.sweep_claims()
    assert set((await backend.store.evals.versions(job_id)).values()) == {"done"}


# --- trainer_svc ------------------------------------------------------------------------


async def test_trainer_drops_stale_groups_trains_b_and_publishes_each_version_once(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    spec = job_spec("trainer", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    job_id = spec.job_id
    service = await trainer_service(backend, tiny_dir, tmp_path)
    await register_running(backend.store, spec)
    inbox = Inbox(Topic.TRAJECTORIES)

    await inbox.hand(service.on_trajectory, trajectory(spec, 0, 0, 0.0, version=0))
    assert inbox.committable == 0  # held until its group is trained
    assert not await service.train_once()  # the group is not complete
    await inbox.hand(service.on_trajectory, trajectory(spec, 0, 1, 1.0, version=0))
    assert await service.train_once()
    assert inbox.committable == 2
    pointer = await backend.store.adapters.get(job_id)
    assert pointer is not None and pointer.version == 1

    # Group 1 was sampled with v0 (stale at S = 0), group 2 with v1.
    for group, version in ((1, 0), (2, 1)):
        for sample, reward in enumerate((0.0, 1.0)):
            await inbox.hand(
                service.on_trajectory, trajectory(spec, group, sample, reward, version)
            )
    assert inbox.committable == 2
    assert await service.train_once()
    assert inbox.committable == 6 and not await service.train_once()

    updates = await backend.sent(Topic.ADAPTERS, job_id, expect=2)
    assert [(u.version, u.step) for u in updates] == [(1, 1), (2, 2)]  # type: ignore[union-attr]
    (dropped,) = await backend.sent(Topic.CONTROL, job_id, expect=1)
    assert isinstance(dropped, GroupDropped)
    assert (dropped.group_id, dropped.verdict) == (f"{job_id}/g1", "dropped_stale")
    assert (await backend.store.flow.state(job_id)).dropped_groups == 1
    sent_events = await backend.sent(Topic.EVENTS, job_id, expect=4)
    assert [e.event for e in sent_events] == [  # type: ignore[union-attr]
        "step",
        "dropped_stale",
        "step",
        "completed",
    ]
    steps = events(sent_events, "step")
    assert [s.metrics["samples"] for s in steps] == [2.0, 2.0]
    assert all(s.metrics["mean_reward"] == 0.5 for s in steps)
    record = await backend.store.jobs.get(job_id)
    assert record is not None and record.status == "completed"

    # A redelivered trajectory of the finished job is neither trained nor held.
    await inbox.hand(service.on_trajectory, trajectory(spec, 0, 0, 0.0, version=0))
    assert inbox.committable == 7 and not await service.train_once()


@pytest.mark.parametrize("stale_wait_s", [30.0, 0.0])
async def test_a_step_waits_for_an_older_group_it_would_leave_too_stale(
    backend: Backend, tiny_dir: Path, tmp_path: Path, stale_wait_s: float
) -> None:
    """S = 1, B = 1, at v1: group 1 (first sample with v0) is still filling when group 2
    (v1) completes. Trained at once, group 2 makes v2 and group 1, two versions behind, is
    dropped; the step waits for group 1 and trains it first, then group 2. With
    TRAINER_STALE_WAIT_S = 0 it does not wait."""
    spec = job_spec("wait", group_size=2, groups_per_step=1, max_staleness=1, max_steps=3)
    service = await trainer_service(backend, tiny_dir, tmp_path, stale_wait_s=stale_wait_s)
    await register_running(backend.store, spec)
    inbox = Inbox(Topic.TRAJECTORIES)
    for sample, reward in enumerate((0.0, 1.0)):
        await inbox.hand(service.on_trajectory, trajectory(spec, 0, sample, reward, version=0))
    assert await service.train_once()  # v1
    await inbox.hand(service.on_trajectory, trajectory(spec, 1, 0, 0.0, version=0))
    for sample, reward in enumerate((0.0, 1.0)):
        await inbox.hand(service.on_trajectory, trajectory(spec, 2, sample, reward, version=1))
    if stale_wait_s:
        assert not await service.train_once()  # group 2 is ready, but waits for group 1
        await inbox.hand(service.on_trajectory, trajectory(spec, 1, 1, 1.0, version=0))
        assert await service.train_once() and await service.train_once()  # g1, then g2
        assert await backend.sent(Topic.CONTROL, spec.job_id, expect=0) == []
        steps = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=4), "step")
        assert [s.metrics["staleness_mean"] for s in steps] == [0.0, 1.0, 1.0]
    else:
        assert await service.train_once()  # group 2 at once: v2
        await inbox.hand(service.on_trajectory, trajectory(spec, 1, 1, 1.0, version=0))
        assert not await service.train_once()
        (dropped,) = await backend.sent(Topic.CONTROL, spec.job_id, expect=1)
        assert isinstance(dropped, GroupDropped) and dropped.group_id == f"{spec.job_id}/g1"


@dataclass
class ResamplingJob:
    """A running job with dynamic sampling on a trainer, fed whole groups of two."""

    spec: JobSpec
    service: TrainerService
    inbox: Inbox

    @classmethod
    async def start(
        cls,
        backend: Backend,
        tiny_dir: Path,
        tmp_path: Path,
        name: str,
        *,
        max_staleness: int,
        max_steps: int,
        cap: int,
    ) -> ResamplingJob:
        spec = job_spec(
            name,
            group_size=2,
            groups_per_step=1,
            max_staleness=max_staleness,
            max_steps=max_steps,
            resample_uniform_groups=cap,
        )
        service = await trainer_service(backend, tiny_dir, tmp_path)
        await register_running(backend.store, spec)
        return cls(spec, service, Inbox(Topic.TRAJECTORIES))

    async def hand(self, group: int, rewards: tuple[float, float], version: int) -> None:
        """Group `group`'s two trajectories, sampled with adapter `version`."""
        for sample, reward in enumerate(rewards):
            await self.inbox.hand(
                self.service.on_trajectory, trajectory(self.spec, group, sample, reward, version)
            )


async def test_trainer_resamples_groups_without_signal_up_to_the_jobs_cap(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """Dynamic sampling: a group whose rewards are all equal is dropped (`dropped_uniform`),
    which frees its place in the window for env_svc to issue another, at most
    `resample_uniform_groups` per step; past the cap such a group is trained (that step
    then leaves the adapter where it was)."""
    job = await ResamplingJob.start(
        backend, tiny_dir, tmp_path, "resample", max_staleness=1, max_steps=2, cap=1
    )
    spec, service, inbox = job.spec, job.service, job.inbox
    job_id = spec.job_id
    # g0 all solved: resampled; g1 has a signal: trained.
    await job.hand(0, (1.0, 1.0), 0)
    await job.hand(1, (0.0, 1.0), 0)
    assert await service.train_once()
    # g2 and g3 all failed: the cap counts again from the step; g2 resampled, g3 trained.
    await job.hand(2, (0.0, 0.0), 1)
    await job.hand(3, (0.0, 0.0), 1)
    assert await service.train_once()
    assert not await service.train_once()
    assert inbox.committable == 8

    dropped = await backend.sent(Topic.CONTROL, job_id, expect=2)
    assert [(d.group_id, d.verdict) for d in dropped] == [  # type: ignore[union-attr]
        (f"{job_id}/g0", "dropped_uniform"),
        (f"{job_id}/g2", "dropped_uniform"),
    ]
    flow = await backend.store.flow.state(job_id)
    assert (flow.dropped_groups, flow.failed_in_a_row) == (2, 0)
    sent_events = await backend.sent(Topic.EVENTS, job_id, expect=5)
    assert [e.event for e in sent_events] == [  # type: ignore[union-attr]
        "dropped_uniform",
        "step",
        "dropped_uniform",
        "step",
        "completed",
    ]
    steps = events(sent_events, "step")
    assert [s.metrics["resampled_groups"] for s in steps] == [1.0, 1.0]
    assert [s.metrics["zero_advantage_share"] for s in steps] == [0.0, 1.0]


async def test_trainer_stops_resampling_while_few_recent_groups_had_a_signal(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """A job that solves (or fails) nearly everything would generate its whole resampling
    cap each step for nothing: once a few groups are in, a uniform group is resampled only
    while at least MIN_SIGNAL_SHARE of the job's recent groups had a signal, far below its
    cap here, and resampling resumes when signal returns."""
    job = await ResamplingJob.start(
        backend, tiny_dir, tmp_path, "solved", max_staleness=4, max_steps=3, cap=8
    )
    service, hand, job_id = job.service, job.hand, job.spec.job_id
    for group in (0, 1, 2):  # fewer than 4 groups in: resampled
        await hand(group, (1.0, 1.0), 0)
        assert not await service.train_once()
    await hand(3, (1.0, 1.0), 0)  # 4 groups, none with a signal: trained as it is
    assert await service.train_once()
    await hand(4, (0.0, 1.0), 1)
    await hand(5, (1.0, 0.0), 1)
    assert await service.train_once()  # g4
    await hand(6, (1.0, 1.0), 2)  # 2 of the last 7 had a signal: worth it again
    assert await service.train_once()  # g5; g6 resampled
    assert not await service.train_once()

    dropped = await backend.sent(Topic.CONTROL, job_id, expect=4)
    assert [(d.group_id, d.verdict) for d in dropped] == [  # type: ignore[union-attr]
        (f"{job_id}/g{group}", "dropped_uniform") for group in (0, 1, 2, 6)
    ]
    steps = events(await backend.sent(Topic.EVENTS, job_id, expect=8), "step")
    assert [s.metrics["resampled_groups"] for s in steps] == [3.0, 0.0, 1.0]
    assert [s.metrics["zero_advantage_share"] for s in steps] == [1.0, 0.0, 0.0]


async def test_trainer_trains_ready_jobs_together_up_to_its_limit(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    specs = [
        job_spec(f"shared{i}", group_size=2, groups_per_step=1, max_staleness=1, max_steps=3)
        for i in range(3)
    ]
    service = await trainer_service(backend, tiny_dir, tmp_path, max_jobs_per_step=2)
    inbox = Inbox(Topic.TRAJECTORIES)
    for spec in specs:
        await register_running(backend.store, spec)
        for sample, reward in enumerate((0.0, 1.0)):
            await inbox.hand(service.on_trajectory, trajectory(spec, 0, sample, reward, 0))

    assert await service.train_once()  # two of the three ready jobs, in one shared step
    assert await service.train_once()  # the third
    assert not await service.train_once()
    assert inbox.committable == 6
    jobs_in_step = []
    for spec in specs:
        (update,) = await backend.sent(Topic.ADAPTERS, spec.job_id, expect=1)
        assert isinstance(update, AdapterUpdate) and update.version == 1
        (step,) = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=1), "step")
        assert step.metrics["samples"] == 2.0 and step.metrics["step_s"] > 0
        jobs_in_step.append(step.metrics["jobs_in_step"])
    assert sorted(jobs_in_step) == [1.0, 2.0, 2.0]


# --- rollout_svc ------------------------------------------------------------------------


async def test_rollout_releases_a_prompt_only_after_its_result_was_sent(
    backend: Backend,
) -> None:
    engine = GatedEngine()
    service = rollout_service(backend, engine)
    job_id = f"rollout-{new_id()[:8]}"
    # The pointer is at v1 but this replica never saw the broadcast: it reads the store.
    await backend.store.adapters.publish(job_id, 1, adapter_uri(job_id, 1), 1)
    prompts = Inbox(Topic.PROMPTS)
    await prompts.hand(service.on_request, request_for(job_id, 0, min_adapter_version=0))
    await prompts.hand(service.on_request, request_for(job_id, 1, min_adapter_version=1))
    await asyncio.sleep(0.05)
    assert prompts.committable == 0 and engine.in_flight == 2  # both held, in the engine
    assert await backend.sent(Topic.ROLLOUTS, job_id, expect=0) == []

    engine.gate.set()
    await asyncio.wait_for(asyncio.gather(*service.slots.generations), 10)
    assert prompts.committable == 2
    results = await backend.sent(Topic.ROLLOUTS, job_id, expect=2)
    assert sorted((r.request_id, r.adapter_version) for r in results) == [  # type: ignore[union-attr]
        (f"{job_id}/0/0/t0", 0),
        (f"{job_id}/1/0/t0", 1),
    ]
    assert [(a.job_id, a.version) for a in engine.loaded] == [(job_id, 1)]


async def test_rollout_samples_an_evaluation_with_exactly_its_pinned_version(
    backend: Backend,
) -> None:
    engine = GatedEngine()
    engine.gate.set()
    service = rollout_service(backend, engine)
    job_id = f"pinned-{new_id()[:8]}"
    for version in (1, 2):
        await backend.store.adapters.publish(
            job_id, version, Path(adapter_uri(job_id, version)).as_uri(), version
        )
    await service.on_adapter(adapter_update(job_id, 2))
    prompts = Inbox(Topic.PROMPTS)
    for index, pinned in enumerate((0, 1, 2, 7)):  # 7 was never published
        request = request_for(job_id, index, min_adapter_version=2)
        request = msgspec.structs.replace(request, pinned_adapter_version=pinned)
        await prompts.hand(service.on_request, request)
    await asyncio.wait_for(asyncio.gather(*service.slots.generations), 10)
    used = sorted((a.version, str(a.path)) if a else (0, "base") for a in engine.used)
    latest = str(service.latest[job_id].path)  # v2 as its broadcast named it
    assert used == [(0, "base"), (1, adapter_uri(job_id, 1)), (2, latest)]
    assert engine.retired == [(job_id, 1)]  # an older version leaves after its request
    results = {r.request_id: r for r in await backend.sent(Topic.ROLLOUTS, job_id, expect=4)}  # type: ignore[union-attr]
    assert [results[f"{job_id}/{i}/0/t0"].adapter_version for i in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    assert results[f"{job_id}/3/0/t0"].finish_reason == "abort"  # type: ignore[union-attr]


async def test_rollout_forgets_a_job_idle_past_its_time_and_reads_it_again(
    backend: Backend,
) -> None:
    """A replica's entries per job (its newest adapter, its tenant) go once the job has had
    no request for `IDLE_JOB_S` (they piled up with every job ever served), its adapter
    leaves the engine, and a later request reads the pointer again."""
    engine = GatedEngine()
    engine.gate.set()
    service = rollout_service(backend, engine)
    job_id = f"idle-{new_id()[:8]}"
    await backend.store.adapters.publish(job_id, 1, Path(adapter_uri(job_id, 1)).as_uri(), 1)
    await service.on_adapter(adapter_update(job_id, 1))
    prompts = Inbox(Topic.PROMPTS)
    await prompts.hand(service.on_request, request_for(job_id, 0, min_adapter_version=1))
    await asyncio.wait_for(asyncio.gather(*service.slots.generations), 10)
    await service.forget_idle(time.monotonic())
    assert job_id in service.latest
    await service.forget_idle(time.monotonic() + IDLE_JOB_S + 1)
    assert job_id not in service.latest and job_id not in service.jobs.tenants
    assert (job_id, 1) in engine.retired
    await prompts.hand(service.on_request, request_for(job_id, 1, min_adapter_version=1))
    await asyncio.wait_for(asyncio.gather(*service.slots.generations), 10)
    assert service.latest[job_id].version == 1
    results = await backend.sent(Topic.ROLLOUTS, job_id, expect=2)
    assert [r.adapter_version for r in results] == [1, 1]  # type: ignore[union-attr]


async def test_env_svc_says_when_a_version_is_worse_than_the_base_on_held_out_tasks(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """A version below the base model by more than the standard error of the difference:
    its `eval` event carries the base's accuracy, a flag and the reason (issue 26)."""
    service, spec, _ = await evaluated_job(backend, tokenizer, "worse", 4, eval_timeout_s=0.2)
    job_id = spec.job_id
    await backend.store.adapters.publish(job_id, 2, adapter_uri(job_id, 2), 2)
    await backend.store.evals.claim(job_id, 2)
    for version, solved in ((0, 4), (2, 1)):
        for index in range(4):
            await backend.store.evals.record(
                job_id, version, f"{job_id}/eval{version}/{index}", reward=1.0 * (index < solved),
                solved=index < solved, components={},
            )  # fmt: skip
    await asyncio.sleep(0.3)
    await service.sweep_claims()
    base, worse = sorted(
        events(await backend.sent(Topic.EVENTS, job_id, expect=3), "eval"), key=lambda e: e.step
    )
    assert (base.step, base.reason) == (0, "") and "eval_below_base" not in base.metrics
    assert worse.metrics["eval_below_base"] == 1.0 and worse.metrics["eval_base_accuracy"] == 1.0
    assert worse.reason.startswith("held-out accuracy 0.250 of v2 is below the base model's 1.000")
