"""Records handled at once (common/bus/dispatch.py, ConsumerLoop): a bound, order per key, and
commits that never pass an unfinished record. The same loop runs on the real broker in
tests/integration/test_bus.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord, TopicPartition

from common.bus.dispatch import Dispatcher
from common.bus.kafka import ConsumerLoop, Delivery
from common.bus.offsets import OffsetTracker
from common.runtime.backoff import RetryableError
from common.wire.codec import encode
from common.wire.messages import Event, Topic, new_id
from tests.fakes import MemoryBus

TP = TopicPartition(Topic.EVENTS.value, 0)


def record(offset: int, key: str, step: int | None = None) -> ConsumerRecord[bytes, bytes]:
    message = Event(
        event_id=new_id(), job_id=key, event="step", service="test", step=step or offset
    )
    value = encode(message)
    return ConsumerRecord(
        TP.topic, TP.partition, offset, int(time.time() * 1000), 0, key.encode(), value, None,
        len(key), len(value), (),
    )  # fmt: skip


class ScriptedConsumer:
    """Stands in for AIOKafkaConsumer: hands out the scripted records, at most `max_records`
    a poll, then nothing; records every commit."""

    def __init__(self, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        self.records = list(records)
        self.commits: list[int] = []

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[TopicPartition, Any]:
        if not self.records:
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        batch, self.records = self.records[:max_records], self.records[max_records:]
        return {TP: batch}

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(offsets[TP])

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(partitions, 0)

    async def committed(self, tp: TopicPartition) -> int:
        return self.commits[-1] if self.commits else 0


def consumer_loop(
    handler: Callable[[Event, Delivery], Any],
    records: list[ConsumerRecord[bytes, bytes]],
    *,
    max_in_flight: int,
) -> tuple[ConsumerLoop[Event], ScriptedConsumer]:
    loop: ConsumerLoop[Event] = ConsumerLoop(
        bootstrap="unused:9092",
        group_id="g",
        topics=[Topic.EVENTS],
        handler=handler,
        dead_letters=MemoryBus(),
        service="dispatch-test",
        max_in_flight=max_in_flight,
        poll_timeout_ms=20,
        retry_backoff_s=0.01,
    )
    consumer = ScriptedConsumer(records)
    loop._consumer = consumer  # type: ignore[assignment]
    loop._commits.trackers[TP] = OffsetTracker()
    return loop, consumer


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_slow_handler_holds_one_slot_not_the_partition() -> None:
    """Twenty records whose handlers each wait: all of them in hand at once up to the bound,
    and the commit waits for the oldest."""
    release = asyncio.Event()
    started: list[int] = []

    async def slow(message: Event, delivery: Delivery) -> None:
        started.append(delivery.offset)
        await release.wait()

    records = [record(n, f"episode-{n}") for n in range(20)]
    loop, consumer = consumer_loop(slow, records, max_in_flight=8)
    running = asyncio.create_task(loop.run())
    await until(lambda: len(started) == 8)
    await asyncio.sleep(0.1)
    assert len(started) == 8 and loop.in_flight == 8  # the bound holds
    assert consumer.commits == []  # nothing finished: nothing committed
    release.set()
    await until(lambda: loop.processed_count == 20)
    await loop.commit()
    assert consumer.commits[-1] == 20
    assert loop.in_flight_peak == 8
    loop.stop()
    await running


async def test_the_commit_stops_at_the_oldest_record_still_in_hand() -> None:
    gates = {n: asyncio.Event() for n in range(4)}

    async def gated(message: Event, delivery: Delivery) -> None:
        await gates[delivery.offset].wait()

    loop, consumer = consumer_loop(gated, [record(n, f"e{n}") for n in range(4)], max_in_flight=4)
    running = asyncio.create_task(loop.run())
    await until(lambda: loop.in_flight == 4)
    for n in (3, 2, 0):
        gates[n].set()
    await until(lambda: loop.processed_count == 3)
    await loop.commit()
    assert max(consumer.commits) == 1  # 0 done; 1 in hand; 2 and 3 done but after it
    gates[1].set()
    await until(lambda: loop.processed_count == 4)
    await loop.commit()
    assert consumer.commits[-1] == 4
    loop.stop()
    await running


async def test_records_with_one_key_run_in_offset_order_others_beside_them() -> None:
    """A job's spec and then its cancel must not overtake each other; another job's record
    does not wait for them."""
    first_of_a = asyncio.Event()
    order: list[str] = []

    async def handler(message: Event, delivery: Delivery) -> None:
        order.append(f"start {message.job_id}{message.step}")
        if delivery.offset == 0:
            await first_of_a.wait()
        order.append(f"end {message.job_id}{message.step}")

    records = [record(0, "a", 1), record(1, "a", 2), record(2, "b", 1)]
    loop, _ = consumer_loop(handler, records, max_in_flight=8)
    running = asyncio.create_task(loop.run())
    await until(lambda: "end b1" in order)
    assert "start a2" not in order  # waits for a1, though a slot is free
    first_of_a.set()
    await until(lambda: loop.processed_count == 3)
    assert order.index("end a1") < order.index("start a2")
    loop.stop()
    await running


async def test_a_transient_failure_retries_its_record_while_the_others_go_on() -> None:
    attempts: dict[int, int] = {}

    async def flaky(message: Event, delivery: Delivery) -> None:
        attempts[delivery.offset] = attempts.get(delivery.offset, 0) + 1
        if delivery.offset == 0 and attempts[0] < 4:
            raise RetryableError("Redis briefly away")

    loop, consumer = consumer_loop(flaky, [record(n, f"e{n}") for n in range(5)], max_in_flight=4)
    running = asyncio.create_task(loop.run())
    await until(lambda: loop.processed_count == 5)
    assert attempts == {0: 4, 1: 1, 2: 1, 3: 1, 4: 1}
    await loop.commit()
    assert consumer.commits[-1] == 5
    loop.stop()
    await running


async def test_a_failure_outside_the_handler_stops_the_loop() -> None:
    """What the handler raises is dead-lettered; a bug in the loop's own path must still end
    the service, as it did with one record at a time."""

    async def fine(message: Event, delivery: Delivery) -> None:
        return None

    async def broken(record: Any, tracker: Any) -> None:
        raise RuntimeError("bug")

    loop, _ = consumer_loop(fine, [record(0, "e0")], max_in_flight=4)
    loop._records.handle_record = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="bug"):
        await asyncio.wait_for(loop.run(), 10)


async def test_a_stop_cancels_what_outlasts_the_drain_and_leaves_it_uncommitted() -> None:
    async def forever(message: Event, delivery: Delivery) -> None:
        if delivery.offset == 1:
            await asyncio.Event().wait()

    loop, consumer = consumer_loop(forever, [record(n, f"e{n}") for n in range(3)], max_in_flight=4)
    loop._drain_timeout_s = 0.2
    running = asyncio.create_task(loop.run())
    await until(lambda: loop.processed_count == 2)
    loop.stop()
    await running
    assert loop.in_flight == 0
    await loop.commit()
    assert consumer.commits[-1] == 1  # the next owner reads 1 and 2 again


def test_a_dispatcher_needs_room_for_one_record() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Dispatcher(0, name="x")
