"""Environment and reward code off the event loop, each call with a time limit.

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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from common.backoff import is_transient
from env_svc.episodes import EpisodeError

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

    @property
    def abandoned(self) -> int:
        """Calls that timed out and still hold a worker."""
        return self._abandoned

    async def run(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` in a worker; raises `EnvCallTimeout` after `timeout_s`, or what `fn` raised."""
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
