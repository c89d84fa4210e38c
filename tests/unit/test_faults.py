"""Faults the services must survive without losing work (issue 11's regression tests).

Handler scenarios like tests/unit/test_handlers.py, on the in-memory bus and store and on the
real broker and Valkey: environment code that raises or hangs, a broker that refuses a send
for a while, Redis that drops the connection in the middle of a trained step.
"""

from __future__ import annotations

import asyncio
import errno
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError
from redis.exceptions import ConnectionError as RedisConnectionError

from common.files.artifacts import latest_checkpoint_version
from common.runtime.config import (
    EnvServiceSettings,
    RolloutSettings,
    SharedSettings,
    TrainerSettings,
)
from common.state.audit import audit
from common.state.dedup import DROPPED, TRAINED
from common.state.keyspace import dedup_key
from common.state.registry import ENDED_TTL_S
from common.wire.adapters import AdapterRef
from common.wire.codec import decode
from common.wire.lifecycle import RolloutReplicaStats
from common.wire.messages import (
    EnvSettings,
    GenerationRequest,
    GenerationResult,
    JobSpec,
    Message,
    MessageDecodeError,
    Topic,
    Trajectory,
    new_id,
    result_for,
)
from env_svc import protocol
from env_svc.chat_template import ChatTokenizer
from env_svc.service import EnvService
from rollout_svc.service import RolloutService
from tests.fakes import Backend, Inbox
from tests.handler_kit import (
    BASE_MODEL,
    GatedEngine,
    env_service,
    events,
    job_spec,
    register_running,
    request_for,
    rollout_service,
    trajectory,
)
from trainer_svc import step as trainer_step_module
from trainer_svc.policy import MultiAdapterPolicy
from trainer_svc.service import TrainerService


@pytest.fixture(autouse=True)
def chaos_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(protocol.BUILTIN_ENVIRONMENTS, "chaos", "tests.chaos_env:ChaosEnv")
    yield


def chaos_job(
    fail: str, *, group_size: int = 2, groups_per_step: int = 1, **params: Any
) -> JobSpec:
    spec = job_spec(
        f"chaos-{fail}",
        group_size=group_size,
        groups_per_step=groups_per_step,
        max_staleness=0,
        max_steps=2,
    )
    return msgspec.structs.replace(
        spec, env=EnvSettings(name="chaos", params={"fail": fail, **params})
    )


def answer(request: GenerationRequest, tokenizer: ChatTokenizer) -> GenerationResult:
    completion = [*tokenizer.encode("1"), tokenizer.eos_token_id]
    return result_for(
        request,
        completion_token_ids=completion,
        logprobs=[-0.5] * len(completion),
        adapter_version=0,
        finish_reason="stop",
    )


# --- env_svc: any exception from environment code ends an episode, never a group ------------


async def test_a_job_whose_environment_raises_anything_is_rejected_with_the_reason(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    spec = chaos_job("reject")
    await Inbox(Topic.JOBS).hand(env_service(backend, tokenizer).handle, spec)
    (rejected,) = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=1), "rejected")
    assert rejected.reason == "RuntimeError: chaos: a bug in the environment's constructor"
    assert await backend.store.jobs.get(spec.job_id) is None


async def test_a_job_that_does_not_decode_but_names_itself_is_rejected_with_the_reason(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """A JSON job from another Kafka client with a misspelt field: dead-lettered as any
    undecodable record, and `rejected` so its sender reads why in `marlaas logs`."""
    service = env_service(backend, tokenizer)
    raw = msgspec.json.encode(
        {
            "kind": "job_spec",
            "job_id": "acme-typo",
            "tenant": "acme",
            "env": {"name": "arithmetic"},
            "rl": {"group_sise": 4},
        }
    )
    with pytest.raises(MessageDecodeError) as caught:
        decode(Topic.JOBS, raw)
    await service.on_undecodable(Topic.JOBS.value, raw, caught.value)
    (rejected,) = events(await backend.sent(Topic.EVENTS, "acme-typo", expect=1), "rejected")
    assert rejected.reason == "rl.group_sise: unknown field" and rejected.tenant == "acme"
    for nameless in (b"\x00garbage", msgspec.json.encode({"kind": "job_spec", "job_id": 5})):
        await service.on_undecodable(Topic.JOBS.value, nameless, caught.value)
    await service.on_undecodable(Topic.ROLLOUTS.value, raw, caught.value)
    assert len(await backend.sent(Topic.EVENTS, "acme-typo", expect=1)) == 1


@pytest.mark.parametrize(
    ("fail", "error"),
    [
        ("respond", "RuntimeError: chaos: the tool crashed"),
        ("recursion", "RecursionError: maximum recursion depth exceeded"),
        ("hang", "no answer after 0.3s"),
    ],
)
async def test_an_environment_that_raises_or_hangs_ends_its_episode_with_the_error(
    backend: Backend, tokenizer: ChatTokenizer, fail: str, error: str
) -> None:
    service = env_service(backend, tokenizer, env_call_timeout_s=0.3)
    spec = chaos_job(fail, hang_s=1.0)
    await Inbox(Topic.JOBS).hand(service.handle, spec)
    first, second = await backend.sent(Topic.PROMPTS, spec.job_id, expect=2)
    assert isinstance(first, GenerationRequest) and isinstance(second, GenerationRequest)
    results = Inbox(Topic.ROLLOUTS)
    for request in (first, second):
        await results.hand(service.handle, answer(request, tokenizer))
    assert results.committable == 2  # handled, not left for a retry or a dead letter
    ended = await backend.sent(Topic.TRAJECTORIES, spec.job_id, expect=2)
    assert all(isinstance(t, Trajectory) and error in t.error for t in ended)
    assert {t.episode_id for t in ended} == {first.episode_id, second.episode_id}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("fail", "error"),
    [("start", "RuntimeError: chaos: no task 1"), ("overflow", "OverflowError")],
)
async def test_a_group_whose_episodes_cannot_start_still_completes(
    backend: Backend, tokenizer: ChatTokenizer, fail: str, error: str
) -> None:
    """Group 1's task raises: its G episodes end at once with the error (the trainer drops
    the group and env_svc replaces it) instead of the claimed index being lost."""
    G = 3
    spec = chaos_job(fail, group_size=G, groups_per_step=2, bad_groups=[1])
    await Inbox(Topic.JOBS).hand(env_service(backend, tokenizer).handle, spec)
    requests = await backend.sent(Topic.PROMPTS, spec.job_id, expect=G)
    assert {r.group_id for r in requests} == {f"{spec.job_id}/g0"}  # type: ignore[union-attr]
    ended = await backend.sent(Topic.TRAJECTORIES, spec.job_id, expect=G)
    assert sorted(t.episode_id for t in ended) == [  # type: ignore[union-attr]
        f"{spec.job_id}/1/{i}" for i in range(G)
    ]
    assert all(isinstance(t, Trajectory) and error in t.error for t in ended)
    assert all(t.group_id == f"{spec.job_id}/g1" for t in ended)  # type: ignore[union-attr]


