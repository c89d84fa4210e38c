"""common.bus.kafka against a real Tansu broker: at-least-once, groups, dead letters, lag."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaConnectionError, NodeNotReadyError
from prometheus_client import REGISTRY
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError

from common.bus.kafka import ConsumerLoop, Delivery, Producer
from common.runtime.backoff import RetryableError, ServerUnreachable
from common.security.signing import RecordSigner
from common.state.store import RedisStore
from common.wire.codec import decode, encode
from common.wire.messages import DeadLetter, Event, Topic, new_id
from console.stack.children import free_port
from console.stack.infra import start_valkey
from console.stack.topics import ensure_topics, group_lag
from marlaas.eventfeed import EventFeed

pytestmark = pytest.mark.kafka


def event(job_id: str, step: int = 0) -> Event:
    return Event(event_id=new_id(), job_id=job_id, event="step", service="test", step=step)


@asynccontextmanager
async def producer(bootstrap: str) -> AsyncIterator[Producer]:
    prod = Producer(bootstrap, client_id="test")
    await prod.start(timeout_s=30)
    try:
        yield prod
    finally:
        await prod.stop()


@asynccontextmanager
async def running(loop: ConsumerLoop[Any]) -> AsyncIterator[ConsumerLoop[Any]]:
    """Start the loop, run it in a task, wait for its partitions; stop and close on exit."""
    await loop.start(timeout_s=30)
    task = asyncio.create_task(loop.run(), name="test-consumer")
    try:
        await wait_for(lambda: bool(loop.assignment) or task.done(), what="partition assignment")
        yield loop
    finally:
        loop.stop()
        await asyncio.wait_for(task, 30)
        await loop.close()


async def wait_for(predicate: Callable[[], bool], *, what: str, timeout_s: float = 45) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def read_dead_letters(bootstrap: str, source_key: bytes, count: int) -> list[DeadLetter]:
    """Read the DLQ from the start (no group) until `count` letters with `source_key` arrived."""
    consumer = AIOKafkaConsumer(
        Topic.DLQ.value, bootstrap_servers=bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    found: list[DeadLetter] = []
    try:
        deadline = time.monotonic() + 30
        while len(found) < count and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    letter = decode(Topic.DLQ, record.value)
                    assert isinstance(letter, DeadLetter)
                    if letter.source_key == source_key:
                        found.append(letter)
    finally:
        await consumer.stop()
    return found


def collecting(
    job_id: str, into: list[Event], before: Callable[[Event], Awaitable[None]] | None = None
) -> Callable[[Event, Delivery], Awaitable[None]]:
    async def handle(message: Event, delivery: Delivery) -> None:
        if message.job_id != job_id:
            return  # messages of other tests share the topic
        if before is not None:
            await before(message)
        into.append(message)

    return handle


async def test_ensure_topics_creates_all_with_12_partitions_and_is_idempotent(
    kafka_bootstrap: str,
) -> None:
    first = await ensure_topics(kafka_bootstrap, 12)
    second = await ensure_topics(kafka_bootstrap, 12)
    assert first == second == {topic.value: 12 for topic in Topic}


async def test_producer_gives_up_on_an_unreachable_broker_with_its_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ServerUnreachable, match=f"Kafka at {address} unreachable"):
        await Producer(address, client_id="test").start(timeout_s=1.5)
    assert time.monotonic() - started < 10


CRASHING_CONSUMER = textwrap.dedent(
    """
    import asyncio, os, sys
    from common.bus.kafka import ConsumerLoop, Producer

    async def main(bootstrap, group, job_id):
        dlq = Producer(bootstrap, client_id="crasher")
        await dlq.start()

        async def handle(message, delivery):
            if message.job_id == job_id:
                print("got", message.event_id, flush=True)
                os._exit(17)  # dies after handling, before any commit

        loop = ConsumerLoop(bootstrap=bootstrap, group_id=group, topics=["marlaas.events"],
                            handler=handle, dead_letters=dlq, service="crasher")
        await loop.start()
        await loop.run()

    asyncio.run(main(*sys.argv[1:]))
    """
)


async def test_a_consumer_that_dies_before_committing_gets_the_message_again(
    kafka_bootstrap: str,
) -> None:
    job_id, group = f"crash-{new_id()}", f"group-{new_id()}"
    sent = event(job_id)
    async with producer(kafka_bootstrap) as prod:
        await prod.send(sent)
        crasher = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", CRASHING_CONSUMER, kafka_bootstrap, group, job_id],
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ.copy(),
        )
        assert crasher.returncode == 17, crasher.stderr
        assert f"got {sent.event_id}" in crasher.stdout

        received: list[Event] = []
        loop = ConsumerLoop[Event](
            bootstrap=kafka_bootstrap,
            group_id=group,
            topics=[Topic.EVENTS],
            handler=collecting(job_id, received),
            dead_letters=prod,
            service="survivor",
        )
        async with running(loop):
            await wait_for(lambda: len(received) >= 1, what="redelivery", timeout_s=60)
        assert [m.event_id for m in received] == [sent.event_id]

        # Now committed: a third member of the group gets nothing more for this job.
        again: list[Event] = []
        loop = ConsumerLoop[Event](
            bootstrap=kafka_bootstrap,
            group_id=group,
            topics=[Topic.EVENTS],
            handler=collecting(job_id, again),
            dead_letters=prod,
            service="third",
        )
        async with running(loop):
            await asyncio.sleep(2)
        assert again == []


async def test_two_consumers_in_one_group_split_the_partitions(kafka_bootstrap: str) -> None:
    job_prefix, group = f"split-{new_id()}", f"group-{new_id()}"
    handled: dict[str, list[str]] = {"a": [], "b": []}

    def handler(name: str) -> Callable[[Event, Delivery], Awaitable[None]]:
        async def handle(message: Event, delivery: Delivery) -> None:
            if message.job_id.startswith(job_prefix):
                handled[name].append(message.event_id)

        return handle

    async with producer(kafka_bootstrap) as prod:
        a = ConsumerLoop[Event](
            bootstrap=kafka_bootstrap,
            group_id=group,
            topics=[Topic.EVENTS],
            handler=handler("a"),
            dead_letters=prod,
            service="a",
        )
        b = ConsumerLoop[Event](
            bootstrap=kafka_bootstrap,
            group_id=group,
            topics=[Topic.EVENTS],
            handler=handler("b"),
            dead_letters=prod,
            service="b",
        )
        async with running(a):
            async with running(b):
                await wait_for(
                    lambda: (
                        len(a.assignment) + len(b.assignment) == 12
                        and bool(a.assignment)
                        and bool(b.assignment)
                    ),
                    what="a rebalance that gives both members partitions",
                    timeout_s=60,
                )
                assert not a.assignment & b.assignment
                assert {tp.partition for tp in a.assignment | b.assignment} == set(range(12))
                sent = [event(f"{job_prefix}-{i}") for i in range(48)]
                for message in sent:
                    await prod.send(message)
                await wait_for(
                    lambda: len(handled["a"]) + len(handled["b"]) >= len(sent), what="all events"
                )
    assert sorted(handled["a"] + handled["b"]) == sorted(m.event_id for m in sent)
    assert handled["a"] and handled["b"]  # both members did work


async def test_garbage_and_failing_messages_go_to_the_dlq_and_the_loop_goes_on(
    kafka_bootstrap: str,
) -> None:
    job_id, group = f"dlq-{new_id()}", f"group-{new_id()}"
    poison = event(job_id, step=666)
    good = [event(job_id, step=1), event(job_id, step=2)]
    received: list[Event] = []

    async def refuse_poison(message: Event) -> None:
        if message.step == 666:
            raise ValueError("step 666 is not allowed")

    async with producer(kafka_bootstrap) as prod:
        # Same key -> same partition, so the good messages sit behind the bad ones.
        await prod.send_raw(Topic.EVENTS, b"\xc1 not msgpack", key=job_id.encode())
        await prod.send(poison)
        for message in good:
            await prod.send(message)
        loop = ConsumerLoop[Event](
            bootstrap=kafka_bootstrap,
            group_id=group,
            topics=[Topic.EVENTS],
            handler=collecting(job_id, received, before=refuse_poison),
            dead_letters=prod,
            service="dlq-test",
        )
        async with running(loop):
            await wait_for(lambda: len(received) == 2, what="the good messages")
            assert loop.dead_letter_count >= 2
        letters = await read_dead_letters(kafka_bootstrap, job_id.encode(), 2)

    assert [m.step for m in received] == [1, 2]
    garbage, failed = sorted(letters, key=lambda letter: letter.source_offset)
    assert garbage.raw_value == b"\xc1 not msgpack"
    assert "cannot decode message on marlaas.events" in garbage.error
    assert failed.source_offset == garbage.source_offset + 1
    assert decode(Topic.EVENTS, failed.raw_value) == poison
    assert "ValueError: step 666 is not allowed" in failed.error
    assert {letter.service for letter in letters} == {"dlq-test"}
    assert {letter.source_topic for letter in letters} == {Topic.EVENTS.value}
    # Everything was handled or dead-lettered, so the group's lag on that partition is 0.
    lag = {p.partition: p for p in await group_lag(kafka_bootstrap, group, [Topic.EVENTS])}
    assert lag[garbage.source_partition].lag == 0


async def test_with_a_bus_key_only_records_signed_with_it_are_handled(
    kafka_bootstrap: str,
) -> None:
    """A holder of the bus key signs; a record from anyone else (no signature, another key,
    a signed record altered on the way) is dead-lettered with the reason, never handled."""
    job_id, group = f"signed-{new_id()}", f"group-{new_id()}"
    key, other = RecordSigner("deployment-key"), RecordSigner("a-guess")
    signed = Producer(kafka_bootstrap, client_id="test-signed", signing=key)
    forger = Producer(kafka_bootstrap, client_id="test-forger", signing=other)
    await signed.start(timeout_s=30)
    await forger.start(timeout_s=30)
    received: list[Event] = []
    try:
        async with producer(kafka_bootstrap) as unsigned:
            await unsigned.send(event(job_id, step=1))
            await forger.send(event(job_id, step=2))
            value = encode(event(job_id, step=3))
            tampered = key.headers(Topic.EVENTS, job_id.encode(), value)
            assert signed._producer is not None
            await signed._producer.send_and_wait(
                Topic.EVENTS,
                value.replace(b"step", b"stem"),
                key=job_id.encode(),
                headers=tampered,
            )
            await signed.send(event(job_id, step=4))
            loop = ConsumerLoop[Event](
                bootstrap=kafka_bootstrap,
                group_id=group,
                topics=[Topic.EVENTS],
                handler=collecting(job_id, received),
                dead_letters=signed,
                service="signed-test",
                signing=key,
            )
            async with running(loop):
                await wait_for(lambda: len(received) == 1, what="the signed record")
            letters = await read_dead_letters(kafka_bootstrap, job_id.encode(), 3)
    finally:
        await signed.stop()
        await forger.stop()
    assert [m.step for m in received] == [4]
    errors = [letter.error for letter in sorted(letters, key=lambda x: x.source_offset)]
    assert errors[0].startswith("unsigned record (no marlaas-sig header)")
    assert errors[1].startswith("bad signature") and errors[2].startswith("bad signature")


@pytest.mark.parametrize(
    "error",
    [
        RetryableError("ours"),
        RedisConnectionError("Connection closed by server."),
        BusyLoadingError("Redis is loading the dataset in memory"),
        KafkaConnectionError("No connection to node with id 0"),
        NodeNotReadyError("node 0 not ready"),
    ],
    ids=lambda exc: type(exc).__name__,
)
async def test_a_transient_failure_is_redelivered_not_dead_lettered(
    kafka_bootstrap: str, error: Exception
) -> None:
    """The clients' own errors, not only built-in ones: a Redis restart must not dead-letter."""
    job_id, group = f"retry-{new_id()}", f"group-{new_id()}"
    attempts: list[int] = []
    received: list[Event] = []

    async def flaky(message: Event) -> None:
        attempts.append(message.step)
        if len(attempts) < 3:
            raise error

    async with producer(kafka_bootstrap) as prod:
        await prod.send(event(job_id, step=7))
        loop = ConsumerLoop[Event](
            bootstrap=kafka_bootstrap,
            group_id=group,
            topics=[Topic.EVENTS],
            handler=collecting(job_id, received, before=flaky),
            dead_letters=prod,
            service="retry-test",
            retry_backoff_s=0.1,
        )
        async with running(loop):
            await wait_for(lambda: len(received) == 1, what="success after retries")
    # Handed over again after each failure: a dead-lettered record would not be retried.
    assert attempts == [7, 7, 7]


