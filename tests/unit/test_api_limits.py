"""api_svc/limits.py: a tenant's body size, request rate and open streams are bounded."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import HTTPException

from api_svc.limits import BodyLimit, Message, TenantGate


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
