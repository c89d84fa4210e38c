"""Reading `marlaas.events` from outside the services: the CLI, the demo, reports.

No consumer group and no commits: every reader sees the whole topic from its start, so
`marlaas status` and `marlaas logs` work from any machine that reaches the broker.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from common.bus import start_client
from common.messages import Event, MessageDecodeError, Topic, decode


class EventFeed:
    """Events of some jobs (or all), from the topic's start, read in batches as they come.

    `caught_up` turns true once every partition was read up to where it ended when the feed
    started: what a one-shot view (`status --once`, `logs`, `report`) needs to be complete.
    """

    def __init__(
        self,
        bootstrap: str,
        job_ids: Collection[str] | None = None,
        *,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.bootstrap = bootstrap
        self.connect_timeout_s = connect_timeout_s
        self.job_ids = set(job_ids) if job_ids is not None else None
        self._consumer: AIOKafkaConsumer | None = None
        self._ends: dict[TopicPartition, int] = {}
        self._next: dict[TopicPartition, int] = {}
        """Offset after the last record read, per partition."""
        self._seen: set[str] = set()

    async def start(self) -> None:
        consumer = await start_client(
            lambda: AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap,
                client_id="marlaas-events-reader",
                enable_auto_commit=False,
                auto_offset_reset="earliest",
            ),
            self.bootstrap,
            self.connect_timeout_s,
        )
        partitions = consumer.partitions_for_topic(Topic.EVENTS.value)
        if not partitions:
            await consumer.topics()  # refresh metadata once
            partitions = consumer.partitions_for_topic(Topic.EVENTS.value) or set()
        assigned = [TopicPartition(Topic.EVENTS.value, p) for p in sorted(partitions)]
        consumer.assign(assigned)
        if assigned:
            await consumer.seek_to_beginning(*assigned)
            self._ends = dict(await consumer.end_offsets(assigned))
        self._consumer = consumer

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def __aenter__(self) -> EventFeed:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    @property
    def caught_up(self) -> bool:
        return all(self._next.get(tp, 0) >= end for tp, end in self._ends.items())

    async def poll(self, timeout_s: float = 0.5) -> list[Event]:
        """The events that arrived since the last poll (de-duplicated by event id)."""
        consumer = self._require()
        batches = await consumer.getmany(timeout_ms=int(timeout_s * 1000))
        events: list[Event] = []
        for tp, records in batches.items():
            for record in records:
                self._next[tp] = record.offset + 1
                try:
                    event = decode(Topic.EVENTS, record.value)
                except MessageDecodeError:
                    continue  # env_svc dead-letters those; a reader just skips them
                if not isinstance(event, Event) or event.event_id in self._seen:
                    continue
                if self.job_ids is None or event.job_id in self.job_ids:
                    self._seen.add(event.event_id)
                    events.append(event)
        events.sort(key=lambda e: e.at)
        return events

    async def read_to_end(self, *, timeout_s: float = 30.0) -> list[Event]:
        """Every event up to where the topic ended when the feed started."""
        deadline = time.monotonic() + timeout_s
        events: list[Event] = []
        while not self.caught_up:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {Topic.EVENTS.value} took over {timeout_s:.0f}s")
            events += await self.poll(0.2)
        events.sort(key=lambda e: e.at)
        return events

    def _require(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError("event feed not started")
        return self._consumer