async def test_handlers_ride_out_a_valkey_restart(kafka_bootstrap: str, tmp_path: Path) -> None:
    """A real Valkey stopped and started again while records arrive: every record is
    handled once Redis is back, none dead-lettered."""
    port = free_port()
    valkey = start_valkey(port, tmp_path / "valkey", tmp_path / "valkey.log")
    store = await RedisStore.connect(f"redis://127.0.0.1:{port}/0", timeout_s=30)
    job_id, group = f"restart-{new_id()}", f"group-{new_id()}"
    received: list[Event] = []

    async def record(message: Event) -> None:
        await store.dedup.mark_seen("restart-test", job_id, str(message.step))

    try:
        async with producer(kafka_bootstrap) as prod:
            loop = ConsumerLoop[Event](
                bootstrap=kafka_bootstrap,
                group_id=group,
                topics=[Topic.EVENTS],
                handler=collecting(job_id, received, before=record),
                dead_letters=prod,
                service="restart-test",
                retry_backoff_s=0.1,
                max_retry_backoff_s=0.5,
            )
            async with running(loop):
                await prod.send(event(job_id, step=0))
                await wait_for(lambda: len(received) == 1, what="a record before the restart")
                valkey.stop()
                for step in (1, 2, 3):
                    await prod.send(event(job_id, step=step))
                await asyncio.sleep(1.5)  # handlers fail against the stopped server meanwhile
                assert len(received) == 1
                valkey = start_valkey(port, tmp_path / "valkey", tmp_path / "valkey.log")
                await wait_for(lambda: len(received) == 4, what="the records after the restart")
        # A dead-lettered record would never have reached `received`.
        assert sorted(m.step for m in received) == [0, 1, 2, 3]
        for step in (1, 2, 3):
            assert await store.dedup.seen("restart-test", job_id, str(step))
    finally:
        await store.close()
        valkey.stop()


