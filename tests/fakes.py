"""Stand-ins for Kafka and Redis that service handlers cannot tell from the real ones.

- `MemoryBus`: a `Sender` that keeps every message, encoded and decoded again exactly as the
  wire would carry it, by topic.
- `memory_store()`: the real `RedisStore` over fakeredis, which runs our Lua scripts (lupa):
  the same code, not a re-implementation of it.
- `KafkaTap` + `Backend`: the real producer and Valkey, with a reader that collects what a
  test's handlers produced from the moment the tap started; the same scenarios run on both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

import fakeredis
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from common.bus.kafka import Delivery, Producer
from common.bus.offsets import OffsetTracker
from common.bus.sender import Sender
from common.state.store import RedisStore
from common.wire.codec import decode, encode, fits_record, topic_of
from common.wire.messages import Message, Topic

HANDLER_TESTS_DB = 2


def memory_store() -> RedisStore:
    """A fresh, empty in-memory Redis behind the real store (Lua scripts included)."""
    return RedisStore(fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer()), "memory://")


@dataclass
class Inbox:
    """One consumed partition: records are handed over with a `Delivery` whose commits the
    test can watch, as `ConsumerLoop` would do it."""

    topic: str
    partition: int = 0
    tracker: OffsetTracker = field(default_factory=OffsetTracker)
    _next_offset: int = 0

    def delivery(self, key: bytes | None = None) -> Delivery:
        offset, self._next_offset = self._next_offset, self._next_offset + 1
        return Delivery(
            self.topic, self.partition, offset, key, int(time.time() * 1000), self.tracker
        )

    async def hand(self, handler: Callable[..., object], message: Message) -> Delivery:
        """Hand `message` to `handler` as the next record; marks it processed as the loop does."""
        delivery = self.delivery()
        await handler(message, delivery)  # type: ignore[misc]
        self.tracker.processed(delivery.offset)
        return delivery

    @property
    def committable(self) -> int | None:
        """The offset a commit would store now (next record to read after a restart)."""
        return self.tracker.committable()


class MemoryBus:
    """A `Sender` that keeps what was sent, by topic, in the order sent."""

    def __init__(self) -> None:
        self.topics: dict[Topic, list[Message]] = {}

    async def send(self, message: Message) -> None:
        topic = topic_of(message)
        # Through the wire format, so a message the real bus could not carry fails here too.
        self.topics.setdefault(topic, []).append(decode(topic, fits_record(topic, encode(message))))


class KafkaTap:
    """Reads what is produced to `topics` from the moment `start()` returns (no group)."""

    def __init__(self, bootstrap: str, topics: Iterable[Topic]) -> None:
        self.bootstrap = bootstrap
        self.topics = list(topics)
        self._consumer: AIOKafkaConsumer | None = None
        self.received: dict[Topic, list[Message]] = {}

    async def start(self) -> None:
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        await consumer.start()
        await consumer.topics()
        assigned = [
            TopicPartition(topic.value, p)
            for topic in self.topics
            for p in sorted(consumer.partitions_for_topic(topic.value) or ())
        ]
        consumer.assign(assigned)
        for tp, end in (await consumer.end_offsets(assigned)).items():
            consumer.seek(tp, end)
        self._consumer = consumer

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def poll(self, timeout_s: float) -> None:
        assert self._consumer is not None
        batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000))
        for records in batches.values():
            for record in records:
                topic = Topic(record.topic)
                self.received.setdefault(topic, []).append(decode(topic, record.value))


class Backend(Protocol):
    """What a handler test runs on: a producer, a store, and a way to see what was sent."""

    @property
    def producer(self) -> Sender: ...

    @property
    def store(self) -> RedisStore: ...

    async def sent(self, topic: Topic, job_id: str, *, expect: int) -> list[Message]:
        """The messages of `job_id` on `topic` so far; waits (real bus) for `expect` of them
        and a little longer, so that extra ones are seen too."""
        ...


@dataclass
class MemoryBackend:
    producer: MemoryBus
    store: RedisStore

    async def sent(self, topic: Topic, job_id: str, *, expect: int) -> list[Message]:
        return [m for m in self.producer.topics.get(topic, []) if _job_of(m) == job_id]


@dataclass
class KafkaBackend:
    producer: Producer
    store: RedisStore
    tap: KafkaTap
    settle_s: float = 0.5
    timeout_s: float = 30.0

    async def sent(self, topic: Topic, job_id: str, *, expect: int) -> list[Message]:
        deadline = time.monotonic() + self.timeout_s

        def mine() -> list[Message]:
            return [m for m in self.tap.received.get(topic, []) if _job_of(m) == job_id]

        while len(mine()) < expect and time.monotonic() < deadline:
            await self.tap.poll(0.2)
        await self.tap.poll(self.settle_s)
        return mine()


def _job_of(message: Message) -> str:
    return str(getattr(message, "job_id", ""))


@asynccontextmanager
async def memory_backend() -> AsyncIterator[MemoryBackend]:
    store = memory_store()
    try:
        yield MemoryBackend(MemoryBus(), store)
    finally:
        await store.close()


@asynccontextmanager
async def kafka_backend(bootstrap: str, redis_url: str) -> AsyncIterator[KafkaBackend]:
    """The real producer (Tansu) and store (Valkey), and a tap on every topic.

    The store is Redis database `HANDLER_TESTS_DB`: service processes running on the same
    servers (the pipeline tests') then do not know these jobs and leave their messages alone,
    instead of acting on them beside the handlers under test.
    """
    producer = Producer(bootstrap, client_id="handler-tests")
    await producer.start(timeout_s=30)
    store = await RedisStore.connect(
        f"{redis_url.rsplit('/', 1)[0]}/{HANDLER_TESTS_DB}", timeout_s=30
    )
    tap = KafkaTap(bootstrap, list(Topic))
    await tap.start()
    try:
        yield KafkaBackend(producer, store, tap)
    finally:
        await asyncio.gather(tap.stop(), producer.stop(), store.close())
