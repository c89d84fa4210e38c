"""The tenant API holds no heavy resource per request, on the real broker and Redis: one
producer for every submission, a few pooled readers for every event read and report (503
past them, 429 past a tenant's share), exports streamed from a file rather than built in
memory, and requests without a valid key rate-limited by their address before any lookup."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import secrets
import tarfile
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from api_svc.server import ApiSettings
from common.bus import clients as bus
from common.bus.kafka import Producer
from common.files.artifacts import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from common.runtime.config import SharedSettings
from common.state.store import RedisStore
from common.state.tenants import TenantLimits, TenantRegistry, new_api_key
from common.wire.messages import EnvSettings, Event, JobSpec, Topic, new_id
from console.stack.local import LocalStack
from marlaas import Client
from marlaas.eventfeed import EventFeed, TopicFeed
from tests.api_server import api_server

pytestmark = pytest.mark.kafka


class JobsFeed(TopicFeed[JobSpec]):
    topic = Topic.JOBS
    kind = JobSpec


@pytest.fixture
def settings(local_stack: LocalStack) -> SharedSettings:
    """What the API holds: the stack's Kafka and Redis, and a bus key of its own."""
    return SharedSettings(
        kafka_bootstrap=local_stack.kafka_bootstrap,
        redis_url=local_stack.redis_url,
        bus_key=SecretStr(f"bounds-bus-key-{secrets.token_hex(8)}"),
        connect_timeout_s=10.0,
    )


