"""A registered job is decoded once per process, whoever reads it (common/state/admitted.py);
its status is read in one round trip beside it, a terminal one not again; an id reused is
decoded anew; and the hot paths make the round trips they say."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import fakeredis
import pytest
from fakeredis._clients._async import FakeAsyncRedisConnection
from prometheus_client import REGISTRY

from common.state.dedup import RESULTS
from common.state.keyspace import job_key
from common.state.store import RedisStore
from common.wire.codec import encode
from common.wire.messages import (
    EnvSettings,
    GenerationRequest,
    JobCommand,
    JobSpec,
    Topic,
    result_for,
)
from env_svc.chat_template import ChatTokenizer
from rollout_svc.jobs import UNKNOWN_JOB_S, JobsSeen
from tests.fakes import Inbox, memory_backend
from tests.handler_kit import env_service, job_spec


def spec(job_id: str, env: str = "arithmetic") -> JobSpec:
    return JobSpec(job_id=job_id, tenant="acme", base_model="tiny", env=EnvSettings(name=env))


def decodes() -> float:
    return REGISTRY.get_sample_value("marlaas_job_spec_decodes_total") or 0.0


@pytest.fixture
async def two_processes() -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """Two processes' stores on one Redis: a writer (whose own registrations it knows) and
    a reader."""
    server = fakeredis.FakeServer()
    stores = [RedisStore(fakeredis.FakeAsyncRedis(server=server), "memory://") for _ in "wr"]
    try:
        yield stores[0], stores[1]
    finally:
        for store in stores:
            await store.close()


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Round trips to the in-memory Redis so far: one per command sent, one per pipeline."""
    sent = [0]
    send = FakeAsyncRedisConnection.send_packed_command

    async def counted(self: FakeAsyncRedisConnection, *args: object, **kwargs: object) -> None:
        sent[0] += 1
        await send(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(FakeAsyncRedisConnection, "send_packed_command", counted)
    return lambda: sent[0]


async def test_a_job_read_many_times_is_decoded_once_and_its_status_read_each_time(
    two_processes: tuple[RedisStore, RedisStore],
) -> None:
    writer, reader = two_processes
    await writer.jobs.register(spec("j"), "running")
    before = decodes()
    records = [await reader.jobs.get("j") for _ in range(50)]
    assert {r.status for r in records if r is not None} == {"running"}
    assert decodes() - before == 1
    await writer.jobs.set_status("j", "paused")
    record = await reader.jobs.get("j")
    assert record is not None and record.status == "paused" and record.spec is records[0].spec  # type: ignore[union-attr]
    assert decodes() - before == 1


async def test_the_writer_knows_what_it_registered_without_decoding_it() -> None:
    async with memory_backend() as backend:
        before = decodes()
        await backend.store.jobs.register(spec("j"), "running")
        record = await backend.store.jobs.get("j")
        assert record is not None and record.created_at == record.job.created_at
        assert decodes() == before


async def test_a_reused_id_is_decoded_anew(two_processes: tuple[RedisStore, RedisStore]) -> None:
    writer, reader = two_processes
    await writer.jobs.register(spec("j"), "cancelled")
    first = await reader.jobs.get("j")
    assert first is not None and reader.admitted.ended("j") == "cancelled"
    await writer.client.delete(job_key("j"))  # an unkept job's record expired
    await writer.jobs.register(spec("j", "countdown"), "running")
    again = await reader.jobs.get("j")
    assert again is not None and again.spec.env.name == "countdown"
    assert again.status == "running" and reader.admitted.ended("j") is None


async def test_the_least_recently_read_jobs_leave_past_the_capacity(
    two_processes: tuple[RedisStore, RedisStore],
) -> None:
    writer, reader = two_processes
    reader.admitted.capacity = 2
    for job_id in "abc":
        await writer.jobs.register(spec(job_id), "running")
    before = decodes()
    for job_id in "abac":  # "b" is the least recently read when "c" comes
        await reader.admitted.job(job_id)
    assert decodes() - before == 3
    await reader.admitted.job("a")
    assert decodes() - before == 3
    await reader.admitted.job("b")
    assert decodes() - before == 4


async def test_a_forgotten_job_is_read_again(two_processes: tuple[RedisStore, RedisStore]) -> None:
    writer, reader = two_processes
    for job_id in "ab":
        await writer.jobs.register(spec(job_id), "running")
    await reader.admitted.records(["a", "b"])
    before = decodes()
    reader.admitted.keep_only(["a"])  # "b" retired
    await reader.admitted.records(["a", "b"])
    assert decodes() - before == 1


async def test_a_record_not_holding_a_spec_is_refused() -> None:
    async with memory_backend() as backend:
        command = JobCommand(command_id="c", job_id="j", action="pause")
        await backend.store.client.hset(
            job_key("j"), mapping={"spec": encode(command), "created_at": 1.0}
        )
        with pytest.raises(TypeError, match="not a JobSpec"):
            await backend.store.admitted.job("j")


async def test_a_terminal_status_known_here_is_not_read_again(
    two_processes: tuple[RedisStore, RedisStore], round_trips: Callable[[], int]
) -> None:
    writer, reader = two_processes
    for job_id in "ab":
        await writer.jobs.register(spec(job_id), "running")
    await writer.jobs.set_status("a", "cancelled")
    await reader.admitted.records(["a", "b"])
    before = round_trips()
    assert await reader.jobs.statuses(["a", "b", "c"]) == {
        "a": "cancelled",
        "b": "running",
        "c": None,
    }
    assert round_trips() - before == 1  # "b" and "c" in one pipeline; "a" not read
    before = round_trips()
    assert await reader.jobs.statuses(["a"]) == {"a": "cancelled"}
    assert round_trips() == before


async def test_an_id_claim_says_its_owner_and_its_job_in_one_round_trip(
    two_processes: tuple[RedisStore, RedisStore], round_trips: Callable[[], int]
) -> None:
    writer, reader = two_processes
    unbound = await reader.jobs.claim_id("j", None)
    assert (unbound.owner, unbound.bound_now, unbound.record) == (None, False, None)
    claimed = await writer.jobs.claim_id("j", "acme")
    assert (claimed.owner, claimed.bound_now, claimed.record) == ("acme", True, None)
    assert not (await writer.jobs.claim_id("j", "globex")).bound_now  # taken
    await writer.jobs.register(spec("j"), "running")
    await reader.jobs.get("j")
    before = round_trips()
    again = await reader.jobs.claim_id("j", "acme")
    assert again.owner == "acme" and not again.bound_now
    assert again.record is not None and again.record.status == "running"
    assert round_trips() - before == 1


async def test_env_svc_takes_a_turn_in_two_round_trips(
    tokenizer: ChatTokenizer, round_trips: Callable[[], int]
) -> None:
    """A result: its de-dup check and its job's status in one pipeline, the spec known here;
    then, once its successor is sent, it is marked handled. A result of a job known to have
    ended costs none."""
    async with memory_backend() as backend:
        service = env_service(backend, tokenizer)
        job = job_spec("turns", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1)
        await Inbox(Topic.JOBS).hand(service.handle, job)
        requests = await backend.sent(Topic.PROMPTS, job.job_id, expect=2)
        results = Inbox(Topic.ROLLOUTS)
        completion = [*tokenizer.encode("7"), tokenizer.eos_token_id]
        answers = [
            result_for(
                r,
                completion_token_ids=completion,
                logprobs=[-0.5] * len(completion),
                adapter_version=0,
                finish_reason="stop",
            )
            for r in requests
            if isinstance(r, GenerationRequest)
        ]
        before = round_trips()
        await results.hand(service.handle, answers[0])
        assert round_trips() - before == 2
        await backend.store.jobs.set_status(job.job_id, "cancelled")
        await service.sweep_claims()  # reads the status: the job has ended
        before = round_trips()
        await results.hand(service.handle, answers[1])
        assert round_trips() - before == 0
        assert await backend.store.dedup.seen(RESULTS, job.job_id, answers[1].request_id) is False


async def test_rollout_asks_again_about_an_unregistered_job_only_after_a_while(
    round_trips: Callable[[], int],
) -> None:
    async with memory_backend() as backend:
        jobs = JobsSeen(lambda: backend.store)
        assert await jobs.job("j") is None
        before = round_trips()
        assert await jobs.job("j") is None  # found unregistered lately: not asked
        assert round_trips() == before
        await backend.store.jobs.register(spec("j"), "running")
        jobs._unknown["j"] -= UNKNOWN_JOB_S
        job = await jobs.job("j")
        assert job is not None and await jobs.tenant_of("j") == "acme"
        before = round_trips()
        assert await jobs.job("j") is job
        assert round_trips() == before
