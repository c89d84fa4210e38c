"""common.runtime.backoff (what is worth another try, and when) and env_svc.calls (time limits)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from aiokafka import errors as kafka
from redis import exceptions as redis

from common.runtime.backoff import Backoff, RetryableError, is_transient, retry_transient
from env_svc.calls import EnvCalls, EnvCallTimeout, EnvCodeError, WorkersExhausted


@pytest.mark.parametrize(
    "exc",
    [
        redis.ConnectionError("Connection closed by server."),
        redis.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.TimeoutError("Timeout reading from socket"),
        redis.ReadOnlyError("You can't write against a read only replica."),
        kafka.KafkaConnectionError("No connection to node with id 0"),
        kafka.NodeNotReadyError("not ready"),
        kafka.KafkaTimeoutError(),
        kafka.RequestTimedOutError(),
        kafka.NotLeaderForPartitionError(),
        kafka.UnknownError(),
        ConnectionRefusedError(111, "Connection refused"),
        TimeoutError(),
        RetryableError("ours"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_the_clients_errors_of_a_dependency_briefly_away_are_transient(exc: Exception) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad"),
        redis.ResponseError("WRONGTYPE"),
        kafka.MessageSizeTooLargeError(),
        kafka.UnsupportedVersionError(),
        RuntimeError("bug"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_errors_a_retry_cannot_fix_are_not_transient(exc: Exception) -> None:
    assert not is_transient(exc)


def test_backoff_grows_to_its_cap_with_jitter_and_starts_over_after_reset() -> None:
    backoff = Backoff(0.5, 4.0, jitter=0.5, rng=random.Random(1))
    delays = [backoff.next_delay() for _ in range(6)]
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert len(set(delays)) == len(delays)  # jittered: replicas do not retry in step
    backoff.reset()
    assert backoff.next_delay() <= 0.5 and backoff.failures == 1
    with pytest.raises(ValueError, match="first_s"):
        Backoff(2.0, 1.0)


async def test_retry_transient_waits_out_a_blip_and_raises_anything_else_at_once() -> None:
    calls = 0

    async def blip() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise redis.ConnectionError("Connection reset by peer")
        return "done"

    assert await retry_transient("blip", blip, backoff=Backoff(0.01, 0.02)) == "done"
    assert calls == 3

    async def bug() -> None:
        nonlocal calls
        calls += 1
        raise KeyError("bug")

    with pytest.raises(KeyError):
        await retry_transient("bug", bug, backoff=Backoff(0.01, 0.02))
    assert calls == 4


async def test_env_calls_answer_raise_time_out_and_give_up_when_every_worker_hangs() -> None:
    calls = EnvCalls(timeout_s=0.2, workers=2)
    release = threading.Event()
    try:
        assert await calls.run("add", lambda: 1 + 1) == 2
        with pytest.raises(ZeroDivisionError):
            await calls.run("divide", lambda: 1 / 0)
        for hung in range(2):
            with pytest.raises(EnvCallTimeout, match=r"no answer after 0\.2s"):
                await calls.run(f"hang {hung}", release.wait)
        assert calls.abandoned == 2
        with pytest.raises(WorkersExhausted):
            await calls.run("one more", lambda: 1)
        release.set()  # the hung calls return: their workers serve again
        for _ in range(50):
            if calls.abandoned == 0:
                break
            await asyncio.sleep(0.02)
        assert await calls.run("add", lambda: 2 + 2) == 4
    finally:
        release.set()
        calls.close()


async def test_what_environment_code_raises_is_never_retried_as_a_dependency_away() -> None:
    """A plugin tool's own ConnectionError or TimeoutError is its episode's error (issue 24):
    classed transient, the record would be retried forever and its partition would stop."""
    calls = EnvCalls(timeout_s=5.0, workers=1)

    def tool_call() -> None:
        raise ConnectionError("the tool's own API is down")

    def slow_tool() -> None:
        raise TimeoutError("the tool's own deadline")

    try:
        for code, name in ((tool_call, "ConnectionError"), (slow_tool, "TimeoutError")):
            with pytest.raises(EnvCodeError) as raised:
                await calls.run("reward", code)
            assert not is_transient(raised.value) and f"reward: {name}: " in str(raised.value)
        assert calls.abandoned == 0  # the code's TimeoutError is not the call's time limit
    finally:
        calls.close()