async def test_a_held_commit_keeps_lag_until_released(kafka_bootstrap: str) -> None:
    job_id, group = f"hold-{new_id()}", f"group-{new_id()}"
    releases: list[Callable[[], None]] = []
    partitions: list[int] = []

    async def hold(message: Event, delivery: Delivery) -> None:
        if message.job_id == job_id:
            releases.append(delivery.hold_commit())
            partitions.append(delivery.partition)

    async with producer(kafka_bootstrap) as prod:
        for step in range(3):
            await prod.send(event(job_id, step))
        loop = ConsumerLoop[Event](
            bootstrap=kafka_bootstrap,
            group_id=group,
            topics=[Topic.EVENTS],
            handler=hold,
            dead_letters=prod,
            service="hold-test",
        )
        async with running(loop):
            await wait_for(lambda: len(releases) == 3, what="three held messages")
            await loop.commit()
            lag = {p.partition: p.lag for p in await loop.lag()}
            assert lag[partitions[0]] == 3  # all three still uncommitted
            releases[0]()
            await loop.commit()
            lag = {p.partition: p.lag for p in await loop.lag()}
            assert lag[partitions[0]] == 2
            releases[2]()  # out of order: the middle one still blocks
            await loop.commit()
            assert {p.partition: p.lag for p in await loop.lag()}[partitions[0]] == 2
            releases[1]()
            await loop.commit()
            assert {p.partition: p.lag for p in await loop.lag()}[partitions[0]] == 0


