"""What one tenant may ask of the API at once: a body size, a request rate, open streams.

A tenant's key lets it call every route; nothing else bounds how much it asks. So each API
replica caps the body of every request (before it is read whole), gives each tenant a token
bucket of requests, and counts each tenant's open event streams (each holds a Kafka
consumer). The limits are per replica: N replicas behind a balancer allow N times the rate,
which the operator sizes with the replica count.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: a request whose body is over `max_bytes` gets 413 before the route
    reads it (by its Content-Length, or as it streams in without one)."""

    def __init__(self, app: App, *, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _too_large(send, self.max_bytes)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _BodyTooLarge:
            await _too_large(send, self.max_bytes)


class _BodyTooLarge(Exception):
    pass


async def _too_large(send: Send, max_bytes: int) -> None:
    body = b'{"error": "the body is over %d bytes"}' % max_bytes
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class TenantGate:
    """Each tenant's request rate (a token bucket: `rate_per_s`, up to `burst` at once) and
    open streams (at most `max_streams`)."""

    rate_per_s: float
    burst: int
    max_streams: int
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _streams: dict[str, int] = field(default_factory=dict)

    def admit(self, tenant: str) -> None:
        """Take one request from the tenant's bucket; 429 (with Retry-After) when empty."""
        now = self.clock()
        bucket = self._buckets.setdefault(tenant, _Bucket(float(self.burst), now))
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate_per_s)
        bucket.at = now
        if bucket.tokens < 1:
            wait_s = (1 - bucket.tokens) / self.rate_per_s
            raise HTTPException(
                429,
                f"tenant {tenant!r}: more than {self.rate_per_s:g} requests/s "
                f"(bursts of {self.burst}); retry in {wait_s:.1f}s",
                headers={"Retry-After": str(max(1, round(wait_s)))},
            )
        bucket.tokens -= 1

    def open_stream(self, tenant: str) -> Callable[[], None]:
        """Take one of the tenant's open streams (429 when all are open); returns what
        closes it, to call once when the stream ends."""
        if self._streams.get(tenant, 0) >= self.max_streams:
            raise HTTPException(
                429, f"tenant {tenant!r} has {self.max_streams} streams open; close one first"
            )
        self._streams[tenant] = self._streams.get(tenant, 0) + 1
        closed = False

        def close() -> None:  # once, however often it is called
            nonlocal closed
            if not closed:
                closed = True
                self._streams[tenant] -= 1

        return close