# --- rollout_svc: a result is durable before its request is committed -------------------


class BrokenSends:
    """The backend's producer, refusing to send `kind` messages while `error` is set (at
    most `refusals` times, when set)."""

    def __init__(self, producer: Any, kind: type[Message]) -> None:
        self._producer = producer
        self._kind = kind
        self.error: Exception | None = None
        self.refusals: int | None = None
        self.refused = 0
        self._refusal = asyncio.Event()

    async def send(self, message: Message) -> None:
        refusing = self.refusals is None or self.refused < self.refusals
        if isinstance(message, self._kind) and self.error is not None and refusing:
            self.refused += 1
            self._refusal.set()
            raise self.error
        await self._producer.send(message)

    async def until_refused(self, times: int, timeout_s: float = 10) -> None:
        async def wait() -> None:
            while self.refused < times:
                self._refusal.clear()
                await self._refusal.wait()

        await asyncio.wait_for(wait(), timeout_s)


async def test_rollout_keeps_a_request_uncommitted_until_its_result_reaches_the_broker(
    backend: Backend,
) -> None:
    engine, sends = GatedEngine(), BrokenSends(backend.producer, GenerationResult)
    service = RolloutService(
        SharedSettings(), RolloutSettings(), engine, producer=sends, store=backend.store
    )
    job_id = f"rollout-{new_id()[:8]}"
    prompts = Inbox(Topic.PROMPTS)
    sends.error = KafkaConnectionError("broker away")
    await prompts.hand(service.on_request, request_for(job_id, 0, min_adapter_version=0))
    engine.gate.set()
    await sends.until_refused(2)  # retried with back-off, not given up
    assert prompts.committable == 0
    sends.error = None
    await asyncio.wait_for(asyncio.gather(*service.slots.generations), 10)
    assert prompts.committable == 1
    (result,) = await backend.sent(Topic.ROLLOUTS, job_id, expect=1)
    assert isinstance(result, GenerationResult) and result.finish_reason == "stop"


async def test_rollout_dead_letters_a_result_the_broker_refuses_and_ends_the_episode(
    backend: Backend,
) -> None:
    engine, sends = GatedEngine(), BrokenSends(backend.producer, GenerationResult)
    service = RolloutService(
        SharedSettings(), RolloutSettings(), engine, producer=sends, store=backend.store
    )
    job_id = f"rollout-{new_id()[:8]}"
    prompts = Inbox(Topic.PROMPTS)
    sends.error, sends.refusals = MessageSizeTooLargeError("too large"), 1
    await prompts.hand(service.on_request, request_for(job_id, 0, min_adapter_version=0))
    engine.gate.set()
    await sends.until_refused(1)  # the small "abort" result goes through
    await asyncio.wait_for(asyncio.gather(*service.slots.generations), 10)
    assert prompts.committable == 1
    (result,) = await backend.sent(Topic.ROLLOUTS, job_id, expect=1)
    assert isinstance(result, GenerationResult) and result.finish_reason == "abort"


async def test_a_group_the_broker_refuses_for_good_ends_as_failed_not_resent_forever(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """Its first requests are over the broker's size limit (issue 24): the group ends as
    failed with the reason (the trainer drops it, naming it), its claim is finished, and the
    sweep has nothing to send again."""
    sends = BrokenSends(backend.producer, GenerationRequest)
    sends.error = MessageSizeTooLargeError("the message is 1048577 bytes")
    service = EnvService(
        SharedSettings(base_model=BASE_MODEL),
        EnvServiceSettings(claim_timeout_s=0.001),
        tokenizer,
        producer=sends,
        store=backend.store,
    )
    spec = job_spec("huge", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1)
    await Inbox(Topic.JOBS).hand(service.handle, spec)
    failed = await backend.sent(Topic.TRAJECTORIES, spec.job_id, expect=2)
    assert {t.sample_index for t in failed} == {0, 1}  # type: ignore[union-attr]
    for ended in failed:
        assert isinstance(ended, Trajectory)
        assert "group 0 could not be sent: MessageSizeTooLargeError" in ended.error
    await asyncio.sleep(0.01)  # past the claim timeout: an unfinished claim would be re-sent
    assert await service.sweep_claims() == 0


class DyingEngine(GatedEngine):
    """Its core process dies under the requests in flight (vLLM's EngineDeadError)."""

    async def generate(self, request: Any, adapter: Any = None) -> GenerationResult:
        await self.gate.wait()
        self.ready = False
        raise RuntimeError("EngineCore encountered an issue")


async def test_rollout_leaves_requests_to_a_restart_when_its_engine_dies(
    backend: Backend,
) -> None:
    """Before: every request the dead engine was given, and every one read after, was
    dead-lettered and aborted, so each job's groups failed until the job did."""
    engine = DyingEngine()
    service = rollout_service(backend, engine)
    job_id = f"rollout-{new_id()[:8]}"
    prompts = Inbox(Topic.PROMPTS)
    for index in range(2):
        await prompts.hand(service.on_request, request_for(job_id, index, min_adapter_version=0))
    watch = asyncio.create_task(service._watch_engine())
    engine.gate.set()
    with pytest.raises(RuntimeError, match="engine died"):
        await asyncio.wait_for(watch, 10)  # the replica stops, to be restarted
    await asyncio.wait_for(asyncio.gather(*service.slots.generations), 10)
    assert prompts.committable == 0  # both read again by the restarted replica
    assert await backend.sent(Topic.ROLLOUTS, job_id, expect=0) == []  # no aborts


async def test_rollout_stops_when_its_engine_dies_idle(backend: Backend) -> None:
    """No request in flight fails, so only the engine's state says it died: before, the
    replica stayed up and unready, and its jobs waited for it forever."""
    engine = GatedEngine()
    service = rollout_service(backend, engine)
    watch = asyncio.create_task(service._watch_engine(look_every_s=0.01))
    await asyncio.sleep(0.05)
    assert not watch.done()  # a live engine keeps the replica up
    engine.ready = False
    with pytest.raises(RuntimeError, match="engine died"):
        await asyncio.wait_for(watch, 10)


async def test_the_periodic_tasks_end_when_their_service_stops(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """Before, rollout's engine watch and env_svc's claim sweep slept through request_stop,
    and each service's stop waited out its whole grace period (30 s in every run's logs: a
    stack's shutdown, a compose upgrade's recreate)."""
    rollout = rollout_service(backend, GatedEngine())
    env = env_service(backend, tokenizer, claim_sweep_s=60)
    tasks = [
        asyncio.create_task(rollout._watch_engine(look_every_s=60)),
        asyncio.create_task(env._sweep_loop()),
    ]
    await asyncio.sleep(0.05)
    assert not any(task.done() for task in tasks)
    rollout.request_stop()
    env.request_stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)  # ended, neither raised


# --- trainer_svc: a trained step is published even when Redis blips ----------------------


class FlakyStore:
    """The backend's store; `method` (a part's, "adapters.publish") raises a Redis connection
    error its first `times` calls."""

    def __init__(self, store: Any, method: str, times: int) -> None:
        self._store, self.left = store, times
        self._part, self._method = method.split(".")

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._store, name)
        return _FlakyPart(self, real) if name == self._part else real


