"""The Kafka bus: client start-up, producer, at-least-once consumer loop, dead letters, lag.

Topic creation and outside lag reads are the operator's (console/stack/topics.py); fan-out reading
is common/bus/broadcast.py. Delivery contract (docs/architecture.md, "Delivery guarantees"):
offsets are committed only after the handler succeeded (or explicitly after held work became
durable); a record that cannot be decoded, or whose handler fails for good, goes to
`marlaas.dlq` and the loop goes on; a transient failure (common/runtime/backoff.py: Redis or the
broker briefly away, whichever client raised it) re-reads the same record after a growing,
jittered back-off. No Kafka transactions and no idempotent producer: the embedded broker lacks
InitProducerId, so consumers de-duplicate by message id instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor
from aiokafka.errors import CommitFailedError, KafkaConnectionError, KafkaError
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import TopicPartition

from common.bus.dispatch import Dispatcher
from common.bus.offsets import OffsetTracker
from common.runtime.backoff import Backoff, RetryableError, connect_with_backoff, is_transient
from common.runtime.config import kafka_client_options
from common.runtime.metrics import CONSUMER_IN_FLIGHT, ConsumerMetrics, consumer_metrics
from common.security.signing import RecordSigner
from common.wire.codec import (
    MAX_RECORD_BYTES,
    WireSchema,
    dead_letter,
    decode,
    encode,
    fits_record,
    key_bytes,
    topic_of,
)
from common.wire.messages import Message, MessageDecodeError, Topic

if TYPE_CHECKING:
    from common.bus.sender import Sender

log = logging.getLogger(__name__)

_CONNECT_ERRORS = (KafkaConnectionError, OSError, asyncio.TimeoutError)


# --- clients ------------------------------------------------------------------------


C = TypeVar("C", AIOKafkaProducer, AIOKafkaConsumer, AIOKafkaAdminClient)
_PARTITIONER = DefaultPartitioner()
"""The partition of a keyed record, as every `Producer` here (aiokafka's default) picks it."""


async def start_client(make: Callable[[], C], bootstrap: str, timeout_s: float) -> C:
    """A started client, retried with back-off; a client whose start failed is closed."""

    async def attempt() -> C:
        client = make()
        try:
            await client.start()
        except BaseException:
            await (client.close() if isinstance(client, AIOKafkaAdminClient) else client.stop())
            raise
        return client

    return await connect_with_backoff(
        "Kafka", bootstrap, attempt, timeout_s=timeout_s, retry_on=_CONNECT_ERRORS
    )


def partition_of(key: str, partitions: Sequence[int]) -> int:
    """The partition, of `partitions`, a record keyed `key` goes to: the producers' default
    partitioner (murmur2, as Kafka's Java clients), which every MARLaaS producer uses."""
    every = list(partitions)
    return int(_PARTITIONER(key.encode(), every, every))


async def start_reader(
    bootstrap: str,
    topic: str,
    *,
    client_id: str,
    start_at: str,
    timeout_s: float,
    keys: Collection[str] | None = None,
) -> tuple[AIOKafkaConsumer, list[TopicPartition]]:
    """A started consumer in no group, assigned every partition of `topic` (with `keys`: only
    those that records with these keys go to, by the producers' partitioner): it reads from
    `start_at` (`earliest` or `latest`) and never commits. Also its partitions."""
    consumer = await start_client(
        lambda: AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            enable_auto_commit=False,
            auto_offset_reset=start_at,
            **kafka_client_options(),
        ),
        bootstrap,
        timeout_s,
    )
    return consumer, await assign_topic(consumer, topic, keys)


