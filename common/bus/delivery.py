"""What a consumer's handler is given with each message, and the callbacks a consumer takes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from aiokafka.structs import TopicPartition

from common.bus.offsets import OffsetTracker
from common.wire.messages import Message, MessageDecodeError

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
