"""Fan-out reading: every member reads every record of a topic (adapter updates).

No consumer group and no commits: each rollout replica must see every `AdapterUpdate`, so it
reads `marlaas.adapters` from "now" on, after pinning "now" before it reads the matching Redis
snapshot (docs/architecture.md, "Scaling").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from aiokafka import AIOKafkaConsumer

from common.bus.clients import start_reader
from common.runtime.backoff import retry_transient
from common.security.signing import RecordSigner
from common.wire.codec import decode
from common.wire.messages import Message, MessageDecodeError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


class BroadcastReader(Generic[M]):
    """Every member reads every record of `topic` from now on (no group, no commits).

    For fan-out state such as adapter updates: each rollout replica must see all of them.
    Start it before reading the matching snapshot (e.g. Redis) so nothing falls in between.
    """

    def __init__(
        self,
        *,
        bootstrap: str,
        topic: str,
        handler: Callable[[M], Awaitable[None]],
        service: str,
        signing: RecordSigner | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.signing = signing
        """Checks every record's signature (common/security/signing.py); None: none is checked."""
        self.topic = topic
        self.service = service
        self._handler = handler
        self._consumer: AIOKafkaConsumer | None = None
        self._stopping = asyncio.Event()

    async def start(self, *, timeout_s: float = 60.0) -> None:
        consumer, assigned = await start_reader(
            self.bootstrap,
            self.topic,
            client_id=f"{self.service}-broadcast",
            start_at="latest",
            timeout_s=timeout_s,
        )
        # Pin "now" before returning, so the caller's snapshot cannot miss a record.
        for tp, end in (await consumer.end_offsets(assigned)).items():
            consumer.seek(tp, end)
        self._consumer = consumer

    async def run(self) -> None:
        consumer = self._consumer
        if consumer is None:
            raise RuntimeError("broadcast reader not started")
        while not self._stopping.is_set():
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                for record in records:
                    if self.signing is not None and (
                        untrusted := self.signing.problem(
                            record.topic, record.key, record.value, record.headers
                        )
                    ):
                        log.error(
                            "%s: skipping %s@%d: %s",
                            self.service,
                            record.topic,
                            record.offset,
                            untrusted,
                        )
                        continue
                    try:
                        message = decode(record.topic, record.value)
                    except MessageDecodeError as exc:
                        log.error("%s: skipping %s", self.service, exc)
                        continue
                    await self._handle(message, record.offset)  # type: ignore[arg-type]

    async def _handle(self, message: M, offset: int) -> None:
        """Hand over one record; transient failures are waited out, others skip the record
        (logged): no other record depends on it, and readers fall back on Redis' snapshot."""
        try:
            await retry_transient(
                f"{self.service}: {self.topic}@{offset}", lambda: self._handler(message), logger=log
            )
        except Exception:
            log.exception("%s: %s@%d skipped: its handler failed", self.service, self.topic, offset)

    def stop(self) -> None:
        self._stopping.set()

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