async def assign_topic(
    consumer: AIOKafkaConsumer, topic: str, keys: Collection[str] | None = None
) -> list[TopicPartition]:
    """Assign `consumer` (in no group) every partition of `topic`, or with `keys` only those
    that records with these keys go to (the producers' partitioner); returns them."""
    partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        await consumer.topics()  # refresh metadata once
        partitions = consumer.partitions_for_topic(topic) or set()
    every = sorted(partitions)
    if keys is not None and every:
        every = sorted({partition_of(key, every) for key in keys})
    assigned = [TopicPartition(topic, p) for p in every]
    consumer.assign(assigned)
    return assigned


# --- producing ----------------------------------------------------------------------


class Producer:
    """Sends messages to the topic their type belongs to, keyed as the contract says."""

    def __init__(
        self,
        bootstrap: str,
        *,
        client_id: str,
        wire_schema: WireSchema = 2,
        signing: RecordSigner | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.client_id = client_id
        self.signing = signing
        """Signs every record (common/security/signing.py); None: records go unsigned."""
        self.wire_schema: WireSchema = wire_schema
        """The layout messages are written in (common/wire/messages.py)."""
        self._producer: AIOKafkaProducer | None = None

    async def start(self, *, timeout_s: float = 60.0) -> None:
        self._producer = await start_client(
            lambda: AIOKafkaProducer(
                bootstrap_servers=self.bootstrap,
                client_id=self.client_id,
                acks="all",
                enable_idempotence=False,
                linger_ms=5,
                max_request_size=MAX_RECORD_BYTES,
                **kafka_client_options(),
            ),
            self.bootstrap,
            timeout_s,
        )

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def send(self, message: Message) -> None:
        """Send and wait for the broker's acknowledgement from all in-sync replicas."""
        await self.send_raw(
            topic_of(message), encode(message, self.wire_schema), key_bytes(message)
        )

    async def send_raw(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        if self._producer is None:
            raise RuntimeError("producer not started")
        fits_record(topic, value)
        headers = self.signing.headers(topic, key, value) if self.signing else None
        await self._producer.send_and_wait(topic, value, key=key, headers=headers)


# --- consuming ----------------------------------------------------------------------


M = TypeVar("M", bound=Message)


@dataclass
class Delivery:
    """Where a handed-over message came from, and a way to hold its commit."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int
    _tracker: OffsetTracker = field(repr=False)

    def hold_commit(self) -> Callable[[], None]:
        """Keep this record uncommitted until the returned release function is called.

        For work that is accepted now but made durable later: a crash before the
        release redelivers the record (at-least-once).
        """
        self._tracker.hold(self.offset)
        return lambda: self._tracker.release(self.offset)


Handler = Callable[[M, Delivery], Awaitable[None]]
Undecodable = Callable[[str, bytes | None, MessageDecodeError], Awaitable[None]]
"""Told of a record that does not decode (topic, raw value, why) before it is dead-lettered."""
PartitionsCallback = Callable[[set[TopicPartition]], Awaitable[None]]


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    end_offset: int
    committed: int | None

    @property
    def lag(self) -> int:
        return self.end_offset - (self.committed or 0)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, loop: ConsumerLoop[Any]) -> None:
        self._loop = loop

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._loop._partitions_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._loop._partitions_assigned(set(assigned))


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
        self.signing = signing
        """Checks every record's signature (common/security/signing.py); None: none is checked."""
        self.session_timeout_s = session_timeout_s
        self._on_undecodable = on_undecodable
        self.group_id = group_id
        self.topics = list(topics)
        self.service = service
        self._handler = handler
        self._dead_letters = dead_letters
        self._transient = transient
        self._max_records = max_records
        self._dispatch = Dispatcher(max_in_flight, name=f"{service}-record")
        self._drain_timeout_s = drain_timeout_s
        CONSUMER_IN_FLIGHT.labels(service).set_function(lambda: self._dispatch.in_flight)
        self._poll_timeout_ms = poll_timeout_ms
        self._retry_delays = (retry_backoff_s, max(retry_backoff_s, max_retry_backoff_s))
        self._lag_interval_s = lag_interval_s
        self._activity_interval_s = activity_interval_s
        self._handled: Counter[str] = Counter()
        self._activity_since = time.monotonic()
        self._metrics = {str(topic): consumer_metrics(service, str(topic)) for topic in self.topics}
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        # Sticky: a rebalance moves as few partitions as it can (a trainer's partitions carry
        # its jobs' adapters and optimizers, expensive to hand over).
        self._assignors = (StickyPartitionAssignor,) if sticky else (RoundRobinPartitionAssignor,)
        self._trackers: dict[TopicPartition, OffsetTracker] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._stopping = asyncio.Event()
        self._paused = False
        self.processed_count = 0
        self.dead_letter_count = 0

    @property
    def assignment(self) -> set[TopicPartition]:
        return set(self._trackers)

    @property
    def in_flight(self) -> int:
        """Records being handled now."""
        return self._dispatch.in_flight

    @property
    def in_flight_peak(self) -> int:
        """The most records handled at once since the start."""
        return self._dispatch.peak

    async def start(self, *, timeout_s: float = 60.0) -> None:
        self._consumer = await start_client(
            lambda: AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap,
                group_id=self.group_id,
                client_id=f"{self.service}-{self.group_id}",
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                max_poll_records=self._max_records,
                partition_assignment_strategy=self._assignors,
                session_timeout_ms=int(self.session_timeout_s * 1000),
                heartbeat_interval_ms=int(self.session_timeout_s * 1000 / 3),
                **kafka_client_options(),
            ),
            self.bootstrap,
            timeout_s,
        )
        self._consumer.subscribe(self.topics, listener=_Rebalance(self))

    async def run(self) -> None:
        """Poll, handle (up to `max_in_flight` records at once) and commit until `stop()` is
        called; then wait up to `drain_timeout_s` for the records in hand."""
        consumer = self._require_consumer()
        lag_export = asyncio.create_task(self._export_lag(), name=f"{self.service}-lag")
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
        consumer = self._require_consumer()
        # The trackers as they are now: a revocation during the commit takes them out of
        # `_trackers`, and what this commit stored is still theirs to record.
        trackers = dict(self._trackers)
        due = {tp: tracker.due() for tp, tracker in trackers.items()}
        offsets = {tp: offset for tp, offset in due.items() if offset is not None}
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except CommitFailedError as exc:
            # The group rebalanced under us; the new owner re-reads from the last commit.
            log.warning("commit of %s failed (%s); records will be redelivered", offsets, exc)
            return
        except KafkaError as exc:
            if not is_transient(exc):
                raise
            # The coordinator is away: the positions stay due and go with the next commit.
            log.warning("%s: commit failed (%r); retried after the next batch", self.service, exc)
            return
        for tp, offset in offsets.items():
            trackers[tp].committed(offset)

    async def lag(self) -> list[PartitionLag]:
        """End offset minus committed offset of each partition this member owns."""
        consumer = self._require_consumer()
        assigned = sorted(self._trackers, key=lambda tp: (tp.topic, tp.partition))
        if not assigned:
            return []
        ends = await consumer.end_offsets(assigned)
        return [
            PartitionLag(tp.topic, tp.partition, ends[tp], await consumer.committed(tp))
            for tp in assigned
        ]

    async def caught_up(self, topic: str, partition: int) -> bool:
        """Whether this member has handled every record the broker has on the partition
        (held ones included). Only then is a record not seen yet missing, rather than unread
        in a backlog (a replica that took the partition over replays it from the last
        commit). False for a partition this member does not own."""
        consumer = self._require_consumer()
        tp = TopicPartition(topic, partition)
        if (tracker := self._trackers.get(tp)) is None:
            return False
        end = (await consumer.end_offsets([tp]))[tp]
        handled = tracker.next_unprocessed
        if handled is None:  # nothing handled since the assignment: from the last commit
            handled = await consumer.committed(tp) or 0
        return handled >= end

    async def reachable(self, timeout_s: float = 2.0) -> bool:
        """Whether the consumer is started and the broker answers a metadata request in time."""
        if self._consumer is None:
            return False
        try:
            await asyncio.wait_for(self._consumer.topics(), timeout_s)
        except (KafkaError, OSError, TimeoutError):
            return False
        return True

    # --- internals ------------------------------------------------------------------

    def _metrics_for(self, topic: str) -> ConsumerMetrics:
        if (metrics := self._metrics.get(topic)) is None:
            metrics = self._metrics[topic] = consumer_metrics(self.service, topic)
        return metrics

    async def _export_lag(self) -> None:
        """Set the lag gauge of every consumed topic now and every `lag_interval_s`.

        Telemetry only: a failed refresh keeps the last values and is retried; the poll
        loop itself reports an unreachable broker.
        """
        while True:
            try:
                partitions = await asyncio.wait_for(self.lag(), self._lag_interval_s)
            except Exception as exc:
                log.debug("%s: consumer lag not refreshed: %r", self.service, exc)
            else:
                # A topic this replica owns no partition of (any more) reads 0.
                lag_by_topic = dict.fromkeys(self._metrics, 0)
                for partition in partitions:
                    lag_by_topic[partition.topic] = (
                        lag_by_topic.get(partition.topic, 0) + partition.lag
                    )
                for topic, lag in lag_by_topic.items():
                    self._metrics_for(topic).lag.set(lag)
            self.log_activity()
            await asyncio.sleep(self._lag_interval_s)

    def log_activity(self, now: float | None = None) -> None:
        """Log what was handled since the last line, once `activity_interval_s` has passed
        (nothing when idle)."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._activity_since
        if elapsed < self._activity_interval_s:
            return
        if self._handled:
            counts = ", ".join(f"{n} {topic}" for topic, n in sorted(self._handled.items()))
            log.info("%s: handled %s in the last %.0f s", self.service, counts, elapsed)
        self._handled.clear()
        self._activity_since = now

    def _require_consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError("consumer not started")
        return self._consumer

    async def _dispatch_partition(self, tp: TopicPartition, records: list[ConsumerRecord]) -> None:
        """Start each record's handling as room allows (common/bus/dispatch.py); records with
        the same key run in offset order. Returns early when the loop is asked to stop: the
        records not started stay uncommitted (they all follow the started ones)."""
        tracker = self._trackers.get(tp)
        if tracker is None:  # revoked while the batch was in flight
            return
        for record in records:
            while not await self._dispatch.room(self._poll_timeout_ms / 1000):
                if self._stopping.is_set():
                    return
            if self._trackers.get(tp) is not tracker:  # revoked meanwhile
                return
            tracker.started(record.offset)
            self._dispatch.submit(tp, record.key, partial(self._handle, tp, record, tracker))

    async def _handle(
        self, tp: TopicPartition, record: ConsumerRecord, tracker: OffsetTracker
    ) -> None:
        """Handle one record; a transient failure retries it in place after a back-off
        (growing while this record fails in a row: records handled at once fail together,
        not one after another) until it succeeds or the partition is revoked (its next owner
        reads it from the last commit)."""
        backoff = Backoff(*self._retry_delays)
        while True:
            try:
                await self._handle_record(record, tracker)
                break
            except Exception as exc:
                if not self._transient(exc):
                    raise
                if self._trackers.get(tp) is not tracker:
                    return
                delay = backoff.next_delay()
                log.warning(
                    "%s: transient failure on %s[%d]@%d (%r); retry %d in %.1fs",
                    self.service,
                    tp.topic,
                    tp.partition,
                    record.offset,
                    exc,
                    backoff.failures,
                    delay,
                )
                await asyncio.sleep(delay)
        tracker.finished(record.offset)
        self.processed_count += 1
        self._handled[tp.topic] += 1

    async def _handle_record(self, record: ConsumerRecord, tracker: OffsetTracker) -> None:
        metrics = self._metrics_for(record.topic)
        if self.signing is not None and (
            untrusted := self.signing.problem(
                record.topic, record.key, record.value, record.headers
            )
        ):
            metrics.failed.inc()
            log.warning(
                "%s: %s[%d]@%d dropped: %s",
                self.service,
                record.topic,
                record.partition,
                record.offset,
                untrusted,
            )
            await self._dead_letter(record, untrusted)
            return
        try:
            message = decode(record.topic, record.value)
        except MessageDecodeError as exc:
            metrics.failed.inc()
            if self._on_undecodable is not None:
                await self._on_undecodable(record.topic, record.value, exc)
            await self._dead_letter(record, str(exc))
            return
        delivery = Delivery(
            record.topic, record.partition, record.offset, record.key, record.timestamp, tracker
        )
        started = time.perf_counter()
        try:
            try:
                await self._handler(message, delivery)  # type: ignore[arg-type]
            finally:
                metrics.handler_seconds.observe(time.perf_counter() - started)
        except Exception as exc:
            metrics.failed.inc()
            if self._transient(exc):
                raise
            log.exception(
                "%s: handler failed on %s[%d]@%d; dead-lettering",
                self.service,
                record.topic,
                record.partition,
                record.offset,
            )
            detail = "".join(traceback.format_exception_only(exc)).strip()
            await self._dead_letter(record, detail)
            return
        metrics.processed.inc()

    async def _dead_letter(self, record: ConsumerRecord, error: str) -> None:
        letter = dead_letter(
            source_topic=record.topic,
            source_partition=record.partition,
            source_offset=record.offset,
            source_key=record.key,
            raw_value=record.value or b"",
            error=error,
            service=self.service,
        )
        try:
            await self._dead_letters.send(letter)
        except Exception as exc:
            if is_transient(exc):
                raise RetryableError(f"cannot write dead letter: {exc}") from exc
            # Never retried forever: that would stop the partition. The record stays in its
            # topic at this offset, and this line says where.
            log.error(
                "%s: %s[%d]@%d failed (%s) and its dead letter was refused (%r); skipped",
                self.service,
                record.topic,
                record.partition,
                record.offset,
                error,
                exc,
            )
            return
        self.dead_letter_count += 1
        self._metrics_for(record.topic).dead_letters.inc()
        log.error(
            "%s: %s[%d]@%d -> %s: %s",
            self.service,
            record.topic,
            record.partition,
            record.offset,
            Topic.DLQ.value,
            error,
        )

    async def _partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        # The records in hand get a grace to finish, so that their commits go to the next
        # owner. Those still running go on uncommitted (the next owner reads them again, as
        # it did when one record was in hand): cancelling a handler midway (a trainer taking
        # a job on) could leave its state half made; a transient retry stops by itself.
        grace_s = min(self._drain_timeout_s, self.session_timeout_s / 2)
        if left := await self._dispatch.drain(grace_s, revoked, cancel=False):
            log.warning("%s: %d records still in hand at a revocation", self.service, left)
        if self._consumer is not None:
            await self.commit()
        for tp in revoked:
            self._trackers.pop(tp, None)
        log.info("%s: partitions revoked: %s", self.service, _describe(revoked))
        if self._on_revoked is not None:
            await self._on_revoked(revoked)

    async def _partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        for tp in assigned:
            self._trackers.setdefault(tp, OffsetTracker())
        if self._paused and self._consumer is not None:
            self._consumer.pause(*assigned)
        log.info("%s: partitions assigned: %s", self.service, _describe(assigned))
        if self._on_assigned is not None:
            await self._on_assigned(assigned)


def _describe(partitions: Iterable[TopicPartition]) -> str:
    by_topic: dict[str, list[int]] = {}
    for tp in partitions:
        by_topic.setdefault(tp.topic, []).append(tp.partition)
    return "; ".join(f"{t}{sorted(p)}" for t, p in sorted(by_topic.items())) or "none"
