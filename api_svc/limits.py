"""What one tenant, or one address without a key, may ask of the API at once: a body size,
a request rate, open streams, running reads.

A tenant's key lets it call every route; nothing else bounds how much it asks. So each API
replica caps the body of every request (before it is read whole), gives each tenant a token
bucket of requests, and counts each tenant's open event streams (each holds a Kafka
consumer) and running reads (each holds one of the replica's pooled readers or a scratch
copy of an adapter). Requests no valid key authenticates draw from a bucket of their client
address instead, taken before the key is looked up. The limits are per replica: N replicas
behind a balancer allow N times the rate, which the operator sizes with the replica count.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
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
    await _refuse(send, 413, f"the body is over {max_bytes} bytes", {})


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class TokenBuckets:
    """A token bucket per key: `rate_per_s` tokens a second, up to `burst`. A full bucket is
    forgotten (it is the same as none), so many keys cost memory only while they ask."""

    rate_per_s: float
    burst: int
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict, init=False, repr=False)
    _kept_after_sweep: int = field(default=0, init=False, repr=False)

    def take(self, key: str) -> float:
        """Take a token: 0.0, or (none taken) the seconds until there is one."""
        bucket = self._refilled(key)
        if bucket.tokens < 1:
            return (1 - bucket.tokens) / self.rate_per_s
        bucket.tokens -= 1
        return 0.0

    def give_back(self, key: str) -> None:
        """Return a token taken in advance (the request turned out not to be charged)."""
        bucket = self._refilled(key)
        bucket.tokens = min(float(self.burst), bucket.tokens + 1)

    def __len__(self) -> int:
        return len(self._buckets)

    def _refilled(self, key: str) -> _Bucket:
        now = self.clock()
        if len(self._buckets) > 2 * self._kept_after_sweep + 64:
            self._sweep(now)
        bucket = self._buckets.setdefault(key, _Bucket(float(self.burst), now))
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate_per_s)
        bucket.at = now
        return bucket

    def _sweep(self, now: float) -> None:
        self._buckets = {
            key: bucket
            for key, bucket in self._buckets.items()
            if bucket.tokens + (now - bucket.at) * self.rate_per_s < self.burst
        }
        self._kept_after_sweep = len(self._buckets)


def retry_after(wait_s: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, round(wait_s)))}


@dataclass
class TenantGate:
    """Each tenant's request rate (a token bucket: `rate_per_s`, up to `burst` at once), open
    streams (at most `max_streams`) and running reads (at most `max_reads`)."""

    rate_per_s: float
    burst: int
    max_streams: int
    max_reads: int = 2
    clock: Callable[[], float] = time.monotonic
    _requests: TokenBuckets = field(init=False)
    _streams: dict[str, int] = field(default_factory=dict)
    _reads: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._requests = TokenBuckets(self.rate_per_s, self.burst, self.clock)

    def admit(self, tenant: str) -> None:
        """Take one request from the tenant's bucket; 429 (with Retry-After) when empty."""
        if wait_s := self._requests.take(tenant):
            raise HTTPException(
                429,
                f"tenant {tenant!r}: more than {self.rate_per_s:g} requests/s "
                f"(bursts of {self.burst}); retry in {wait_s:.1f}s",
                headers=retry_after(wait_s),
            )

    def open_stream(self, tenant: str) -> Callable[[], None]:
        """Take one of the tenant's open streams (429 when all are open); returns what
        closes it, to call once when the stream ends."""
        return _hold(
            self._streams, tenant, self.max_streams, f"has {self.max_streams} streams open"
        )

    def open_read(self, tenant: str) -> Callable[[], None]:
        """Take one of the tenant's running reads (429 when all run); returns what ends it."""
        return _hold(self._reads, tenant, self.max_reads, f"has {self.max_reads} reads running")


def _hold(counts: dict[str, int], tenant: str, limit: int, full: str) -> Callable[[], None]:
    if counts.get(tenant, 0) >= limit:
        raise HTTPException(429, f"tenant {tenant!r} {full}; wait for one to end")
    counts[tenant] = counts.get(tenant, 0) + 1
    closed = False

    def close() -> None:  # once, however often it is called
        nonlocal closed
        if not closed:
            closed = True
            counts[tenant] -= 1
            if not counts[tenant]:
                del counts[tenant]

    return close


class AddressGate:
    """ASGI middleware: each client address's requests that no valid key authenticates (no
    key, a key a route refused with 401, or a route that asks for none) draw from the
    address's token bucket. The token is taken before the route runs, so before any key
    lookup, and given back once a route has authenticated the key (`vouch`); an empty bucket
    is 429 at once. A key this replica saw valid lately (`trust_s`) skips the bucket, so a
    tenant sharing an address with a flood (a NAT, a proxy) is not refused for it; the route
    still checks its key. IPv6 clients are keyed by their /64.
    """

    def __init__(
        self,
        app: App,
        *,
        rate_per_s: float,
        burst: int,
        trust_s: float = 600.0,
        max_trusted: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app, self.clock = app, clock
        self.buckets = TokenBuckets(rate_per_s, burst, clock)
        self.trust_s, self.max_trusted = trust_s, max_trusted
        self._trusted: dict[bytes, float] = {}
        """A valid key's SHA-256 -> until when its requests skip the address's bucket."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = bearer_token(
            dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        )
        digest = hashlib.sha256(key.encode()).digest() if key else b""
        address = client_address(scope)
        charged = not (digest and self._trusted.get(digest, 0.0) > self.clock())
        if charged and (wait_s := self.buckets.take(address)):
            await _refuse(send, 429, _ANONYMOUS_REFUSAL, retry_after(wait_s))
            return
        scope[_VOUCHED] = False

        async def answered(message: Message) -> None:
            if message["type"] == "http.response.start":
                if scope[_VOUCHED]:
                    self._trust(digest)
                    if charged:
                        self.buckets.give_back(address)
                elif message["status"] == 401:
                    self._trusted.pop(digest, None)
                    if not charged:  # trusted until now (revoked since): charged after all
                        self.buckets.take(address)
            await send(message)

        await self.app(scope, receive, answered)

    def _trust(self, digest: bytes) -> None:
        now = self.clock()
        if len(self._trusted) >= self.max_trusted:
            self._trusted = {d: until for d, until in self._trusted.items() if until > now}
        if len(self._trusted) < self.max_trusted or digest in self._trusted:
            self._trusted[digest] = now + self.trust_s


def vouch(scope: Scope) -> None:
    """Tell `AddressGate` that the request's key authenticated a tenant."""
    scope[_VOUCHED] = True


_VOUCHED = "marlaas.key_valid"
_ANONYMOUS_REFUSAL = "too many requests without a valid API key from this address; retry later"


def client_address(scope: Scope) -> str:
    """The client's address as the server saw it (behind a trusted proxy, the one it names);
    an IPv6 client's /64, the block one host usually holds (an IPv4 client of a dual-stack
    socket: its IPv4 address)."""
    host = (scope.get("client") or ("", 0))[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return str(host)
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def bearer_token(authorization: str) -> str:
    """The API key of an `Authorization: Bearer <key>` header's value; "" without one."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def _refuse(send: Send, status: int, error: str, headers: dict[str, str]) -> None:
    body = json.dumps({"error": error}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    raw += [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
