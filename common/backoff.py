"""Connecting to a server that may not be up yet: retry with back-off, one clear line each time."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class ServerUnreachable(ConnectionError):
    """A broker or Redis did not answer within the connect timeout."""

    def __init__(self, what: str, address: str, timeout_s: float, last_error: str) -> None:
        super().__init__(
            f"{what} at {address} unreachable after {timeout_s:.0f}s (last error: {last_error})"
        )
        self.what = what
        self.address = address


async def connect_with_backoff(
    what: str,
    address: str,
    connect: Callable[[], Awaitable[T]],
    *,
    timeout_s: float,
    retry_on: tuple[type[BaseException], ...],
    first_delay_s: float = 0.25,
    max_delay_s: float = 5.0,
) -> T:
    """Call `connect` until it succeeds or `timeout_s` has passed.

    `connect` must build a fresh client per attempt and clean it up when it fails.
    """
    deadline = time.monotonic() + timeout_s
    delay = first_delay_s
    attempt = 1
    while True:
        try:
            return await connect()
        except retry_on as exc:
            last_error = str(exc) or type(exc).__name__
            if time.monotonic() + delay > deadline:
                raise ServerUnreachable(what, address, timeout_s, last_error) from None
            log.warning(
                "%s at %s unreachable (%s); retry %d in %.1fs",
                what,
                address,
                last_error,
                attempt,
                delay,
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay_s)
        attempt += 1
