"""The Kafka bus: client start-up, producer, at-least-once consumer loop, dead letters, lag.

Topic creation and outside lag reads are the operator's (console/stack/topics.py); fan-out reading
is common/bus/broadcast.py. Delivery contract (docs/architecture.md, "Delivery guarantees"):
offsets are committed only after the handler succeeded (or explicitly after held work became
durable); a record that cannot be decoded, or whose handler fails for good, goes to
`marlaas.dlq` and the loop goes on; a transient failure (common/runtime/backoff.py: Redis or the
broker briefly away, whichever client raised it) re-reads the same record after a growing,
jittered back-off. No Kafka transactions and no idempotent producer: the embedded broker lacks
InitProducerId, so consumers de-duplicate by message id instead.

This module is the bus's one import point; its parts are the clients and their options
(`clients`), the producer (`producer`), what a handler is given (`delivery`), the consumer loop
(`consumer`), one record's handling and dead letters (`records`), the commit bookkeeping and
lag (`commits`) and the consumer's metrics and activity line (`telemetry`).
"""

from common.bus.clients import assign_topic, partition_of, start_client, start_reader
from common.bus.commits import PartitionLag
from common.bus.consumer import ConsumerLoop
from common.bus.delivery import Delivery, Handler, PartitionsCallback, Undecodable
from common.bus.producer import Producer

__all__ = [
    "ConsumerLoop",
    "Delivery",
    "Handler",
    "PartitionLag",
    "PartitionsCallback",
    "Producer",
    "Undecodable",
    "assign_topic",
    "partition_of",
    "start_client",
    "start_reader",
]