def counted(monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[list[Any], list[Any]]:
    """Every `common.bus.clients.<name>` (AIOKafkaProducer, AIOKafkaConsumer) made from now on, and
    every one stopped."""
    made: list[Any] = []
    stopped: list[Any] = []
    base = getattr(bus, name)

    class Counted(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        async def stop(self) -> None:
            stopped.append(self)
            await super().stop()

    monkeypatch.setattr(bus, name, Counted)
    return made, stopped


async def with_store(settings: SharedSettings, work: Callable[[RedisStore], Awaitable[Any]]) -> Any:
    store = await RedisStore.connect(settings.redis_url, timeout_s=10)
    try:
        return await work(store)
    finally:
        await store.close()


async def tenant_with_job(settings: SharedSettings, *, events: int = 0) -> tuple[str, str, str]:
    """A fresh tenant's key, and a registered job of its with `events` signed step events."""
    tenant, job_id = f"bounds-{new_id()[:8]}", f"job-{new_id()[:12]}"
    spec = JobSpec(
        job_id=job_id,
        tenant=tenant,
        base_model=settings.base_model,  # a known model: exported under its public id
        env=EnvSettings(name="arithmetic"),
    )

    async def setup(store: RedisStore) -> str:
        await store.tenants.add(tenant, TenantLimits())
        await store.jobs.claim_id(job_id, tenant)
        await store.jobs.register(spec, status="completed")
        return str((await store.tenants.issue_key(tenant)).token)

    key = await with_store(settings, setup)
    producer = Producer(settings.kafka_bootstrap, client_id="bounds-test", signing=settings.signer)
    await producer.start(timeout_s=30)
    try:
        for step in range(1, events + 1):
            await producer.send(
                Event(
                    event_id=new_id(),
                    job_id=job_id,
                    event="step",
                    service="trainer_svc",
                    tenant=tenant,
                    step=step,
                    metrics={"reward_mean": step / 10},
                    at=time.time(),
                )
            )
    finally:
        await producer.stop()
    return key, tenant, job_id


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_every_submission_goes_through_the_one_producer_the_api_opened(
    settings: SharedSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, _, _ = await tenant_with_job(settings)
    producers, stopped = counted(monkeypatch, "AIOKafkaProducer")
    with api_server(settings) as url:
        async with httpx.AsyncClient(base_url=url, headers=bearer(key), timeout=30) as http:
            submitted = []
            for _ in range(12):
                answer = await http.post("/v1/jobs", json={"env": {"name": "arithmetic"}})
                assert answer.status_code == 202, answer.text
                submitted.append(answer.json()["job_id"])
        assert len(producers) == 1 and not stopped  # opened at start, kept open
    assert stopped == producers  # closed with the app
    async with JobsFeed(settings.kafka_bootstrap, submitted, signing=settings.signer) as feed:
        on_the_bus = {spec.job_id for spec in await feed.read_to_end(timeout_s=30)}
    assert on_the_bus == set(submitted)


async def test_event_reads_and_reports_share_the_apis_pooled_readers(
    settings: SharedSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, _, job_id = await tenant_with_job(settings, events=3)
    consumers, stopped = counted(monkeypatch, "AIOKafkaConsumer")
    with api_server(settings, ApiSettings(readers=2)) as url:
        async with httpx.AsyncClient(base_url=url, headers=bearer(key), timeout=30) as http:
            for _ in range(10):
                answer = await http.get(f"/v1/jobs/{job_id}/events")
                assert answer.status_code == 200, answer.text
                assert [e["step"] for e in answer.json()] == [1, 2, 3]
            for _ in range(3):
                answer = await http.get("/v1/report", params={"job": job_id})
                assert answer.status_code == 200, answer.text
                with tarfile.open(fileobj=io.BytesIO(answer.content)) as tar:
                    assert "report/report.json" in tar.getnames()
        assert len(consumers) == 1  # one read at a time: the same consumer every time
        assert not stopped  # kept between reads
    assert stopped == consumers  # closed with the app


async def test_reads_past_the_pool_get_503_and_past_a_tenants_share_429(
    settings: SharedSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, _, alices_job = await tenant_with_job(settings, events=1)
    bob, _, bobs_job = await tenant_with_job(settings, events=1)
    read_to_end = EventFeed.read_to_end
    reading, finish = threading.Event(), threading.Event()

    async def slowly(feed: EventFeed, **kwargs: Any) -> list[Event]:
        reading.set()
        await asyncio.to_thread(finish.wait, 60)  # a long read: it holds its reader
        return await read_to_end(feed, **kwargs)

    monkeypatch.setattr(EventFeed, "read_to_end", slowly)
    limits = ApiSettings(readers=1, reader_wait_s=0.5, max_reads=1)
    with api_server(settings, limits) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            first = asyncio.create_task(
                http.get(f"/v1/jobs/{alices_job}/events", headers=bearer(alice))
            )
            try:
                assert await asyncio.to_thread(reading.wait, 60)
                # Answered at once (429), or once the reader wait is over (503): not held.
                again = await http.get(
                    f"/v1/jobs/{alices_job}/events", headers=bearer(alice), timeout=10
                )
                assert again.status_code == 429, again.text
                assert "has 1 reads running" in again.json()["error"]
                busy = await http.get(
                    f"/v1/jobs/{bobs_job}/events", headers=bearer(bob), timeout=10
                )
                assert busy.status_code == 503, busy.text
                assert busy.headers["Retry-After"] == "1"
                assert "all 1 event readers are busy" in busy.json()["error"]
            finally:
                finish.set()
            assert (await first).status_code == 200
            later = await http.get(f"/v1/jobs/{bobs_job}/events", headers=bearer(bob))
            assert later.status_code == 200 and len(later.json()) == 1


async def test_an_export_is_streamed_from_disk_not_built_in_memory(
    settings: SharedSettings, tmp_path: Path
) -> None:
    key, _, job_id = await tenant_with_job(settings)
    weights_bytes = 48 * 1024 * 1024  # random: gzip cannot shrink it
    small, large = tmp_path / job_id / "v1", tmp_path / job_id / "v2"
    write_adapter(small, 2**20)
    write_adapter(large, weights_bytes)

    async def publish(store: RedisStore) -> None:
        for version, adapter in enumerate((small, large), start=1):
            await store.adapters.publish(job_id, version, adapter.resolve().as_uri(), version)

    await with_store(settings, publish)
    archive = tmp_path / "export.tar.gz"
    with api_server(settings) as url:
        async with httpx.AsyncClient(base_url=url, headers=bearer(key), timeout=120) as http:
            # v1 first, untraced: what the first export imports is no part of the measure.
            assert (await http.get(f"/v1/jobs/{job_id}/export?version=1")).status_code == 200
            tracemalloc.start()
            try:
                async with http.stream("GET", f"/v1/jobs/{job_id}/export") as answer:
                    assert answer.status_code == 200
                    assert answer.headers["X-Adapter-Version"] == "2"
                    with archive.open("wb") as out:
                        async for chunk in answer.aiter_raw():
                            out.write(chunk)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    assert archive.stat().st_size == int(answer.headers["Content-Length"])
    assert peak < weights_bytes / 8, f"{peak / 2**20:.1f} MiB held while exporting 48 MiB"
    with tarfile.open(archive) as tar:
        weights = tar.extractfile(f"{job_id}-v2/{ADAPTER_WEIGHTS}")
        assert weights is not None
        assert digest(weights) == digest((large / ADAPTER_WEIGHTS).open("rb"))


def write_adapter(directory: Path, weights_bytes: int) -> None:
    """A PEFT LoRA adapter whose one tensor is `weights_bytes` of random bytes."""
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    header = json.dumps(
        {name: {"dtype": "U8", "shape": [weights_bytes], "data_offsets": [0, weights_bytes]}}
    ).encode()
    with (directory / ADAPTER_WEIGHTS).open("wb") as weights:
        weights.write(len(header).to_bytes(8, "little") + header)
        for _ in range(weights_bytes // 2**20):
            weights.write(secrets.token_bytes(2**20))


def digest(stream: Any) -> str:
    hashed = hashlib.sha256()
    while chunk := stream.read(2**20):
        hashed.update(chunk)
    return hashed.hexdigest()


async def test_an_anonymous_flood_gets_429_before_its_keys_are_looked_up(
    settings: SharedSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, _, _ = await tenant_with_job(settings)
    lookups: list[str] = []
    authenticate = TenantRegistry.authenticate

    async def looked_up(registry: TenantRegistry, token: str) -> str | None:
        lookups.append(token)
        return await authenticate(registry, token)

    monkeypatch.setattr(TenantRegistry, "authenticate", looked_up)
    limits = ApiSettings(anonymous_requests_per_s=0.5, anonymous_burst=10)
    flooder = {"X-Forwarded-For": "198.51.100.7"}  # the test's loopback is a trusted proxy
    with api_server(settings, limits) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            tenant = {**flooder, **bearer(key)}
            assert (await http.get("/v1/tenant", headers=tenant)).status_code == 200
            guesses = [{**flooder, **bearer(new_api_key().token)} for _ in range(100)]
            answers = await asyncio.gather(*(http.get("/v1/jobs", headers=h) for h in guesses))
            statuses = sorted(answer.status_code for answer in answers)
            assert statuses == [401] * 10 + [429] * 90
            assert len(lookups) == 1 + 10  # the tenant's, then the flood's burst
            refused = next(answer for answer in answers if answer.status_code == 429)
            assert int(refused.headers["Retry-After"]) >= 1
            assert (await http.get("/openapi.json", headers=flooder)).status_code == 429
            # The tenant behind the same address is not refused for the flood.
            assert (await http.get("/v1/tenant", headers=tenant)).status_code == 200
            elsewhere = {"X-Forwarded-For": "203.0.113.9", **bearer(new_api_key().token)}
            assert (await http.get("/v1/jobs", headers=elsewhere)).status_code == 401


async def test_a_client_closes_at_once_after_its_pooled_reads(settings: SharedSettings) -> None:
    """The CLI's way: open a client, read a job's events, close. A pooled consumer given back
    and closed right after must close at once (aiokafka swallows a stop that lands while it
    drops a previous assignment's fetches, and then waits for an assignment for ever)."""
    _, _, job_id = await tenant_with_job(settings, events=2)
    for _ in range(5):
        started = time.monotonic()
        async with Client(settings, connect_timeout_s=5) as client:
            assert [event.step for event in await client.events(job_id)] == [1, 2]
        assert time.monotonic() - started < 10
