"""One consumed record's handling: signature check, decode, the service's handler, and where a
failure goes.

A record that is unsigned or wrongly signed, that does not decode, or whose handler fails for
good becomes a `DeadLetter` on `marlaas.dlq` and counts as handled; a transient failure
(common/runtime/backoff.py) retries the record in place after a growing, jittered back-off.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic

from aiokafka import ConsumerRecord
from aiokafka.structs import TopicPartition

from common.bus.delivery import Delivery, Handler, M, Undecodable
from common.bus.offsets import OffsetTracker
from common.bus.telemetry import ConsumerTelemetry
from common.runtime.backoff import Backoff, RetryableError, is_transient
from common.security.signing import RecordSigner
from common.wire.codec import dead_letter, decode
from common.wire.messages import MessageDecodeError, Topic

if TYPE_CHECKING:
    from common.bus.sender import Sender

log = logging.getLogger(__name__)


class RecordHandler(Generic[M]):
    """Hands each record's message to `handler`, retrying transient failures after a back-off
    from `retry_delays` (first, most) and dead-lettering the rest through `dead_letters`."""

    def __init__(
        self,
        *,
        service: str,
        handler: Handler[M],
        dead_letters: Sender,
        telemetry: ConsumerTelemetry,
        transient: Callable[[BaseException], bool],
        retry_delays: tuple[float, float],
        signing: RecordSigner | None,
        on_undecodable: Undecodable | None,
    ) -> None:
        self.service = service
        self.signing = signing
        """Checks every record's signature (common/security/signing.py); None: none is checked."""
        self._handler = handler
        self._dead_letters = dead_letters
        self._telemetry = telemetry
        self._transient = transient
        self._retry_delays = retry_delays
        self._on_undecodable = on_undecodable
        self.processed_count = 0
        self.dead_letter_count = 0

    async def handle(
        self,
        tp: TopicPartition,
        record: ConsumerRecord,
        tracker: OffsetTracker,
        owned: Callable[[], bool],
    ) -> None:
        """Handle one record; a transient failure retries it in place after a back-off
        (growing while this record fails in a row: records handled at once fail together,
        not one after another) until it succeeds or the partition is no longer `owned` (its
        next owner reads it from the last commit)."""
        backoff = Backoff(*self._retry_delays)
        while True:
            try:
                await self.handle_record(record, tracker)
                break
            except Exception as exc:
                if not self._transient(exc):
                    raise
                if not owned():
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
        self._telemetry.handled(tp.topic)

    async def handle_record(self, record: ConsumerRecord, tracker: OffsetTracker) -> None:
        """One try at `record`: what fails for good is dead-lettered here; a transient failure
        of the handler is raised."""
        metrics = self._telemetry.metrics_for(record.topic)
        if untrusted := self._untrusted(record):
            metrics.failed.inc()
            log.warning(
                "%s: %s[%d]@%d dropped: %s",
                self.service,
                record.topic,
                record.partition,
                record.offset,
                untrusted,
            )
            await self.dead_letter(record, untrusted)
            return
        try:
            message = decode(record.topic, record.value)
        except MessageDecodeError as exc:
            metrics.failed.inc()
            if self._on_undecodable is not None:
                await self._on_undecodable(record.topic, record.value, exc)
            await self.dead_letter(record, str(exc))
            return
        delivery = Delivery(
            record.topic, record.partition, record.offset, record.key, record.timestamp, tracker
        )
        if error := await self._call_handler(message, delivery):
            await self.dead_letter(record, error)
            return
        metrics.processed.inc()

    def _untrusted(self, record: ConsumerRecord) -> str | None:
        """Why the record's signature is not accepted; None when it is (or none is checked)."""
        if self.signing is None:
            return None
        return self.signing.problem(record.topic, record.key, record.value, record.headers)

    async def _call_handler(self, message: object, delivery: Delivery) -> str | None:
        """Run the handler, timed; a failure that is not transient comes back as its one-line
        description (to dead-letter), a transient one is raised."""
        metrics = self._telemetry.metrics_for(delivery.topic)
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
                delivery.topic,
                delivery.partition,
                delivery.offset,
            )
            return "".join(traceback.format_exception_only(exc)).strip()
        return None

    async def dead_letter(self, record: ConsumerRecord, error: str) -> None:
        """Send `record` to `marlaas.dlq` with `error`; a broker briefly away is raised as
        retryable, a refusal for good is logged and the record skipped."""
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
        self._telemetry.metrics_for(record.topic).dead_letters.inc()
        log.error(
            "%s: %s[%d]@%d -> %s: %s",
            self.service,
            record.topic,
            record.partition,
            record.offset,
            Topic.DLQ.value,
            error,
        )
