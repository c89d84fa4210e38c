"""A group member's commit bookkeeping: one `OffsetTracker` per owned partition, the commits
made from them, and what they tell of lag.

Commits go only as far as each partition's oldest unfinished or held record
(common/bus/offsets.py), so a record whose work is not durable yet is read again after a crash.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import TopicPartition

from common.bus.offsets import OffsetTracker
from common.runtime.backoff import is_transient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    end_offset: int
    committed: int | None

    @property
    def lag(self) -> int:
        return self.end_offset - (self.committed or 0)


class CommitBook:
    """The offset tracker of every partition this member owns, keyed by partition."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.trackers: dict[TopicPartition, OffsetTracker] = {}

    def track(self, assigned: Iterable[TopicPartition]) -> None:
        """Start tracking newly assigned partitions (a tracker already there is kept)."""
        for tp in assigned:
            self.trackers.setdefault(tp, OffsetTracker())

    def forget(self, revoked: Iterable[TopicPartition]) -> None:
        for tp in revoked:
            self.trackers.pop(tp, None)

    def owns(self, tp: TopicPartition, tracker: OffsetTracker) -> bool:
        """Whether `tracker` is still the one of `tp` (not revoked, nor assigned anew since)."""
        return self.trackers.get(tp) is tracker

    async def commit(self, consumer: AIOKafkaConsumer) -> None:
        """Commit every partition whose committable position moved."""
        # The trackers as they are now: a revocation during the commit takes them out of
        # `trackers`, and what this commit stored is still theirs to record.
        trackers = dict(self.trackers)
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

    async def lag(self, consumer: AIOKafkaConsumer) -> list[PartitionLag]:
        """End offset minus committed offset of each partition this member owns."""
        assigned = sorted(self.trackers, key=lambda tp: (tp.topic, tp.partition))
        if not assigned:
            return []
        ends = await consumer.end_offsets(assigned)
        return [
            PartitionLag(tp.topic, tp.partition, ends[tp], await consumer.committed(tp))
            for tp in assigned
        ]

    async def caught_up(self, consumer: AIOKafkaConsumer, tp: TopicPartition) -> bool:
        """Whether every record the broker has on `tp` was handled here (held ones included);
        False for a partition this member does not own."""
        if (tracker := self.trackers.get(tp)) is None:
            return False
        end = (await consumer.end_offsets([tp]))[tp]
        handled = tracker.next_unprocessed
        if handled is None:  # nothing handled since the assignment: from the last commit
            handled = await consumer.committed(tp) or 0
        return handled >= end
