"""What a service sees of Kafka's producer: one small protocol.

Services send through `Sender`, not through aiokafka, so each service's handlers run
unchanged on the real `Producer` (common/bus/producer.py) and, in unit tests, on an in-memory bus
(tests/fakes.py): the same scenarios run on both. Redis needs no such protocol: unit tests
run the real `RedisStore` over fakeredis, which runs the store's own Lua.
"""

from __future__ import annotations

from typing import Protocol

from common.wire.messages import Message


class Sender(Protocol):
    """Produces a message to the topic its type belongs to (common.bus.producer.Producer)."""

    async def send(self, message: Message) -> None: ...
