"""Failures worth another try, and how long to wait before it.

- `is_transient`: the errors of a dependency that is briefly away (Redis restarting or still
  loading its data, a broker or partition leader not reachable yet), as the clients raise
  them: redis-py's and aiokafka's errors are not subclasses of the built-in
  `ConnectionError`/`TimeoutError`.
- `Backoff`: growing, jittered delays, so replicas that failed together do not retry together.
- `connect_with_backoff`: connecting to a server that may not be up yet, one line per retry.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka.errors import KafkaError, KafkaTimeoutError, UnknownError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, TryAgainError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

T = TypeVar("T")


class RetryableError(Exception):
    """A failure that a later attempt may not hit (a dependency briefly away), raised by our
    own code where no client error says so."""


TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    RetryableError,
    ConnectionError,  # built-in, with OSError's connection family
    TimeoutError,  # also asyncio.TimeoutError
    RedisConnectionError,  # BusyLoadingError (Redis loading its data after a restart) is one
    RedisTimeoutError,
    ReadOnlyError,  # a replica promoted while we still talk to it
    TryAgainError,
    KafkaTimeoutError,  # aiokafka's own timeouts, not marked retriable
    # The broker's "unknown server error": Tansu answers so a produce it could not store
    # (its s3 engine, right after a restart, finds the offset's object already there; seen
    # in the chaos run, where dead-lettering that record lost a group). The write did not
    # happen, so trying again is safe; a retry that never succeeds stalls visibly instead.
    UnknownError,
)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` comes from a dependency that is briefly away: retry, do not give up."""
    if isinstance(exc, TRANSIENT_ERRORS):
        return True
    # aiokafka marks its connection, leader, coordinator and timeout errors retriable.
    return isinstance(exc, KafkaError) and bool(exc.retriable)


class Backoff:
    """Delays of first_s, 2*first_s, ... up to max_s, each scaled by a random factor in
    [1 - jitter, 1]; `reset()` after a success starts again from first_s."""

    def __init__(
        self,
        first_s: float = 0.25,
        max_s: float = 10.0,
        *,
        jitter: float = 0.5,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {first_s}, {max_s}")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        self.first_s, self.max_s, self.jitter = first_s, max_s, jitter
        self.failures = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        """The delay before the next attempt; counts one more failure."""
        ceiling = min(self.max_s, self.first_s * 2 ** min(self.failures, 32))
        self.failures += 1
        return ceiling * (1 - self.jitter * self._rng.random())

    def reset(self) -> None:
        self.failures = 0


async def retry_transient(
    what: str,
    call: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff | None = None,
    logger: logging.Logger = log,
) -> T:
    """`call()` until it returns, waiting out transient failures (`is_transient`) with
    back-off; any other exception is raised at once. For work that must not be dropped
    while a dependency is away (sending a result, reading a pointer)."""
    backoff = backoff or Backoff()
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            delay = backoff.next_delay()
            logger.warning("%s failed (%r); retry %d in %.1fs", what, exc, backoff.failures, delay)
            await asyncio.sleep(delay)


class ServerUnreachable(ConnectionError):
    """A broker or Redis did not answer within the connect timeout."""

    def __init__(self, what: str, address: str, timeout_s: float, last_error: str) -> None:
        super().__init__(
            f"{what} at {address} unreachable after {timeout_s:.0f}s (last error: {last_error})"
        )
        self.what = what
        self.address = address


QUIET_RETRIES = 2
"""Connection retries logged at INFO before they become warnings."""


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
    backoff = Backoff(first_delay_s, max_delay_s)
    while True:
        try:
            return await connect()
        except retry_on as exc:
            last_error = str(exc) or type(exc).__name__
            delay = backoff.next_delay()
            if time.monotonic() + delay > deadline:
                raise ServerUnreachable(what, address, timeout_s, last_error) from None
            # A server still starting (the embedded stack's, a container's) takes a retry or
            # two: said quietly; past that, a warning.
            log.log(
                logging.INFO if backoff.failures <= QUIET_RETRIES else logging.WARNING,
                "%s at %s unreachable (%s); retry %d in %.1fs",
                what,
                address,
                last_error,
                backoff.failures,
                delay,
            )
        await asyncio.sleep(delay)
