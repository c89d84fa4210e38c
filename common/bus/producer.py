"""The producer: sends each message to the topic its type belongs to, keyed and signed."""

from __future__ import annotations

from aiokafka import AIOKafkaProducer

from common.bus.clients import start_producer
from common.security.signing import RecordSigner
from common.wire.codec import WireSchema, encode, fits_record, key_bytes, topic_of
from common.wire.messages import Message


class Producer:
    """Sends messages to the topic their type belongs to, keyed as the contract says."""

    def __init__(
        self,
        bootstrap: str,
        *,
        client_id: str,
        wire_schema: WireSchema = 2,
        signing: RecordSigner | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.client_id = client_id
        self.signing = signing
        """Signs every record (common/security/signing.py); None: records go unsigned."""
        self.wire_schema: WireSchema = wire_schema
        """The layout messages are written in (common/wire/messages.py)."""
        self._producer: AIOKafkaProducer | None = None

    async def start(self, *, timeout_s: float = 60.0) -> None:
        self._producer = await start_producer(
            self.bootstrap, client_id=self.client_id, timeout_s=timeout_s
        )

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def send(self, message: Message) -> None:
        """Send and wait for the broker's acknowledgement from all in-sync replicas."""
        await self.send_raw(
            topic_of(message), encode(message, self.wire_schema), key_bytes(message)
        )

    async def send_raw(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        if self._producer is None:
            raise RuntimeError("producer not started")
        fits_record(topic, value)
        headers = self.signing.headers(topic, key, value) if self.signing else None
        await self._producer.send_and_wait(topic, value, key=key, headers=headers)
