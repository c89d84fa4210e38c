"""Topic administration from the operator's side: creating the topics, reading group lag.

Services never create topics (a typo would create a wrong one): `marlaas topics create`, the
embedded stack and compose's one-shot `topics` service do, through `ensure_topics`.
`group_lag` reads a consumer group's lag from outside the group (status board, CLI).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from common.bus.kafka import PartitionLag, start_client
from common.runtime.config import kafka_client_options
from common.wire.messages import Topic

log = logging.getLogger(__name__)

_TOPIC_ALREADY_EXISTS = 36


async def _start_admin(bootstrap: str, timeout_s: float) -> AIOKafkaAdminClient:
    return await start_client(
        lambda: AIOKafkaAdminClient(
            bootstrap_servers=bootstrap, client_id="marlaas-admin", **kafka_client_options()
        ),
        bootstrap,
        timeout_s,
    )


async def ensure_topics(
    bootstrap: str, partitions: int = 12, *, timeout_s: float = 60.0
) -> dict[str, int]:
    """Create every missing `marlaas.*` topic; return each topic's partition count.

    Idempotent: existing topics are left alone (a count differing from
    `partitions` is logged, since Kafka cannot shrink a topic).
    """
    admin = await _start_admin(bootstrap, timeout_s)
    try:
        existing = set(await admin.list_topics())
        missing = [topic.value for topic in Topic if topic.value not in existing]
        if missing:
            response = await admin.create_topics(
                [
                    NewTopic(name, num_partitions=partitions, replication_factor=1)
                    for name in missing
                ]
            )
            for name, code, *rest in response.topic_errors:
                if code not in (0, _TOPIC_ALREADY_EXISTS):
                    raise KafkaError(f"cannot create topic {name}: error {code} {rest}")
            log.info("created topics %s with %d partitions", ", ".join(missing), partitions)
        # Describe only topics that exist now: naming a missing one would auto-create it.
        counts = {
            entry["topic"]: len(entry["partitions"])
            for entry in await admin.describe_topics([topic.value for topic in Topic])
        }
    finally:
        await admin.close()
    for name, count in counts.items():
        if count != partitions:
            log.warning(
                "topic %s has %d partitions, not the configured %d", name, count, partitions
            )
    return counts


async def group_lag(
    bootstrap: str, group_id: str, topics: Iterable[str], *, timeout_s: float = 10.0
) -> list[PartitionLag]:
    """Lag of a consumer group on `topics`, seen from outside the group (CLI, dashboards)."""
    admin = await _start_admin(bootstrap, timeout_s)
    try:
        # Describe only existing topics: naming a missing one would auto-create it.
        wanted = set(topics) & set(await admin.list_topics())
        partitions = [
            TopicPartition(entry["topic"], p["partition"])
            for entry in (await admin.describe_topics(sorted(wanted)) if wanted else [])
            for p in entry["partitions"]
        ]
    finally:
        await admin.close()
    partitions.sort(key=lambda tp: (tp.topic, tp.partition))
    # A consumer that names the group but never subscribes reads its commits without
    # joining it (the admin client's OffsetFetch version is not one Tansu answers).
    probe = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group_id,
        client_id="marlaas-lag",
        enable_auto_commit=False,
        **kafka_client_options(),
    )
    await probe.start()
    try:
        ends = await probe.end_offsets(partitions) if partitions else {}
        return [
            PartitionLag(tp.topic, tp.partition, ends[tp], await probe.committed(tp))
            for tp in partitions
        ]
    finally:
        await probe.stop()
