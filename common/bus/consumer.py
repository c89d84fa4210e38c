"""The consumer loop: a consumer-group member that polls, hands records to a handler (several
at once, in order per key), commits what is done and follows the group's rebalances.

Its parts: the handling of one record (common/bus/records.py), the commit positions of the
partitions it owns (common/bus/commits.py), records in flight (common/bus/dispatch.py) and its
metrics and activity line (common/bus/telemetry.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, Generic

from aiokafka import AIOKafkaConsumer, ConsumerRecord
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from common.bus.clients import start_group_consumer
from common.bus.commits import CommitBook, PartitionLag
from common.bus.delivery import Handler, M, PartitionsCallback, Undecodable
from common.bus.dispatch import Dispatcher
from common.bus.records import RecordHandler
from common.bus.telemetry import ConsumerTelemetry
from common.runtime.backoff import is_transient
from common.runtime.metrics import CONSUMER_IN_FLIGHT
from common.security.signing import RecordSigner

if TYPE_CHECKING:
    from common.bus.sender import Sender

log = logging.getLogger(__name__)


class ConsumerLoop(Generic[M]):
    """Consume topics in a consumer group and hand each decoded message to `handler`.

    Up to `max_in_flight` records are handled at once (common/bus/dispatch.py), those of one
    partition with the same key one after the other in offset order; 1 handles every record
    before the next, as a handler that applies back-pressure by waiting needs. Commits each
    partition below its oldest unfinished (or held) record after every batch and before
    partitions are revoked. Undecodable records and handler failures that are not
    `transient` become `DeadLetter`s; a transient failure retries the record in place after
    a back-off from `retry_backoff_s`, doubling per failure of that record in a
    row up to `max_retry_backoff_s`. A member silent for `session_timeout_s` (crashed,
    stopped) loses its partitions to the others; heartbeats go every third of it. Every
    record moves the `marlaas_*` consumer metrics of `service` (common/runtime/metrics.py); while
    `run()` runs, the lag gauges are refreshed every `lag_interval_s`, and every
    `activity_interval_s` one log line says how many records of each topic this replica
    handled (so a log shows each replica's share of the work).
    """

    def __init__(
        self,
        *,
        bootstrap: str,
        group_id: str,
        topics: Iterable[str],
        handler: Handler[M],
        dead_letters: Sender,
        service: str,
        transient: Callable[[BaseException], bool] = is_transient,
        max_records: int = 100,
        poll_timeout_ms: int = 200,
        retry_backoff_s: float = 0.5,
        max_retry_backoff_s: float = 10.0,
        lag_interval_s: float = 5.0,
        activity_interval_s: float = 60.0,
        on_assigned: PartitionsCallback | None = None,
        on_revoked: PartitionsCallback | None = None,
        sticky: bool = False,
        session_timeout_s: float = 10.0,
        on_undecodable: Undecodable | None = None,
        signing: RecordSigner | None = None,
        max_in_flight: int = 1,
        drain_timeout_s: float = 10.0,
    ) -> None:
        self.bootstrap = bootstrap
        self.session_timeout_s = session_timeout_s
        self.group_id = group_id
        self.topics = list(topics)
        self.service = service
        self._max_records = max_records
        self._sticky = sticky
        self._dispatch = Dispatcher(max_in_flight, name=f"{service}-record")
        self._drain_timeout_s = drain_timeout_s
        CONSUMER_IN_FLIGHT.labels(service).set_function(lambda: self._dispatch.in_flight)
        self._poll_timeout_ms = poll_timeout_ms
        self._telemetry = ConsumerTelemetry(
            service,
            self.topics,
            lag_interval_s=lag_interval_s,
            activity_interval_s=activity_interval_s,
        )
        self._records = RecordHandler(
            service=service,
            handler=handler,
            dead_letters=dead_letters,
            telemetry=self._telemetry,
            transient=transient,
            retry_delays=(retry_backoff_s, max(retry_backoff_s, max_retry_backoff_s)),
            signing=signing,
            on_undecodable=on_undecodable,
        )
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._commits = CommitBook(service)
        self._consumer: AIOKafkaConsumer | None = None
        self._stopping = asyncio.Event()
        self._paused = False

    @property
    def assignment(self) -> set[TopicPartition]:
        return set(self._commits.trackers)

    @property
    def in_flight(self) -> int:
        """Records being handled now."""
        return self._dispatch.in_flight

    @property
    def in_flight_peak(self) -> int:
        """The most records handled at once since the start."""
        return self._dispatch.peak

    @property
    def processed_count(self) -> int:
        """Records handled (dead-lettered ones included) since the start."""
        return self._records.processed_count

    @property
    def dead_letter_count(self) -> int:
        """Records sent to `marlaas.dlq` since the start."""
        return self._records.dead_letter_count

    async def start(self, *, timeout_s: float = 60.0) -> None:
        self._consumer = await start_group_consumer(
            self.bootstrap,
            group_id=self.group_id,
            client_id=f"{self.service}-{self.group_id}",
            max_records=self._max_records,
            sticky=self._sticky,
            session_timeout_s=self.session_timeout_s,
            timeout_s=timeout_s,
        )
        self._consumer.subscribe(self.topics, listener=_Rebalance(self))

    async def run(self) -> None:
        """Poll, handle (up to `max_in_flight` records at once) and commit until `stop()` is
        called; then wait up to `drain_timeout_s` for the records in hand."""
        consumer = self._require_consumer()
        lag_export = asyncio.create_task(
            self._telemetry.export_lag(self.lag), name=f"{self.service}-lag"
        )
        try:
            while not self._stopping.is_set():
                batches = await consumer.getmany(
                    timeout_ms=self._poll_timeout_ms, max_records=self._max_records
                )
                for tp, records in batches.items():
                    await self._dispatch_partition(tp, records)
                self._dispatch.raise_failure()
                await self.commit()
        finally:
            if left := await self._dispatch.drain(self._drain_timeout_s):
                log.warning("%s: %d records unfinished at the stop", self.service, left)
            lag_export.cancel()
            await asyncio.gather(lag_export, return_exceptions=True)

    def stop(self) -> None:
        """Ask `run()` to return after the batch in hand."""
        self._stopping.set()

    async def close(self) -> None:
        """Commit what is done and leave the group (partitions go to other members)."""
        if self._consumer is None:
            return
        try:
            await self.commit()
        finally:
            await self._consumer.stop()
            self._consumer = None

    def pause(self) -> None:
        """Stop fetching (back-pressure) without leaving the group."""
        consumer = self._require_consumer()
        consumer.pause(*consumer.assignment())
        self._paused = True

    def resume(self) -> None:
        consumer = self._require_consumer()
        consumer.resume(*consumer.assignment())
        self._paused = False

    async def commit(self) -> None:
        """Commit every partition whose committable position moved."""
        await self._commits.commit(self._require_consumer())

    async def lag(self) -> list[PartitionLag]:
        """End offset minus committed offset of each partition this member owns."""
        return await self._commits.lag(self._require_consumer())

    async def caught_up(self, topic: str, partition: int) -> bool:
        """Whether this member has handled every record the broker has on the partition
        (held ones included). Only then is a record not seen yet missing, rather than unread
        in a backlog (a replica that took the partition over replays it from the last
        commit). False for a partition this member does not own."""
        consumer = self._require_consumer()
        return await self._commits.caught_up(consumer, TopicPartition(topic, partition))

    async def reachable(self, timeout_s: float = 2.0) -> bool:
        """Whether the consumer is started and the broker answers a metadata request in time."""
        if self._consumer is None:
            return False
        try:
            await asyncio.wait_for(self._consumer.topics(), timeout_s)
        except (KafkaError, OSError, TimeoutError):
            return False
        return True

    def _require_consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError("consumer not started")
        return self._consumer

    async def _dispatch_partition(self, tp: TopicPartition, records: list[ConsumerRecord]) -> None:
        """Start each record's handling as room allows (common/bus/dispatch.py); records with
        the same key run in offset order. Returns early when the loop is asked to stop: the
        records not started stay uncommitted (they all follow the started ones)."""
        tracker = self._commits.trackers.get(tp)
        if tracker is None:  # revoked while the batch was in flight
            return
        owned = partial(self._commits.owns, tp, tracker)
        for record in records:
            while not await self._dispatch.room(self._poll_timeout_ms / 1000):
                if self._stopping.is_set():
                    return
            if not owned():  # revoked meanwhile
                return
            tracker.started(record.offset)
            self._dispatch.submit(
                tp, record.key, partial(self._records.handle, tp, record, tracker, owned)
            )


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """What the loop does when the group moves partitions: it finishes and commits the records
    of revoked partitions within a grace, and tracks assigned ones (paused if it is)."""

    def __init__(self, loop: ConsumerLoop[Any]) -> None:
        self._loop = loop

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        # The records in hand get a grace to finish, so that their commits go to the next
        # owner. Those still running go on uncommitted (the next owner reads them again, as
        # it did when one record was in hand): cancelling a handler midway (a trainer taking
        # a job on) could leave its state half made; a transient retry stops by itself.
        loop, revoked = self._loop, set(revoked)
        grace_s = min(loop._drain_timeout_s, loop.session_timeout_s / 2)
        if left := await loop._dispatch.drain(grace_s, revoked, cancel=False):
            log.warning("%s: %d records still in hand at a revocation", loop.service, left)
        if loop._consumer is not None:
            await loop.commit()
        loop._commits.forget(revoked)
        log.info("%s: partitions revoked: %s", loop.service, _describe(revoked))
        if loop._on_revoked is not None:
            await loop._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        loop, assigned = self._loop, set(assigned)
        loop._commits.track(assigned)
        if loop._paused and loop._consumer is not None:
            loop._consumer.pause(*assigned)
        log.info("%s: partitions assigned: %s", loop.service, _describe(assigned))
        if loop._on_assigned is not None:
            await loop._on_assigned(assigned)


def _describe(partitions: Iterable[TopicPartition]) -> str:
    by_topic: dict[str, list[int]] = {}
    for tp in partitions:
        by_topic.setdefault(tp.topic, []).append(tp.partition)
    return "; ".join(f"{t}{sorted(p)}" for t, p in sorted(by_topic.items())) or "none"
