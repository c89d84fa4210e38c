"""A consumer's activity line: each replica logs what it handled, per topic, once a minute."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord, TopicPartition

from common.bus.kafka import ConsumerLoop
from common.bus.offsets import OffsetTracker
from common.wire.codec import encode
from common.wire.messages import JobCommand, Topic
from tests.fakes import MemoryBus


def record(tp: TopicPartition, offset: int) -> ConsumerRecord[bytes, bytes]:
    value = encode(JobCommand(command_id="c1", job_id="j1", action="pause"))
    return ConsumerRecord(
        tp.topic, tp.partition, offset, int(time.time() * 1000), 0, b"j1", value, None,
        len(b"j1"), len(value), (),
    )  # fmt: skip


async def test_each_replica_logs_what_it_handled_per_topic_once_an_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(message: Any, delivery: Any) -> None:
        return None

    loop: ConsumerLoop[Any] = ConsumerLoop(
        bootstrap="unused:9092",
        group_id="g",
        topics=[Topic.JOBS],
        handler=handler,
        dead_letters=MemoryBus(),
        service="env_svc",
        activity_interval_s=60.0,
    )
    tp = TopicPartition(Topic.JOBS.value, 3)
    loop._commits.trackers[tp] = OffsetTracker()
    await loop._dispatch_partition(tp, [record(tp, n) for n in range(3)])
    await loop._dispatch.drain(5.0)
    activity = loop._telemetry
    started = activity._activity_since
    with caplog.at_level(logging.INFO, logger="common.bus.telemetry"):
        activity.log_activity(now=started + 30.0)  # too early: nothing yet
        assert caplog.messages == []
        activity.log_activity(now=started + 61.0)
        assert caplog.messages == ["env_svc: handled 3 marlaas.jobs in the last 61 s"]
        activity.log_activity(now=started + 130.0)  # idle since: no line
        assert len(caplog.messages) == 1
