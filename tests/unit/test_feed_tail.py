"""marlaas/eventfeed.py with `tail`: a read of a topic's last records only (the tenant API's
episode samples read a job's latest trajectories, not the whole topic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from common.wire.codec import encode
from common.wire.messages import Topic, Trajectory
from marlaas import eventfeed
from marlaas.eventfeed import TrajectoryFeed

TOPIC = Topic.TRAJECTORIES.value


@dataclass
class Record:
    topic: str
    offset: int
    value: bytes
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()


def episode(job_id: str, n: int) -> Trajectory:
    return Trajectory(
        episode_id=f"{job_id}/{n}/0",
        job_id=job_id,
        group_id=f"{job_id}/{n}",
        sample_index=0,
        group_size=1,
        token_ids=[1, 2],
        loss_mask=[0, 1],
        behaviour_logprobs=[0.0, -0.5],
        reward=1.0,
        finished_at=1000.0 + n,
    )


class Partitions:
    """A consumer over partitions that each hold records from `first` to `end` (retention
    dropped what came before `first`), serving from wherever it was sought."""

    def __init__(self, held: dict[int, tuple[int, list[Trajectory]]]) -> None:
        self.held = {TopicPartition(TOPIC, p): value for p, value in held.items()}
        self.position: dict[TopicPartition, int] = {}

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.held[tp][0] + len(self.held[tp][1]) for tp in partitions}

    async def beginning_offsets(
        self, partitions: list[TopicPartition]
    ) -> dict[TopicPartition, int]:
        return {tp: self.held[tp][0] for tp in partitions}

    def seek(self, partition: TopicPartition, offset: int) -> None:
        self.position[partition] = offset

    async def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        for tp in partitions:
            self.position[tp] = self.held[tp][0]

    async def getmany(self, timeout_ms: int = 0) -> dict[TopicPartition, list[Record]]:
        batches = {}
        for tp, at in self.position.items():
            first, messages = self.held[tp]
            if at < first + len(messages):
                batches[tp] = [
                    Record(TOPIC, offset, encode(messages[offset - first]))
                    for offset in range(at, first + len(messages))
                ]
                self.position[tp] = first + len(messages)
        return batches

    async def stop(self) -> None:
        pass


@pytest.fixture
def partitions(monkeypatch: pytest.MonkeyPatch) -> Partitions:
    """Partition 0: offsets 0-9 (jobs a and b); partition 1: 5-6 (job c, after retention);
    partition 2: empty, its records all past retention (offset 4)."""
    held = {
        0: (0, [episode("a" if n % 2 else "b", n) for n in range(10)]),
        1: (5, [episode("c", 5), episode("c", 6)]),
        2: (4, []),
    }
    consumer = Partitions(held)

    async def start_reader(*_: Any, **__: Any) -> tuple[Partitions, list[TopicPartition]]:
        return consumer, list(consumer.held)

    monkeypatch.setattr(eventfeed, "start_reader", start_reader)
    return consumer


async def test_a_tail_read_starts_that_many_records_before_each_partitions_end(
    partitions: Partitions,
) -> None:
    feed = TrajectoryFeed("kafka:9092", {"a", "b", "c"}, tail=3)
    async with feed:
        assert partitions.position == {
            TopicPartition(TOPIC, 0): 7,
            TopicPartition(TOPIC, 1): 5,  # no further back than what the partition holds
            TopicPartition(TOPIC, 2): 4,
        }
        found = [t.episode_id for batch in [b async for b in feed.batches_to_end()] for t in batch]
        assert feed.caught_up
    assert sorted(found) == ["a/7/0", "a/9/0", "b/8/0", "c/5/0", "c/6/0"]


async def test_a_tail_of_one_jobs_records_leaves_the_others_and_an_empty_window_ends_at_once(
    partitions: Partitions,
) -> None:
    async with TrajectoryFeed("kafka:9092", {"a"}, tail=4) as feed:
        found = await feed.read_to_end(timeout_s=5)
    assert [t.episode_id for t in found] == ["a/7/0", "a/9/0"]  # in the order they finished
    del partitions.held[TopicPartition(TOPIC, 0)], partitions.held[TopicPartition(TOPIC, 1)]
    partitions.position.clear()
    async with TrajectoryFeed("kafka:9092", {"a"}, tail=4) as feed:
        assert feed.caught_up  # nothing to wait for: its window is empty
        assert await feed.read_to_end(timeout_s=5) == []


async def test_a_read_without_a_tail_starts_at_the_beginning_and_waits_on_no_empty_partition(
    partitions: Partitions,
) -> None:
    async with TrajectoryFeed("kafka:9092", None) as feed:
        found = await feed.read_to_end(timeout_s=5)
    assert len(found) == 12 and found[0].episode_id == "b/0/0"
