"""The aiokafka clients every MARLaaS process opens, and the options each kind is made with.

Every producer, group consumer and group-less reader is made here, so the broker sees one set
of settings per kind: producers wait for all in-sync replicas and are not idempotent (the
embedded broker lacks InitProducerId, so consumers de-duplicate by message id instead);
consumers never auto-commit. A start that fails is retried with back-off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor
from aiokafka.errors import KafkaConnectionError
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import TopicPartition

from common.runtime.backoff import connect_with_backoff
from common.runtime.config import kafka_client_options
from common.wire.codec import MAX_RECORD_BYTES

_CONNECT_ERRORS = (KafkaConnectionError, OSError, asyncio.TimeoutError)

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


async def start_producer(bootstrap: str, *, client_id: str, timeout_s: float) -> AIOKafkaProducer:
    """A started producer: acknowledged by all in-sync replicas, records up to the wire's
    largest, not idempotent."""
    return await start_client(
        lambda: AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            acks="all",
            enable_idempotence=False,
            linger_ms=5,
            max_request_size=MAX_RECORD_BYTES,
            **kafka_client_options(),
        ),
        bootstrap,
        timeout_s,
    )


async def start_group_consumer(
    bootstrap: str,
    *,
    group_id: str,
    client_id: str,
    max_records: int,
    sticky: bool,
    session_timeout_s: float,
    timeout_s: float,
) -> AIOKafkaConsumer:
    """A started member of consumer group `group_id`, not subscribed yet: it reads from the
    earliest record where the group has no commit, never auto-commits, and heartbeats every
    third of `session_timeout_s`."""
    # Sticky: a rebalance moves as few partitions as it can (a trainer's partitions carry
    # its jobs' adapters and optimizers, expensive to hand over).
    assignors = (StickyPartitionAssignor,) if sticky else (RoundRobinPartitionAssignor,)
    return await start_client(
        lambda: AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=group_id,
            client_id=client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=max_records,
            partition_assignment_strategy=assignors,
            session_timeout_ms=int(session_timeout_s * 1000),
            heartbeat_interval_ms=int(session_timeout_s * 1000 / 3),
            **kafka_client_options(),
        ),
        bootstrap,
        timeout_s,
    )


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