class _FlakyPart:
    def __init__(self, store: FlakyStore, part: Any) -> None:
        self._store, self._part = store, part

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._part, name)
        if name != self._store._method:
            return real

        async def flaky(*args: Any, **kwargs: Any) -> Any:
            if self._store.left > 0:
                self._store.left -= 1
                raise RedisConnectionError("Connection closed by server.")
            return await real(*args, **kwargs)

        return flaky


async def test_trainer_publishes_a_trained_step_through_a_redis_blip(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    spec = job_spec("blip", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    store = FlakyStore(backend.store, "adapters.publish", times=2)
    service = trainer_service(backend, tiny_dir, tmp_path, store=store)
    await service.load_model()
    await register_running(backend.store, spec)
    inbox = Inbox(Topic.TRAJECTORIES)
    for sample, reward in enumerate((0.0, 1.0)):
        await inbox.hand(service.on_trajectory, trajectory(spec, 0, sample, reward, 0))
    assert await service.train_once()
    assert store.left == 0 and inbox.committable == 2
    pointer = await backend.store.adapters.get(spec.job_id)
    assert pointer is not None and pointer.version == 1
    assert await backend.store.dedup.seen(TRAINED, spec.job_id, f"{spec.job_id}/g0")
    (update,) = await backend.sent(Topic.ADAPTERS, spec.job_id, expect=1)
    assert update.version == 1  # type: ignore[union-attr]


async def test_a_version_another_writer_already_holds_is_never_announced(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """The pointer answers "not newer" (issue 24): unless it holds this very version and
    URI (our own publish, its answer lost), nothing is announced and the job is given up."""
    spec = job_spec("raced", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    service = trainer_service(backend, tiny_dir, tmp_path)
    await service.load_model()
    await register_running(backend.store, spec)
    await backend.store.adapters.publish(spec.job_id, 1, "file:///elsewhere/v1", 1)
    inbox = Inbox(Topic.TRAJECTORIES)
    for sample, reward in enumerate((0.0, 1.0)):
        await inbox.hand(service.on_trajectory, trajectory(spec, 0, sample, reward, 0))
    await service.train_once()
    assert await backend.sent(Topic.ADAPTERS, spec.job_id, expect=0) == []
    assert spec.job_id not in service.jobs
    pointer = await backend.store.adapters.get(spec.job_id)
    assert pointer is not None and pointer.uri == "file:///elsewhere/v1"


async def test_the_pointer_and_its_trained_groups_move_in_one_step(backend: Backend) -> None:
    job_id = f"atomic-{new_id()[:8]}"
    store = backend.store
    assert await store.adapters.publish(job_id, 1, "/a/v1", 1, [f"{job_id}/g0", f"{job_id}/g1"])
    assert await store.dedup.seen(TRAINED, job_id, f"{job_id}/g1")
    # A replayed or older publish moves nothing and marks nothing.
    assert not await store.adapters.publish(job_id, 1, "/a/v1", 1, [f"{job_id}/g9"])
    assert not await store.dedup.seen(TRAINED, job_id, f"{job_id}/g9")


# --- trainer_svc: bad records, bad steps and finished jobs never wedge a partition --------


def trainer_service(
    backend: Backend, tiny_dir: Path, tmp_path: Path, *, store: Any = None, **settings: Any
) -> TrainerService:
    """A trainer on the backend; `store`: a wrapper around the backend's store instead."""
    return TrainerService(
        SharedSettings(base_model=str(tiny_dir), artifact_dir=tmp_path),
        TrainerSettings(**settings),
        lambda: MultiAdapterPolicy(tiny_dir),
        producer=backend.producer,
        store=store or backend.store,
    )


async def running_job(backend: Backend, name: str, *, issued: int = 64) -> JobSpec:
    spec = job_spec(name, group_size=2, groups_per_step=1, max_staleness=0, max_steps=3)
    await register_running(backend.store, spec, issued=issued)
    return spec


async def quiet_half_group(backend: Backend, service: TrainerService, name: str) -> JobSpec:
    """A running job whose one group (g0) got 1 of its 2 trajectories, then nothing for
    longer than the 0.5 s `group_timeout_s` these tests give the trainer."""
    spec = await running_job(backend, name, issued=0)
    await backend.store.flow.try_issue_group(
        spec.job_id, max_staleness=0, groups_per_step=1, max_groups=3
    )
    await backend.store.flow.finish_claim(spec.job_id, 0)
    await Inbox(Topic.TRAJECTORIES).hand(service.on_trajectory, trajectory(spec, 0, 0, 1.0, 0))
    await asyncio.sleep(0.6)
    return spec


async def test_a_job_whose_groups_keep_failing_fails_with_the_reason(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    service = trainer_service(backend, tiny_dir, tmp_path, max_failed_groups=2)
    await service.load_model()
    spec = await running_job(backend, "doomed")
    inbox = Inbox(Topic.TRAJECTORIES)
    for group in range(3):
        for sample in range(2):
            failed = msgspec.structs.replace(
                trajectory(spec, group, sample, 0.0, 0), error="tool server unreachable"
            )
            await inbox.hand(service.on_trajectory, failed)
        assert not await service.train_once()  # dropped, not trained
    record = await backend.store.jobs.get(spec.job_id)
    assert record is not None and record.status == "failed"
    assert "2 groups in a row had no usable rewards" in record.reason
    assert "tool server unreachable" in record.reason
    (failed_event,) = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=3), "failed")
    assert failed_event.reason == record.reason
    assert inbox.committable == 6  # nothing of the failed job stays held
    # The trainer's working state of the ended job expires in a week (issue 24).
    dropped = await backend.store.client.ttl(dedup_key(DROPPED, spec.job_id))
    assert 0 < dropped <= ENDED_TTL_S


async def test_groups_that_become_ready_while_a_drop_is_sent_are_trained(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """Trajectories keep arriving while the trainer sends a drop: a group completing then
    is neither lost nor a crash of the train loop (the chaos run's `deque mutated`)."""
    service = trainer_service(backend, tiny_dir, tmp_path)
    await service.load_model()
    spec = await running_job(backend, "busy")
    inbox = Inbox(Topic.TRAJECTORIES)
    for sample in range(2):
        failed = msgspec.structs.replace(
            trajectory(spec, 0, sample, 0.0, 0), error="tool server unreachable"
        )
        await inbox.hand(service.on_trajectory, failed)
    send_drop = service.roster.drop

    async def drop_while_group_1_completes(*args: Any) -> None:
        for sample in range(2):
            await inbox.hand(service.on_trajectory, trajectory(spec, 1, sample, float(sample), 0))
        await send_drop(*args)

    service.roster.drop = drop_while_group_1_completes  # type: ignore[method-assign,assignment]
    assert await service.train_once()
    pointer = await backend.store.adapters.get(spec.job_id)
    assert pointer is not None and pointer.version == 1
    assert await backend.store.dedup.seen(TRAINED, spec.job_id, f"{spec.job_id}/g1")
    assert inbox.committable == 4


async def test_the_lost_groups_of_a_job_without_progress_are_dropped_and_replaced(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """The chaos run's stalls: records the broker lost (a prompt, trajectories) left one
    group a trajectory short and another without any, and jobs whose window was full
    waited forever, also across hand-overs. When a running job's ledger has not moved for
    `group_timeout_s`, its owner drops its live groups but complete ones; env_svc issues
    replacements. Drops never touch a trained group."""
    service = trainer_service(backend, tiny_dir, tmp_path, group_timeout_s=2.0)
    await service.load_model()
    spec = job_spec("quiet", group_size=2, groups_per_step=2, max_staleness=1, max_steps=3)
    await register_running(backend.store, spec, issued=0)
    for index in range(3):  # issued and sent; g0 half-arrives, g1 and g2 never do
        await backend.store.flow.try_issue_group(
            spec.job_id, max_staleness=1, groups_per_step=2, max_groups=6
        )
        await backend.store.flow.finish_claim(spec.job_id, index)
    inbox = Inbox(Topic.TRAJECTORIES)
    await inbox.hand(service.on_trajectory, trajectory(spec, 0, 0, 1.0, 0))
    await service.sweep_finished()
    assert await backend.store.flow.live_groups(spec.job_id) == [
        f"{spec.job_id}/g{i}" for i in range(3)
    ]
    await asyncio.sleep(2.1)
    await service.sweep_finished()
    drops = await backend.sent(Topic.CONTROL, spec.job_id, expect=3)
    assert sorted(d.group_id for d in drops) == [f"{spec.job_id}/g{i}" for i in range(3)]  # type: ignore[union-attr]
    assert any("1 of 2 trajectories after" in d.reason for d in drops)  # type: ignore[union-attr]
    assert await backend.store.flow.live_groups(spec.job_id) == []
    assert inbox.committable == 1  # the half group's trajectory is released
    await inbox.hand(service.on_trajectory, trajectory(spec, 0, 1, 0.0, 0))  # too late
    assert inbox.committable == 2 and not service.jobs[spec.job_id].filling
    counted = await backend.store.flow.record_dropped_group(
        spec.job_id, f"{spec.job_id}/g0", invalid=False
    )
    assert not counted.counted  # dropped once


async def test_a_paused_jobs_lost_groups_are_dropped_and_release_their_commits(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """Paused, a job's half group (its other trajectory lost) held its partition's commits
    for as long as the pause lasted, behind which every other job on the partition waited
    (issue 24): the lost-group sweep drops it as for a running job."""
    service = trainer_service(backend, tiny_dir, tmp_path, group_timeout_s=0.5)
    await service.load_model()
    spec = await quiet_half_group(backend, service, "paused-lost")
    assert await backend.store.jobs.set_status(spec.job_id, "paused")
    await service.sweep_finished()
    (drop,) = await backend.sent(Topic.CONTROL, spec.job_id, expect=1)
    assert drop.group_id == f"{spec.job_id}/g0"  # type: ignore[union-attr]
    assert await backend.store.flow.live_groups(spec.job_id) == []


async def test_a_replica_that_lost_the_job_cannot_drop_its_groups(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """Drops are fenced as publishes are (issue 24): after another replica took the job over,
    this one's sweep counts nothing, announces nothing and gives the job up."""
    service = trainer_service(backend, tiny_dir, tmp_path, group_timeout_s=0.5)
    await service.load_model()
    spec = await quiet_half_group(backend, service, "fenced-drop")
    await backend.store.adapters.take_over(spec.job_id)  # another replica's newer epoch
    await service.sweep_finished()
    assert await backend.sent(Topic.CONTROL, spec.job_id, expect=0) == []
    assert await backend.store.flow.live_groups(spec.job_id) == [f"{spec.job_id}/g0"]
    assert spec.job_id not in service.jobs


async def test_a_redis_blip_during_the_lost_group_sweep_waits_for_the_next_sweep(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """Chaos run 7: Redis restarted while the sweep read a job's ledger, and the error
    stopped the trainer's step loop, so the replica exited."""
    store = FlakyStore(backend.store, "flow.last_activity", times=1)
    service = trainer_service(backend, tiny_dir, tmp_path, store=store, group_timeout_s=0.5)
    await service.load_model()
    spec = await quiet_half_group(backend, service, "blip-sweep")
    await service.sweep_finished()  # the blip: nothing dropped, nothing raised
    assert store.left == 0 and await backend.store.flow.live_groups(spec.job_id) == [
        f"{spec.job_id}/g0"
    ]
    await service.sweep_finished()
    (drop,) = await backend.sent(Topic.CONTROL, spec.job_id, expect=1)
    assert drop.group_id == f"{spec.job_id}/g0"  # type: ignore[union-attr]
    assert await backend.store.flow.live_groups(spec.job_id) == []


class CompletingDuringDrop:
    """The backend's store; while the first drop is being recorded, the last trajectory of
    another group arrives (the chaos run's interleaving)."""

    def __init__(self, store: Any, arrive: Callable[[], Awaitable[None]]) -> None:
        self._store, self._arrive = store, arrive
        self.arrived = False
        self.flow = _ArrivingFlow(self, store.flow)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class _ArrivingFlow:
    def __init__(self, store: CompletingDuringDrop, flow: Any) -> None:
        self._store, self._flow = store, flow

    def __getattr__(self, name: str) -> Any:
        return getattr(self._flow, name)

    async def record_dropped_group(self, *args: Any, **kwargs: Any) -> Any:
        if not self._store.arrived:
            self._store.arrived = True
            await self._store._arrive()
        return await self._flow.record_dropped_group(*args, **kwargs)


async def test_a_group_completing_while_lost_groups_are_dropped_is_trained_not_dropped(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """Chaos run 8: the lost-group sweep listed the job's ready groups once, then dropped the
    others one by one; a group that completed meanwhile was dropped (and replaced) and then
    trained as well."""
    inbox = Inbox(Topic.TRAJECTORIES)
    spec = job_spec("race", group_size=2, groups_per_step=2, max_staleness=0, max_steps=2)
    service: TrainerService | None = None

    async def last_of_g1() -> None:
        assert service is not None
        await inbox.hand(service.on_trajectory, trajectory(spec, 1, 1, 1.0, 0))

    store = CompletingDuringDrop(backend.store, last_of_g1)
    service = trainer_service(backend, tiny_dir, tmp_path, store=store, group_timeout_s=0.5)
    await service.load_model()
    await register_running(backend.store, spec, issued=0)
    for index in range(2):  # issued and sent
        await backend.store.flow.try_issue_group(
            spec.job_id, max_staleness=0, groups_per_step=2, max_groups=4
        )
        await backend.store.flow.finish_claim(spec.job_id, index)
    await inbox.hand(service.on_trajectory, trajectory(spec, 0, 0, 1.0, 0))
    await inbox.hand(service.on_trajectory, trajectory(spec, 1, 0, 0.0, 0))
    await asyncio.sleep(0.6)
    await service.sweep_finished()  # drops g0; g1 completes meanwhile
    assert store.arrived
    groups = [f"{spec.job_id}/g{i}" for i in (0, 1)]
    assert await backend.store.dedup.dropped_among(spec.job_id, groups) == {groups[0]}
    assert [g.group_id for g in service.jobs[spec.job_id].ready] == [f"{spec.job_id}/g1"]


async def test_a_redis_blip_while_checking_for_dropped_groups_is_waited_out(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """Chaos run 9: the check for groups dropped elsewhere met a Valkey restart and stopped
    the trainer's step loop (the replica exited)."""
    store = FlakyStore(backend.store, "dedup.dropped_among", times=2)
    service = trainer_service(backend, tiny_dir, tmp_path, store=store)
    await service.load_model()
    spec = await running_job(backend, "blip-dropped")
    inbox = Inbox(Topic.TRAJECTORIES)
    for sample in range(2):
        await inbox.hand(service.on_trajectory, trajectory(spec, 0, sample, float(sample), 0))
    assert await service.train_once()
    assert store.left == 0 and inbox.committable == 2


async def test_a_group_another_replica_dropped_is_never_trained_here(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """Chaos run 8: a replica dropped a job's groups as lost; their trajectories were only
    late, reached the job's next owner, and it trained them, so two groups were both dropped
    (and replaced) and trained, and the job completed with its replacements never trained."""
    service = trainer_service(backend, tiny_dir, tmp_path)
    await service.load_model()
    spec = await running_job(backend, "dropped-elsewhere", issued=0)
    for index in range(2):  # g0 issued and dropped as lost elsewhere, g1 its replacement
        await backend.store.flow.try_issue_group(
            spec.job_id, max_staleness=0, groups_per_step=1, max_groups=3
        )
        await backend.store.flow.finish_claim(spec.job_id, index)
        if index == 0:
            await backend.store.flow.record_dropped_group(
                spec.job_id, f"{spec.job_id}/g0", invalid=False
            )
    inbox = Inbox(Topic.TRAJECTORIES)
    for group in (0, 1):
        for sample in range(2):
            await inbox.hand(service.on_trajectory, trajectory(spec, group, sample, sample, 0))
    assert await service.train_once()
    assert inbox.committable == 4  # g0's trajectories released, g1 trained
    assert await backend.store.dedup.seen(TRAINED, spec.job_id, f"{spec.job_id}/g1")
    assert not await backend.store.dedup.seen(TRAINED, spec.job_id, f"{spec.job_id}/g0")
    report = audit(
        spec.job_id,
        await backend.store.flow.ledger(spec.job_id),
        status="running",
        groups_per_step=1,
        pointer_version=1,
    )
    assert not report.problems, report.problems


async def test_late_copies_of_a_closed_group_and_a_cancelled_jobs_groups_are_not_held(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    service = trainer_service(backend, tiny_dir, tmp_path)
    await service.load_model()
    spec = await running_job(backend, "late")
    inbox = Inbox(Topic.TRAJECTORIES)
    for sample in range(2):
        await inbox.hand(service.on_trajectory, trajectory(spec, 0, sample, float(sample), 0))
    # Group 0 is complete and waits to be trained; a redelivered copy must not open it again.
    await inbox.hand(service.on_trajectory, trajectory(spec, 0, 1, 1.0, 0))
    assert service.jobs[spec.job_id].filling == {}
    assert await service.train_once()
    assert inbox.committable == 3

    await inbox.hand(service.on_trajectory, trajectory(spec, 1, 0, 0.0, 1))  # half a group
    assert inbox.committable == 3
    await backend.store.jobs.set_status(spec.job_id, "cancelled")
    await service.sweep_finished()
    assert inbox.committable == 4 and spec.job_id not in service.jobs


async def test_records_that_do_not_fit_their_job_are_never_trained(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    service = trainer_service(backend, tiny_dir, tmp_path)
    await service.load_model()
    spec = await running_job(backend, "forged")
    inbox = Inbox(Topic.TRAJECTORIES)
    vocab = service.policy.vocab_size
    out_of_vocab = msgspec.structs.replace(
        trajectory(spec, 0, 0, 1.0, 0), token_ids=[1, 2, vocab + 5, 4, 5]
    )
    misaligned = msgspec.structs.replace(trajectory(spec, 0, 1, 0.0, 0), loss_mask=[0, 1])
    foreign = msgspec.structs.replace(trajectory(spec, 0, 1, 0.0, 0), group_id="other/g0")
    # Groups env_svc never issued (the flow counter in Redis says 64 so far): not held at all.
    unissued = [trajectory(spec, 64, sample, 9.0, 0) for sample in range(2)]
    padded = msgspec.structs.replace(trajectory(spec, 0, 1, 0.0, 0), group_id=f"{spec.job_id}/g00")
    for record in (out_of_vocab, misaligned, foreign, *unissued, padded):
        await inbox.hand(service.on_trajectory, record)
    assert not await service.train_once()  # dropped as invalid instead of crashing the step
    (dropped,) = await backend.sent(Topic.CONTROL, spec.job_id, expect=1)
    assert dropped.verdict == "dropped_invalid"  # type: ignore[union-attr]
    assert f"outside the vocabulary of {vocab}" in dropped.reason  # type: ignore[union-attr]
    assert "5 tokens, 2 mask entries" in dropped.reason  # type: ignore[union-attr]
    assert inbox.committable == 6
    assert await backend.store.adapters.get(spec.job_id) is None  # g64 was never trained
    assert service.jobs[spec.job_id].filling == {}


async def test_a_step_that_raises_costs_only_its_own_job(
    backend: Backend, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = trainer_service(backend, tiny_dir, tmp_path, max_jobs_per_step=2)
    await service.load_model()
    good, bad = await running_job(backend, "good"), await running_job(backend, "bad")
    train_steps = service.policy.train_steps

    def fragile(batches: Any, versions: Any = None) -> Any:
        if bad.job_id in batches:
            raise RuntimeError("CPU out of memory")
        return train_steps(batches, versions)

    monkeypatch.setattr(service.policy, "train_steps", fragile)
    inbox = Inbox(Topic.TRAJECTORIES)
    for spec in (good, bad):
        for sample in range(2):
            await inbox.hand(service.on_trajectory, trajectory(spec, 0, sample, float(sample), 0))
    assert await service.train_once()  # the shared step fails; each job is tried alone
    pointer = await backend.store.adapters.get(good.job_id)
    assert pointer is not None and pointer.version == 1
    assert await backend.store.adapters.get(bad.job_id) is None
    (dropped,) = await backend.sent(Topic.CONTROL, bad.job_id, expect=1)
    assert "training failed: RuntimeError: CPU out of memory" in dropped.reason  # type: ignore[union-attr]
    assert inbox.committable == 4


async def test_a_full_disk_costs_the_job_its_step_not_the_trainer(
    backend: Backend, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving one job's checkpoint fails with ENOSPC (issue 24): the other job publishes, the
    trainer goes on, and the full job trains the same groups again from its saved weights
    once the disk has room, with the same result as a step that never failed."""
    service = trainer_service(backend, tiny_dir, tmp_path, max_jobs_per_step=2)
    await service.load_model()
    good, full = await running_job(backend, "roomy"), await running_job(backend, "full")
    save = service.checkpoints.save
    failures = [OSError(errno.ENOSPC, "No space left on device")]

    def saving(policy: Any, job_id: str, *args: Any) -> AdapterRef:
        if job_id == full.job_id and failures:
            raise failures.pop()
        return save(policy, job_id, *args)

    monkeypatch.setattr(service.checkpoints, "save", saving)
    monkeypatch.setattr(trainer_step_module, "UNSAVED_RETRY_S", 0.0)
    inbox = Inbox(Topic.TRAJECTORIES)
    for spec in (good, full):
        for sample in range(2):
            await inbox.hand(service.on_trajectory, trajectory(spec, 0, sample, float(sample), 0))
    before = service.policy.adapter_state(full.job_id)
    assert await service.train_once()
    pointer = await backend.store.adapters.get(good.job_id)
    assert pointer is not None and pointer.version == 1
    assert await backend.store.adapters.get(full.job_id) is None
    for name, tensor in service.policy.adapter_state(full.job_id).items():
        assert torch.equal(tensor, before[name]), name  # back to its saved (fresh) weights
    assert await service.train_once()  # room again: the same groups, trained once
    pointer = await backend.store.adapters.get(full.job_id)
    assert pointer is not None and pointer.version == 1
    assert inbox.committable == 4


async def test_env_svc_rejects_a_context_longer_than_the_engine_serves(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    await backend.store.replicas.put_stats(
        "rollout-1", RolloutReplicaStats(max_model_len=1024.0), ttl_s=60
    )
    spec = job_spec("long", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1)
    spec = msgspec.structs.replace(
        spec, rl=msgspec.structs.replace(spec.rl, max_context_tokens=4096)
    )
    await Inbox(Topic.JOBS).hand(env_service(backend, tokenizer).handle, spec)
    (rejected,) = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=1), "rejected")
    assert "exceeds the rollout engine's max_model_len 1024" in rejected.reason


async def test_a_group_claimed_by_a_replica_that_died_is_sent_again(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    service = env_service(backend, tokenizer, claim_timeout_s=1.0)
    spec = job_spec("orphan", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    await register_running(backend.store, spec, issued=0)
    # Another replica claimed group 0, then died before sending its requests.
    claimed = await backend.store.flow.try_issue_group(
        spec.job_id, max_staleness=0, groups_per_step=1, max_groups=2
    )
    assert claimed is not None and claimed.index == 0
    assert await service.sweep_claims() == 0  # not old enough yet
    await asyncio.sleep(1.1)
    assert await service.sweep_claims() == 1
    requests = await backend.sent(Topic.PROMPTS, spec.job_id, expect=2)
    assert sorted(r.episode_id for r in requests) == [  # type: ignore[union-attr]
        f"{spec.job_id}/0/0",
        f"{spec.job_id}/0/1",
    ]
    await asyncio.sleep(1.1)
    assert await service.sweep_claims() == 0  # sent in full: the claim is done

    # The trainer dropped group 0, and the GroupDropped that should have prompted a
    # replacement never arrived: the sweep issues it (its claim finished as it goes).
    await backend.store.flow.record_dropped_group(spec.job_id, f"{spec.job_id}/g0", invalid=False)
    assert await service.sweep_claims() == 0
    requests = await backend.sent(Topic.PROMPTS, spec.job_id, expect=4)
    assert sorted(r.episode_id for r in requests)[2:] == [  # type: ignore[union-attr]
        f"{spec.job_id}/1/0",
        f"{spec.job_id}/1/1",
    ]
    await asyncio.sleep(1.1)
    assert await service.sweep_claims() == 0
    assert len(await backend.sent(Topic.PROMPTS, spec.job_id, expect=4)) == 4


async def test_a_new_owner_publishes_a_step_that_was_saved_but_never_announced(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """The previous owner saved v1 (checkpoint and `latest`) and died before moving the
    pointer: env_svc would wait for v1 forever. The next owner publishes and announces it."""
    spec = await running_job(backend, "orphaned-step")
    crashed = trainer_service(backend, tiny_dir, tmp_path)
    await crashed.load_model()
    crashed.policy.add_job(spec.job_id, spec.lora, spec.rl)
    crashed.checkpoints.save(crashed.policy, spec.job_id, 1, [f"{spec.job_id}/g0"])

    owner = trainer_service(backend, tiny_dir, tmp_path)
    await owner.load_model()
    inbox = Inbox(Topic.TRAJECTORIES)
    await inbox.hand(owner.on_trajectory, trajectory(spec, 0, 0, 1.0, 0))  # redelivered
    pointer = await backend.store.adapters.get(spec.job_id)
    assert pointer is not None and pointer.version == 1
    (update,) = await backend.sent(Topic.ADAPTERS, spec.job_id, expect=1)
    assert update.version == 1  # type: ignore[union-attr]
    assert await backend.store.dedup.seen(TRAINED, spec.job_id, f"{spec.job_id}/g0")
    assert inbox.committable == 1  # its group was trained: not held


async def test_a_job_whose_checkpoint_cannot_be_loaded_fails_with_the_reason(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """A new owner that cannot load the job's checkpoint (here: one saved for another rank)
    fails the job, instead of dead-lettering every trajectory and leaving it stalled."""
    spec = await running_job(backend, "bad-checkpoint")
    other = trainer_service(backend, tiny_dir, tmp_path)
    await other.load_model()
    wrong = msgspec.structs.replace(spec.lora, rank=spec.lora.rank * 2)
    other.policy.add_job(spec.job_id, wrong, spec.rl)
    other.checkpoints.save(other.policy, spec.job_id, 1, [f"{spec.job_id}/g0"])

    owner = trainer_service(backend, tiny_dir, tmp_path)
    await owner.load_model()
    inbox = Inbox(Topic.TRAJECTORIES)
    await inbox.hand(owner.on_trajectory, trajectory(spec, 1, 0, 1.0, 1))
    record = await backend.store.jobs.get(spec.job_id)
    assert record is not None and record.status == "failed"
    assert record.reason.startswith("its checkpoint could not be loaded")
    (failed,) = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=1), "failed")
    assert failed.reason == record.reason
    assert inbox.committable == 1  # handled, not held and not dead-lettered
    assert spec.job_id not in owner.jobs and spec.job_id not in owner.policy.jobs


async def test_a_replica_that_lost_a_job_can_neither_publish_nor_overwrite_it(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    spec = await running_job(backend, "fenced")
    old, new = (trainer_service(backend, tiny_dir, tmp_path) for _ in range(2))
    await old.load_model()
    await new.load_model()
    old_inbox, new_inbox = Inbox(Topic.TRAJECTORIES), Inbox(Topic.TRAJECTORIES)
    for sample in range(2):
        await old_inbox.hand(old.on_trajectory, trajectory(spec, 0, sample, float(sample), 0))
    # The partition moved (or the old owner stalled): the new owner takes the job over.
    await new_inbox.hand(new.on_trajectory, trajectory(spec, 0, 0, 0.0, 0))

    assert await old.train_once()  # trained, saved under its own epoch, refused at publish
    assert spec.job_id not in old.jobs
    assert await backend.store.adapters.get(spec.job_id) is None
    assert old_inbox.committable == 0  # left for the new owner
    assert await backend.sent(Topic.ADAPTERS, spec.job_id, expect=0) == []

    await new_inbox.hand(new.on_trajectory, trajectory(spec, 0, 1, 1.0, 0))
    assert await new.train_once()
    pointer = await backend.store.adapters.get(spec.job_id)
    assert pointer is not None and pointer.version == 1 and pointer.uri.endswith("/v1.e2")
    published = Path(pointer.uri.removeprefix("file://"))
    assert (published.parent / "v1.e1").is_dir()  # the loser's bytes went elsewhere


async def step_in_progress(
    service: TrainerService, spec: JobSpec, inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> tuple[asyncio.Task[bool], threading.Event]:
    """A step of `spec` (one group handed in through `inbox`) held inside its thread until
    the returned event is set."""
    train_steps, started, release = service.policy.train_steps, threading.Event(), threading.Event()

    def slow(batches: Any, versions: Any = None) -> Any:
        started.set()
        release.wait(10)
        return train_steps(batches, versions)

    monkeypatch.setattr(service.policy, "train_steps", slow)
    for sample in range(2):
        await inbox.hand(service.on_trajectory, trajectory(spec, 0, sample, float(sample), 0))
    step = asyncio.create_task(service.train_once())
    await asyncio.to_thread(started.wait, 10)
    return step, release


async def test_a_revocation_waits_for_the_step_in_progress(
    backend: Backend, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiokafka.structs import TopicPartition

    service = trainer_service(backend, tiny_dir, tmp_path)
    await service.load_model()
    spec = await running_job(backend, "revoked")
    inbox = Inbox(Topic.TRAJECTORIES)
    step, release = await step_in_progress(service, spec, inbox, monkeypatch)
    revoke = asyncio.create_task(
        service.on_revoked({TopicPartition(Topic.TRAJECTORIES.value, inbox.partition)})
    )
    await asyncio.sleep(0.2)
    assert not revoke.done() and spec.job_id in service.jobs  # its adapter is in use
    release.set()
    assert await step
    await asyncio.wait_for(revoke, 10)
    assert spec.job_id not in service.jobs
    pointer = await backend.store.adapters.get(spec.job_id)
    assert pointer is not None and pointer.version == 1


async def test_a_new_job_is_taken_on_only_between_steps(
    backend: Backend, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adding an adapter changes the model's modules; a step's thread iterating them (its
    checkpoint's state_dict) crashed the chaos run's trainer with `dictionary changed size
    during iteration`. A trajectory of a new job waits for the step in progress."""
    service = trainer_service(backend, tiny_dir, tmp_path)
    await service.load_model()
    busy, newcomer = await running_job(backend, "busy"), await running_job(backend, "newcomer")
    inbox = Inbox(Topic.TRAJECTORIES)
    step, release = await step_in_progress(service, busy, inbox, monkeypatch)
    arrival = asyncio.create_task(
        inbox.hand(service.on_trajectory, trajectory(newcomer, 0, 0, 1.0, 0))
    )
    await asyncio.sleep(0.2)
    assert not arrival.done() and newcomer.job_id not in service.policy.jobs
    release.set()
    assert await step
    await asyncio.wait_for(arrival, 10)
    assert newcomer.job_id in service.jobs and newcomer.job_id in service.policy.jobs


async def test_the_ledger_accounts_for_every_group_of_a_job_run_through_the_handlers(
    backend: Backend, tokenizer: ChatTokenizer, tiny_dir: Path, tmp_path: Path
) -> None:
    env, trainer = env_service(backend, tokenizer), trainer_service(backend, tiny_dir, tmp_path)
    await trainer.load_model()
    spec = job_spec("ledger", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    await Inbox(Topic.JOBS).hand(env.handle, spec)
    trajectories, control = Inbox(Topic.TRAJECTORIES), Inbox(Topic.ADAPTERS)
    for version in (0, 1):
        for sample in range(2):
            record = trajectory(spec, version, sample, float(sample), version)
            await trajectories.hand(trainer.on_trajectory, record)
            await trajectories.hand(trainer.on_trajectory, record)  # redelivered
        assert await trainer.train_once()
        (update, *_) = (await backend.sent(Topic.ADAPTERS, spec.job_id, expect=version + 1))[
            version:
        ]
        await control.hand(env.handle, update)  # widens the window: the next group
    job = await backend.store.jobs.get(spec.job_id)
    assert job is not None and job.status == "completed"
    report = audit(
        spec.job_id,
        await backend.store.flow.ledger(spec.job_id),
        status=job.status,
        groups_per_step=1,
        pointer_version=2,
        checkpoint_version=latest_checkpoint_version(tmp_path, spec.job_id),
        announced_version=2,
    )
    assert report.ok, report.problems
    assert (report.issued, report.trained_groups, report.versions) == (2, 2, 2)
    kinds = [entry["kind"] for entry in await backend.store.flow.ledger(spec.job_id)]
    assert kinds == ["issued", "sent", "trained", "issued", "sent", "trained"]


class Backlog:
    """The trainer's consumer as `_drop_lost` sees it: behind on its partitions or not."""

    def __init__(self) -> None:
        self.behind = True
        self.asked: list[tuple[str, int]] = []

    async def caught_up(self, topic: str, partition: int) -> bool:
        self.asked.append((topic, partition))
        return not self.behind


async def test_groups_are_not_dropped_as_lost_while_their_trajectories_may_be_unread(
    backend: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    """Chaos run 12: trainers taking partitions over replayed backlogs of hundreds of
    trajectories, and meanwhile dropped the groups those trajectories belonged to as lost
    (the ledger had not moved for `group_timeout_s`). env_svc issued replacements, the
    backlog grew, and 13 jobs stopped training. A quiet job's groups are dropped only once
    the replica has read its partition to the end."""
    service = trainer_service(backend, tiny_dir, tmp_path, group_timeout_s=0.5)
    await service.load_model()
    backlog = Backlog()
    service.consumer = backlog  # type: ignore[assignment]
    spec = await quiet_half_group(backend, service, "backlog")
    await service.sweep_finished()
    assert backlog.asked == [(Topic.TRAJECTORIES.value, service.jobs[spec.job_id].partition)]
    assert await backend.store.flow.live_groups(spec.job_id) == [f"{spec.job_id}/g0"]
    backlog.behind = False  # read to the end: what has not come is lost
    await service.sweep_finished()
    (drop,) = await backend.sent(Topic.CONTROL, spec.job_id, expect=1)
    assert drop.group_id == f"{spec.job_id}/g0"  # type: ignore[union-attr]