async def test_group_lag_counts_uncommitted_records(kafka_bootstrap: str) -> None:
    job_id = f"lag-{new_id()}"
    async with producer(kafka_bootstrap) as prod:
        for step in range(5):
            await prod.send(event(job_id, step))
    never_consumed = await group_lag(kafka_bootstrap, f"group-{new_id()}", [Topic.EVENTS])
    assert len(never_consumed) == 12
    assert all(p.committed is None and p.lag == p.end_offset for p in never_consumed)
    assert sum(p.lag for p in never_consumed) >= 5


def sample(name: str, service: str, topic: str = Topic.EVENTS.value, **labels: str) -> float:
    """A consumer metric's current value (common/runtime/metrics.py) from the default registry."""
    value = REGISTRY.get_sample_value(name, {"service": service, "topic": topic, **labels})
    assert value is not None, f"{name} of {service} on {topic} is not exported"
    return value


async def caught_up(loop: ConsumerLoop[Any]) -> None:
    """Wait until everything earlier tests left on the loop's topics is handled and committed."""
    deadline = time.monotonic() + 60
    while sum(p.lag for p in await loop.lag()) > 0:
        assert time.monotonic() < deadline, "never caught up with the topic"
        await asyncio.sleep(0.2)


async def test_consumer_metrics_count_records_dead_letters_and_handler_latency(
    kafka_bootstrap: str,
) -> None:
    job_id, group = f"metrics-{new_id()}", f"group-{new_id()}"
    service = f"metrics-test-{new_id()[:8]}"
    n_good, handler_s = 5, 0.02
    received: list[Event] = []

    async def take_a_while(message: Event) -> None:
        await asyncio.sleep(handler_s)

    names = (
        "marlaas_messages_processed_total",
        "marlaas_messages_failed_total",
        "marlaas_dead_letters_total",
        "marlaas_handler_seconds_count",
        "marlaas_handler_seconds_sum",
    )
    async with producer(kafka_bootstrap) as prod:
        loop = ConsumerLoop[Event](
            bootstrap=kafka_bootstrap,
            group_id=group,
            topics=[Topic.EVENTS],
            handler=collecting(job_id, received, before=take_a_while),
            dead_letters=prod,
            service=service,
        )
        async with running(loop):
            await caught_up(loop)
            before = {name: sample(name, service) for name in names}
            fast_before = sample("marlaas_handler_seconds_bucket", service, le="0.01")
            await prod.send(event(job_id, step=0))
            await prod.send_raw(Topic.EVENTS, b"\xc1 not msgpack", key=job_id.encode())
            for step in range(1, n_good):
                await prod.send(event(job_id, step))

            def moved(name: str) -> float:
                return sample(name, service) - before[name]

            await wait_for(
                lambda: (
                    moved("marlaas_messages_processed_total") >= n_good
                    and moved("marlaas_dead_letters_total") >= 1
                ),
                what="the records counted",
            )
            await asyncio.sleep(0.5)  # a double count would show by now

    assert [m.step for m in received] == list(range(n_good))
    assert moved("marlaas_messages_processed_total") == n_good
    assert moved("marlaas_dead_letters_total") == 1
    assert moved("marlaas_messages_failed_total") == 1  # the undecodable record
    # Only decoded records reach the handler; each took at least `handler_s`.
    assert moved("marlaas_handler_seconds_count") == n_good
    assert moved("marlaas_handler_seconds_sum") >= n_good * handler_s
    assert sample("marlaas_handler_seconds_bucket", service, le="0.01") == fast_before


