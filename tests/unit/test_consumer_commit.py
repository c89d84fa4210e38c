"""ConsumerLoop.commit against a consumer whose partitions are revoked while it commits."""

from __future__ import annotations

from typing import Any

from aiokafka.structs import TopicPartition

from common.bus.kafka import ConsumerLoop
from common.bus.offsets import OffsetTracker
from tests.fakes import MemoryBus


class RevokedWhileCommitting:
    """Stands in for AIOKafkaConsumer.commit: the group rebalances during the request, and
    the revocation callback drops the partition's tracker before the commit returns."""

    def __init__(self, loop: ConsumerLoop[Any], tp: TopicPartition) -> None:
        self.loop, self.tp = loop, tp
        self.committed: list[dict[TopicPartition, int]] = []

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.committed.append(dict(offsets))
        self.loop._commits.trackers.pop(self.tp)


async def test_a_partition_revoked_during_a_commit_does_not_crash_the_loop() -> None:
    async def handler(message: Any, delivery: Any) -> None:
        return None

    loop: ConsumerLoop[Any] = ConsumerLoop(
        bootstrap="unused:9092",
        group_id="g",
        topics=["marlaas.events"],
        handler=handler,
        dead_letters=MemoryBus(),
        service="test",
    )
    kept, revoked = TopicPartition("marlaas.events", 0), TopicPartition("marlaas.events", 1)
    for tp in (kept, revoked):
        loop._commits.trackers[tp] = OffsetTracker()
        loop._commits.trackers[tp].processed(0)
    consumer = RevokedWhileCommitting(loop, revoked)
    loop._consumer = consumer  # type: ignore[assignment]
    await loop.commit()
    assert consumer.committed == [{kept: 1, revoked: 1}]
    assert loop._commits.trackers[kept].due() is None  # recorded as committed: not sent again
    await loop.commit()
    assert len(consumer.committed) == 1
