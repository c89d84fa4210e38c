"""Reading a topic (`marlaas.events`, `marlaas.adapters`, `marlaas.trajectories`) from outside
the services: the CLI, the demo, reports, audits, the tenant API's episode samples.

No consumer group and no commits: every reader sees the whole topic from its start, so
`marlaas status` and `marlaas logs` work from any machine that reaches the broker. A process
that serves many short reads (the tenant API) lends them consumers from a `ReaderPool`
instead of starting one per read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from typing import Generic, TypeVar

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from common.bus.kafka import assign_topic, start_reader
from common.security.signing import RecordSigner
from common.wire.codec import decode
from common.wire.messages import (
    AdapterUpdate,
    Event,
    Message,
    MessageDecodeError,
    Topic,
    Trajectory,
)

M = TypeVar("M", bound=Message)
log = logging.getLogger(__name__)


class ReadersBusy(Exception):
    """Every consumer of a `ReaderPool` is lent out, and none came back in time."""


class ReaderPool:
    """At most `size` consumers in no group, each started once and lent to one read at a time:
    however many reads a process serves, it holds at most `size` broker connections for them.
    A read waits up to `wait_s` for a free consumer, then gets ReadersBusy. A consumer comes
    back with its partitions paused, so it fetches nothing while idle (not unassigned: aiokafka
    swallows a stop that lands while it drops an assignment's fetches, and then hangs), and is
    lent again to reads of the same topic only (its metadata then knows that topic alone); one
    whose read failed is closed, not lent again."""

    def __init__(
        self, bootstrap: str, *, size: int, wait_s: float, connect_timeout_s: float = 10.0
    ) -> None:
        self.bootstrap, self.size, self.wait_s = bootstrap, size, wait_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[str, list[AIOKafkaConsumer]] = {}
        """Consumers given back, by the topic they read."""
        self._started = 0
        """Consumers started and not stopped, lent or idle: at most `size`."""
        self._free = asyncio.Semaphore(size)
        self._closed = False

    async def lend(
        self, topic: str, keys: Collection[str] | None
    ) -> tuple[AIOKafkaConsumer, list[TopicPartition]]:
        """A started consumer assigned the partitions of `topic` that records keyed `keys` go
        to (None: all), as `start_reader` assigns one; and those partitions. `give_back` it."""
        try:
            await asyncio.wait_for(self._free.acquire(), self.wait_s)
        except TimeoutError:
            raise ReadersBusy(
                f"all {self.size} event readers are busy (waited {self.wait_s:g}s); retry shortly"
            ) from None
        idle = self._idle.get(topic)
        consumer: AIOKafkaConsumer | None = idle.pop() if idle else None
        try:
            if consumer is None:
                self._started += 1  # counted before anything yields
                idle_elsewhere = [c for same in self._idle.values() for c in same]
                if self._started > self.size and idle_elsewhere:  # make room
                    await self._stop(idle_elsewhere[0])
                consumer, _ = await start_reader(
                    self.bootstrap,
                    topic,
                    client_id="marlaas-pooled-reader",
                    start_at="earliest",
                    timeout_s=self.connect_timeout_s,
                    keys=(),  # assigned below, as for a consumer lent again
                )
            assigned = await assign_topic(consumer, topic, keys)
        except BaseException:
            if consumer is None:
                self._started -= 1
            else:
                await self._stop(consumer)
            self._free.release()
            raise
        return consumer, assigned

    async def give_back(self, consumer: AIOKafkaConsumer, *, usable: bool) -> None:
        """Return a consumer from `lend`: kept for the next read when `usable`, else closed."""
        try:
            if usable and not self._closed:
                consumer.pause(*consumer.assignment())
                topic = next(iter(consumer.assignment()), TopicPartition("", 0)).topic
                self._idle.setdefault(topic, []).append(consumer)
            else:
                await self._stop(consumer)
        finally:
            self._free.release()

    async def close(self) -> None:
        """Close the idle consumers; those lent out close when given back."""
        self._closed = True
        for consumer in [c for same in self._idle.values() for c in same]:
            await self._stop(consumer)

    async def _stop(self, consumer: AIOKafkaConsumer) -> None:
        for same in self._idle.values():
            if consumer in same:
                same.remove(consumer)
        self._started -= 1
        try:
            await asyncio.wait_for(consumer.stop(), self.connect_timeout_s)
        except TimeoutError:  # the hang above, should a stop still meet it: not the caller's
            log.warning("a pooled Kafka reader did not stop in %.0fs", self.connect_timeout_s)


class TopicFeed(Generic[M]):
    """Messages of some jobs (or all), from the topic's start, read in batches as they come,
    de-duplicated by their `dedup_id`.

    `caught_up` turns true once every partition was read up to where it ended when the feed
    started: what a one-shot view (`status --once`, `logs`, `report`) needs to be complete.
    """

    topic: Topic
    kind: type[M]

    def __init__(
        self,
        bootstrap: str,
        job_ids: Collection[str] | None = None,
        *,
        connect_timeout_s: float = 10.0,
        signing: RecordSigner | None = None,
        readers: ReaderPool | None = None,
        tail: int | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.connect_timeout_s = connect_timeout_s
        self.signing = signing
        """Skips records not signed with the bus key (None: reads every record)."""
        self.readers = readers
        """Lends the feed its consumer, given back when it stops (None: it starts its own)."""
        self.job_ids = set(job_ids) if job_ids is not None else None
        self.tail = tail
        """Read only the last `tail` records of each partition (None: from the topic's start)."""
        self._consumer: AIOKafkaConsumer | None = None
        self._ends: dict[TopicPartition, int] = {}
        self._next: dict[TopicPartition, int] = {}
        """Offset after the last record read, per partition."""
        self._seen: set[str] = set()

    async def start(self) -> None:
        topic = self.topic.value
        if self.readers is None:
            consumer, assigned = await start_reader(
                self.bootstrap,
                topic,
                client_id=f"marlaas-{topic}-reader",
                start_at="earliest",
                timeout_s=self.connect_timeout_s,
                keys=self.job_ids,  # a job's records are keyed by its id: only their partitions
            )
        else:
            consumer, assigned = await self.readers.lend(topic, self.job_ids)
        self._consumer = consumer
        try:
            if assigned:
                await self._seek(consumer, assigned)
        except BaseException:
            await self.stop(usable=False)
            raise

    async def _seek(self, consumer: AIOKafkaConsumer, assigned: list[TopicPartition]) -> None:
        """To each partition's first record, or `tail` records before where it ends now. A
        partition whose window holds nothing (retention dropped all it had) is caught up
        at once, not waited on."""
        self._ends = dict(await consumer.end_offsets(assigned))
        firsts = await consumer.beginning_offsets(assigned)
        for tp in assigned:
            offset = (
                firsts[tp] if self.tail is None else max(firsts[tp], self._ends[tp] - self.tail)
            )
            consumer.seek(tp, offset)
            self._next[tp] = offset

    async def stop(self, *, usable: bool = True) -> None:
        """Close the feed's consumer, or give it back to its pool (to lend again if `usable`)."""
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        if self.readers is None:
            await consumer.stop()
        else:
            await self.readers.give_back(consumer, usable=usable)

    async def __aenter__(self) -> TopicFeed[M]:
        await self.start()
        return self

    async def __aexit__(self, failed: type[BaseException] | None, *_: object) -> None:
        await self.stop(usable=failed is None)  # a failed read may have left it mid-fetch

    @property
    def caught_up(self) -> bool:
        return all(self._next.get(tp, 0) >= end for tp, end in self._ends.items())

    async def poll(self, timeout_s: float = 0.5) -> list[M]:
        """The messages that arrived since the last poll, in the order they were made."""
        consumer = self._require()
        batches = await consumer.getmany(timeout_ms=int(timeout_s * 1000))
        found: list[M] = []
        for tp, records in batches.items():
            for record in records:
                self._next[tp] = record.offset + 1
                if self.signing is not None and self.signing.problem(
                    record.topic, record.key, record.value, record.headers
                ):
                    continue  # not from a service: a forged event or announcement
                try:
                    message = decode(self.topic, record.value)
                except MessageDecodeError:
                    continue  # the services dead-letter those; a reader just skips them
                if not isinstance(message, self.kind) or message.dedup_id in self._seen:
                    continue
                if self.job_ids is None or getattr(message, "job_id", None) in self.job_ids:
                    self._seen.add(message.dedup_id)
                    found.append(message)
        found.sort(key=self._when)
        return found

    async def read_to_end(self, *, timeout_s: float = 30.0, settle_s: float = 0.3) -> list[M]:
        """Every message up to where the topic ended when the feed started, and whatever
        follows it without a pause of `settle_s`: a broker's end offsets are only a lower
        bound (Tansu's s3 engine reports a partition's last batches late), so reading stops
        at the first poll past them that finds no record."""
        found = [
            message
            async for batch in self.batches_to_end(timeout_s=timeout_s, settle_s=settle_s)
            for message in batch
        ]
        found.sort(key=self._when)
        return found

    async def batches_to_end(
        self, *, timeout_s: float = 30.0, settle_s: float = 0.3
    ) -> AsyncIterator[list[M]]:
        """`read_to_end` a poll at a time, for a reader that keeps only some of the messages
        (the latest episodes of a job) instead of holding them all at once."""
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {self.topic.value} took over {timeout_s:.0f}s")
            read_before, caught_up = dict(self._next), self.caught_up
            if batch := await self.poll(settle_s if caught_up else 0.2):
                yield batch
            if caught_up and self._next == read_before:
                return

    @staticmethod
    def _when(message: Message) -> float:
        when = (
            getattr(message, "at", None)
            or getattr(message, "published_at", None)
            or getattr(message, "finished_at", None)
        )
        return float(when or 0.0)

    def _require(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError(f"{self.topic.value} feed not started")
        return self._consumer


class EventFeed(TopicFeed[Event]):
    """Events of some jobs (or all): status, logs, reports."""

    topic = Topic.EVENTS
    kind = Event


class TrajectoryFeed(TopicFeed[Trajectory]):
    """Finished episodes of some jobs: the tenant API's episode samples. Read with `tail`: the
    topic holds every token of every episode, and a sample wants only the latest."""

    topic = Topic.TRAJECTORIES
    kind = Trajectory


class AdapterFeed(TopicFeed[AdapterUpdate]):
    """Adapter announcements of some jobs (or all): audits."""

    topic = Topic.ADAPTERS
    kind = AdapterUpdate