async def test_consumer_lag_gauge_follows_held_commits(kafka_bootstrap: str) -> None:
    job_id, group = f"lag-gauge-{new_id()}", f"group-{new_id()}"
    service = f"lag-test-{new_id()[:8]}"
    releases: list[Callable[[], None]] = []

    async def hold(message: Event, delivery: Delivery) -> None:
        if message.job_id == job_id:
            releases.append(delivery.hold_commit())

    def lag() -> float:
        return sample("marlaas_consumer_lag", service)

    async with producer(kafka_bootstrap) as prod:
        loop = ConsumerLoop[Event](
            bootstrap=kafka_bootstrap,
            group_id=group,
            topics=[Topic.EVENTS],
            handler=hold,
            dead_letters=prod,
            service=service,
            lag_interval_s=0.2,
        )
        async with running(loop):
            await caught_up(loop)
            for step in range(3):
                await prod.send(event(job_id, step))
            await wait_for(lambda: len(releases) == 3, what="three held messages")
            await wait_for(lambda: lag() == 3, what="the gauge to show three uncommitted")
            for release in releases:
                release()
            await wait_for(lambda: lag() == 0, what="the gauge to drop to 0")


async def test_caught_up_once_every_record_of_the_partition_is_handled(
    kafka_bootstrap: str,
) -> None:
    """What the trainer asks before dropping a quiet job's groups as lost: has this member
    read the job's partition to its end (held records count as read)?"""
    job_id, group = f"caught-{new_id()}", f"group-{new_id()}"
    partitions: list[int] = []
    let_through = asyncio.Event()

    async def slow(message: Event, delivery: Delivery) -> None:
        if message.job_id == job_id:
            partitions.append(delivery.partition)
            delivery.hold_commit()
            await let_through.wait()

    async with producer(kafka_bootstrap) as prod:
        for step in range(3):
            await prod.send(event(job_id, step))
        loop = ConsumerLoop[Event](
            bootstrap=kafka_bootstrap,
            group_id=group,
            topics=[Topic.EVENTS],
            handler=slow,
            dead_letters=prod,
            service="caught-up-test",
        )
        async with running(loop):
            await wait_for(lambda: len(partitions) == 1, what="the first record in hand")
            partition = partitions[0]
            assert not await loop.caught_up(Topic.EVENTS.value, partition)  # 2 still unread
            let_through.set()
            await wait_for(lambda: len(partitions) == 3, what="all three handled")
            deadline = time.monotonic() + 30
            while not await loop.caught_up(Topic.EVENTS.value, partition):
                assert time.monotonic() < deadline, "never caught up"
                await asyncio.sleep(0.1)
            assert not await loop.caught_up(Topic.EVENTS.value, 999)  # not ours


async def test_a_feed_of_one_job_reads_only_its_partition(kafka_bootstrap: str) -> None:
    """A tenant's event reads (the API's `events`) took the whole events topic of every
    tenant (issue 24): a feed of some jobs is assigned only the partitions their keys go to,
    and still finds every event of theirs."""
    ours, theirs = f"ours-{new_id()[:8]}", f"theirs-{new_id()[:8]}"
    async with producer(kafka_bootstrap) as prod:
        for step in range(3):
            await prod.send(event(ours, step))
            await prod.send(event(theirs, step))
    async with EventFeed(kafka_bootstrap, {ours}) as feed:
        assert feed._consumer is not None
        partitions = {tp.partition for tp in feed._consumer.assignment()}
        assert len(partitions) == 1  # of the topic's 12
        found = await feed.read_to_end(timeout_s=30)
    assert sorted(e.step for e in found) == [0, 1, 2] and {e.job_id for e in found} == {ours}
    async with EventFeed(kafka_bootstrap, None) as everything:
        assert everything._consumer is not None
        assert len(everything._consumer.assignment()) == 12
