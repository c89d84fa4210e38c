"""Reading a topic (`marlaas.events`, `marlaas.adapters`) from outside the services: the
CLI, the demo, reports, audits.

No consumer group and no commits: every reader sees the whole topic from its start, so
`marlaas status` and `marlaas logs` work from any machine that reaches the broker.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Generic, TypeVar

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from common.bus import start_reader
from common.messages import AdapterUpdate, Event, Message, MessageDecodeError, Topic
from common.signing import RecordSigner
from common.wire import decode

M = TypeVar("M", bound=Message)


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
    ) -> None:
        self.bootstrap = bootstrap
        self.connect_timeout_s = connect_timeout_s
        self.signing = signing
        """Skips records not signed with the bus key (None: reads every record)."""
        self.job_ids = set(job_ids) if job_ids is not None else None
        self._consumer: AIOKafkaConsumer | None = None
        self._ends: dict[TopicPartition, int] = {}
        self._next: dict[TopicPartition, int] = {}
        """Offset after the last record read, per partition."""
        self._seen: set[str] = set()

    async def start(self) -> None:
        consumer, assigned = await start_reader(
            self.bootstrap,
            self.topic.value,
            client_id=f"marlaas-{self.topic.value}-reader",
            start_at="earliest",
            timeout_s=self.connect_timeout_s,
            keys=self.job_ids,  # a job's records are keyed by its id: only their partitions
        )
        if assigned:
            await consumer.seek_to_beginning(*assigned)
            self._ends = dict(await consumer.end_offsets(assigned))
        self._consumer = consumer

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def __aenter__(self) -> TopicFeed[M]:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

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
        deadline = time.monotonic() + timeout_s
        found: list[M] = []
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {self.topic.value} took over {timeout_s:.0f}s")
            read_before, caught_up = dict(self._next), self.caught_up
            found += await self.poll(settle_s if caught_up else 0.2)
            if caught_up and self._next == read_before:
                break
        found.sort(key=self._when)
        return found

    @staticmethod
    def _when(message: Message) -> float:
        when = getattr(message, "at", None) or getattr(message, "published_at", None)
        return float(when or 0.0)

    def _require(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError(f"{self.topic.value} feed not started")
        return self._consumer


class EventFeed(TopicFeed[Event]):
    """Events of some jobs (or all): status, logs, reports."""

    topic = Topic.EVENTS
    kind = Event


class AdapterFeed(TopicFeed[AdapterUpdate]):
    """Adapter announcements of some jobs (or all): audits."""

    topic = Topic.ADAPTERS
    kind = AdapterUpdate
