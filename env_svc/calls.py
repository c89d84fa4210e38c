"""Environment and reward code, each call with a time limit: in worker threads, or awaited.

An environment whose code awaits (`Environment.awaits`: an `async def` respond, prompt or
reward) runs on the event loop, where hundreds of its calls can wait at once and a call past
its time limit is cancelled. Any other environment is synchronous user code, run in threads:
sized for waiting (`ENV_SVC_ENV_WORKERS`), since such code often blocks on I/O.

An environment is user code: it may be slow, hang, or raise anything. Run on the event loop, a
hanging reward would stall the replica past the broker's poll interval; the group would move
to the next replica, which would hang on the same record. Here each call runs in a worker
thread and is abandoned after `timeout_s` (the episode then ends with an error). Python
cannot stop a thread, so an abandoned call keeps its worker; once every worker is held by one,
the replica cannot make progress and raises `WorkersExhausted`, which ends the service (a
restarted process starts with free workers; the records of the abandoned calls are already
answered).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from common.runtime.backoff import is_transient
from env_svc.episodes import EpisodeError
from env_svc.protocol import run_sync

log = logging.getLogger(__name__)

T = TypeVar("T")


class EnvCallTimeout(EpisodeError):
    """An environment or reward call did not return within the time limit."""


class EnvCodeError(EpisodeError):
    """What environment code raised that would read as a dependency briefly away (e.g. a
    plugin tool's own `ConnectionError`): the episode's error, never retried as env_svc's
    own Kafka or Redis would be (a record retried forever stops its shared partition)."""


class WorkersExhausted(BaseException):
    """Every worker is held by an abandoned call. A BaseException so that no handler's
    `except Exception` turns it into a dead letter: it must stop the service."""


class EnvCalls:
    def __init__(self, *, timeout_s: float, workers: int) -> None:
        self.timeout_s = timeout_s
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="env-call")
        self._abandoned = 0
        self._lock = threading.Lock()
        self.in_flight = 0
        """Calls running now, in threads or on the loop."""
        self.peak = 0
        """The most calls running at once so far."""

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The workers, also the event loop's default executor in env_svc: the tool layer's
        plain (not `async def`) tools run there (`asyncio.to_thread`)."""
        return self._pool

    @property
    def abandoned(self) -> int:
        """Calls that timed out and still hold a worker."""
        return self._abandoned

    async def drive(
        self, what: str, work: Callable[[], Coroutine[Any, Any, T]], *, awaits: bool
    ) -> T:
        """The coroutine `work()` of an environment: awaited here when the environment
        `awaits`, cancelled after `timeout_s`; else driven to its end in a worker (`run`)."""
        if not awaits:
            return await self.run(what, lambda: run_sync(work()))
        self._entered()
        try:
            async with asyncio.timeout(self.timeout_s) as limit:
                return await work()
        except Exception as exc:
            if isinstance(exc, TimeoutError) and limit.expired():
                log.error("%s: no answer after %.0fs; cancelled", what, self.timeout_s)
                raise EnvCallTimeout(f"{what}: no answer after {self.timeout_s:g}s") from None
            if is_transient(exc):  # the code's own client or deadline, not env_svc's
                raise EnvCodeError(f"{what}: {type(exc).__name__}: {exc}") from exc
            raise
        finally:
            self.in_flight -= 1

    def _entered(self) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    async def run(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` in a worker; raises `EnvCallTimeout` after `timeout_s`, or what `fn` raised."""
        self._entered()
        try:
            return await self._in_worker(what, fn)
        finally:
            self.in_flight -= 1

    async def _in_worker(self, what: str, fn: Callable[[], T]) -> T:
        if self._abandoned >= self.workers:
            raise WorkersExhausted(f"all {self.workers} environment workers hang in calls")
        future: Future[T] = self._pool.submit(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except Exception as exc:
            if future.done() and not future.cancelled():  # `fn` raised it
                raised = future.exception() or exc
                if is_transient(raised):  # the code's own, not env_svc's Kafka or Redis
                    raise EnvCodeError(f"{what}: {type(raised).__name__}: {raised}") from raised
                raise
            if not isinstance(exc, TimeoutError):
                raise
        if not future.cancel():  # it started: it keeps its worker until it returns
            with self._lock:
                self._abandoned += 1
            future.add_done_callback(self._returned)
        log.error("%s: no answer after %.0fs; abandoned", what, self.timeout_s)
        raise EnvCallTimeout(f"{what}: no answer after {self.timeout_s:g}s")

    def _returned(self, _: Future[T]) -> None:
        with self._lock:
            self._abandoned -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
