"""api_svc/limits.py: a tenant's body size, request rate, open streams and running reads are
bounded, and so is what an address asks without a valid key."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import HTTPException

from api_svc.limits import (
    AddressGate,
    BodyLimit,
    Message,
    TenantGate,
    TokenBuckets,
    client_address,
    vouch,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_gets_its_burst_then_its_rate_and_no_more() -> None:
    clock = Clock()
    gate = TenantGate(rate_per_s=2.0, burst=3, max_streams=1, clock=clock)
    for _ in range(3):
        gate.admit("acme")
    with pytest.raises(HTTPException) as refused:
        gate.admit("acme")
    assert refused.value.status_code == 429 and refused.value.headers == {"Retry-After": "1"}
    gate.admit("globex")  # another tenant's bucket is its own
    clock.now = 0.5  # one token back at 2/s
    gate.admit("acme")
    with pytest.raises(HTTPException):
        gate.admit("acme")


def test_open_streams_are_counted_per_tenant_and_released() -> None:
    gate = TenantGate(rate_per_s=1.0, burst=1, max_streams=2)
    first, second = gate.open_stream("acme"), gate.open_stream("acme")
    with pytest.raises(HTTPException, match="has 2 streams open") as refused:
        gate.open_stream("acme")
    assert refused.value.status_code == 429
    gate.open_stream("globex")
    first()
    first()  # closing twice gives back one slot, not two
    gate.open_stream("acme")
    with pytest.raises(HTTPException):
        gate.open_stream("acme")
    second()


async def _call(app: BodyLimit, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> int:
    incoming = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    await app({"type": "http", "headers": headers}, receive, send)
    return int(sent[0]["status"])


async def test_a_body_over_the_limit_is_refused_before_it_is_read_whole() -> None:
    read: list[int] = []

    async def route(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        read.append(len(body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = BodyLimit(route, max_bytes=100)
    assert await _call(app, [(b"content-length", b"50")], [b"x" * 50]) == 200
    assert await _call(app, [(b"content-length", b"5000")], [b"x" * 5000]) == 413
    assert await _call(app, [(b"content-length", b"-1")], [b""]) == 413
    assert await _call(app, [], [b"x" * 60, b"x" * 60]) == 413  # no length: counted as it comes
    assert read == [50]


def test_running_reads_are_counted_per_tenant_apart_from_streams() -> None:
    gate = TenantGate(rate_per_s=1.0, burst=1, max_streams=1, max_reads=2)
    gate.open_stream("acme")
    first, _ = gate.open_read("acme"), gate.open_read("acme")
    with pytest.raises(HTTPException, match="has 2 reads running") as refused:
        gate.open_read("acme")
    assert refused.value.status_code == 429
    gate.open_read("globex")
    first()
    gate.open_read("acme")


def test_full_buckets_are_forgotten_so_many_addresses_cost_no_memory_once_quiet() -> None:
    clock = Clock()
    buckets = TokenBuckets(rate_per_s=1.0, burst=2, clock=clock)
    for wave in range(10):  # 50,000 addresses, 5,000 a wave, each quiet once its wave is over
        clock.now = 2.0 * wave
        for n in range(5_000):
            assert buckets.take(f"10.{wave}.{n // 256}.{n % 256}") == 0.0
        assert len(buckets) <= 2 * 5_000 + 65
    assert buckets.take("a") == 0.0 and buckets.take("a") == 0.0
    assert buckets.take("a") == pytest.approx(1.0)  # empty: a second until the next token
    buckets.give_back("a")
    assert buckets.take("a") == 0.0


class KeyedRoute:
    """Stands in for the API's routes: "good" is a valid key (the route vouches for it), any
    other key is looked up and refused with 401; `/open` asks for no key."""

    def __init__(self) -> None:
        self.lookups = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        status = 200
        if scope["path"] != "/open":
            key = dict(scope["headers"]).get(b"authorization", b"")
            if key:
                self.lookups += 1
            if key == b"Bearer good":
                vouch(scope)
            else:
                status = 401
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def _ask(gate: AddressGate, address: str, key: str = "", path: str = "/v1/jobs") -> int:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "path": path, "headers": headers, "client": (address, 4242)}
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    async def send(message: Message) -> None:
        sent.append(message)

    await gate(scope, receive, send)
    return int(sent[0]["status"])


async def test_an_address_without_a_valid_key_gets_its_burst_of_lookups_then_429() -> None:
    route, clock = KeyedRoute(), Clock()
    gate = AddressGate(route, rate_per_s=1.0, burst=5, clock=clock)  # type: ignore[arg-type]
    assert await _ask(gate, "10.0.0.1", "good") == 200  # a tenant there before the flood
    statuses = [await _ask(gate, "10.0.0.1", f"guess-{n}") for n in range(50)]
    assert statuses == [401] * 5 + [429] * 45
    assert route.lookups == 1 + 5  # the refused 45 were never looked up
    assert await _ask(gate, "10.0.0.1") == 429  # nor keyless ones
    assert await _ask(gate, "10.0.0.1", "good") == 200  # a key seen valid is not refused
    assert await _ask(gate, "10.0.0.2", "guess") == 401  # another address: its own bucket
    clock.now = 1.0
    assert await _ask(gate, "10.0.0.1", "guess") == 401  # one token back at 1/s
    assert await _ask(gate, "10.0.0.1", "guess") == 429


async def test_a_valid_key_costs_its_address_nothing_and_an_unchecked_key_earns_no_trust() -> None:
    route = KeyedRoute()
    gate = AddressGate(route, rate_per_s=1.0, burst=2, trust_s=0.0)  # type: ignore[arg-type]
    assert [await _ask(gate, "10.0.0.3", "good") for _ in range(10)] == [200] * 10
    # A route that checks no key (the schema) vouches for none: the key pays as keyless.
    assert [await _ask(gate, "10.0.0.4", "forged", "/open") for _ in range(3)] == [200, 200, 429]
    assert await _ask(gate, "10.0.0.4", "forged") == 429


async def test_ipv6_clients_share_their_64s_bucket() -> None:
    gate = AddressGate(KeyedRoute(), rate_per_s=1.0, burst=2)  # type: ignore[arg-type]
    assert await _ask(gate, "2001:db8::1", "x") == 401
    assert await _ask(gate, "2001:db8::ffff:2", "x") == 401
    assert await _ask(gate, "2001:db8::3", "x") == 429
    assert await _ask(gate, "2001:db8:0:1::1", "x") == 401
    assert client_address({"client": ("2001:db8::1", 1)}) == "2001:db8::/64"
    assert client_address({"client": ("::ffff:192.0.2.7", 1)}) == "192.0.2.7"  # not all of v4
    assert client_address({"client": None}) == ""
