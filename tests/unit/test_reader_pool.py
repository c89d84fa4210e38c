"""marlaas/eventfeed.py `ReaderPool`: one-shot reads share a bounded set of consumers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from marlaas import eventfeed
from marlaas.eventfeed import ReaderPool, ReadersBusy


class FakeConsumer:
    """Stands in for a started AIOKafkaConsumer in no group (topic "t", partitions 0-3)."""

    def __init__(self) -> None:
        self.assigned: list[TopicPartition] = []
        self.paused: set[TopicPartition] = set()
        self.stopped = False

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0, 1, 2, 3}

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned, self.paused = list(partitions), set()

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def pause(self, *partitions: TopicPartition) -> None:
        self.paused |= set(partitions)

    async def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[FakeConsumer]:
    """Every consumer the pool starts, in order."""
    made: list[FakeConsumer] = []

    async def start_reader(*_: Any, **__: Any) -> tuple[FakeConsumer, list[TopicPartition]]:
        made.append(FakeConsumer())
        return made[-1], []

    monkeypatch.setattr(eventfeed, "start_reader", start_reader)
    return made


async def test_reads_reuse_the_pools_consumers_and_wait_for_one_when_all_are_lent(
    started: list[FakeConsumer],
) -> None:
    pool = ReaderPool("kafka:9092", size=2, wait_s=0.1)
    for _ in range(20):  # one read after another: one consumer for all of them
        consumer, assigned = await pool.lend("t", None)
        assert assigned == [TopicPartition("t", p) for p in range(4)]
        await pool.give_back(consumer, usable=True)  # type: ignore[arg-type]
    assert len(started) == 1  # idle, its partitions paused: fetching nothing
    assert started[0].paused == set(started[0].assigned) != set()
    first, _ = await pool.lend("t", {"job-1"})
    _, second_assigned = await pool.lend("t", {"job-1"})
    assert len(second_assigned) == 1  # only the job's partition
    with pytest.raises(ReadersBusy, match="all 2 event readers are busy"):
        await pool.lend("t", None)
    waiting = asyncio.create_task(pool.lend("t", None))
    await asyncio.sleep(0.01)
    await pool.give_back(first, usable=True)  # type: ignore[arg-type]
    third, _ = await waiting
    assert third is first and len(started) == 2


async def test_a_consumer_whose_read_failed_is_closed_and_the_pool_closes_the_idle(
    started: list[FakeConsumer],
) -> None:
    pool = ReaderPool("kafka:9092", size=1, wait_s=0.1)
    broken, _ = await pool.lend("t", None)
    await pool.give_back(broken, usable=False)  # type: ignore[arg-type]
    assert started[0].stopped
    fresh, _ = await pool.lend("t", None)
    assert fresh is started[1]
    await pool.give_back(fresh, usable=True)  # type: ignore[arg-type]
    await pool.close()
    assert started[1].stopped


async def test_a_consumer_is_lent_again_to_its_own_topic_only_and_the_pool_stays_bounded(
    started: list[FakeConsumer],
) -> None:
    pool = ReaderPool("kafka:9092", size=2, wait_s=0.1)
    events, _ = await pool.lend("events", None)
    await pool.give_back(events, usable=True)  # type: ignore[arg-type]
    adapters, _ = await pool.lend("adapters", None)  # its metadata would not know "adapters"
    assert adapters is not events and not events.stopped  # room for both
    await pool.give_back(adapters, usable=True)  # type: ignore[arg-type]
    assert (await pool.lend("events", None))[0] is events
    third, _ = await pool.lend("jobs", None)  # two started already: the idle one makes room
    assert adapters.stopped and third is started[2] and len(started) == 3
