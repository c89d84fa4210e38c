"""Records handled at once: at most `limit` in flight, records of one key one after the other.

A consumer that awaits each record before reading the next has one record in hand at a time:
an environment whose reward waits 1 s on a remote verifier then scores one episode a second,
whatever the replica's workers. `Dispatcher` runs each record's handling as a task
instead, up to a bound. Order is kept where the contract needs it: records of one partition
with the same key (a job's spec and its commands, an episode's turns) run in offset order; an
unkeyed record is ordered with the other unkeyed records of its partition. What may be
committed stays the consumer's business (common/bus/offsets.py: below the oldest unfinished).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable

from aiokafka.structs import TopicPartition

Work = Callable[[], Awaitable[None]]


class Dispatcher:
    """Runs record work as tasks, at most `limit` at once, in order per (partition, key)."""

    def __init__(self, limit: int, *, name: str) -> None:
        if limit < 1:
            raise ValueError(f"at least one record must be in flight, not {limit}")
        self.limit = limit
        self.name = name
        self.peak = 0
        """The most records in flight at once so far."""
        self._tasks: dict[asyncio.Task[None], TopicPartition] = {}
        self._tails: dict[tuple[TopicPartition, Hashable], asyncio.Task[None]] = {}
        self._finished = asyncio.Event()
        self._failure: BaseException | None = None

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def room(self, timeout_s: float) -> int:
        """Free slots, waiting up to `timeout_s` for one when all are taken (0 if none came).
        Raises what a record's work raised, so that the consumer fails as it used to."""
        self.raise_failure()
        if len(self._tasks) >= self.limit:
            self._finished.clear()
            try:
                await asyncio.wait_for(self._finished.wait(), timeout_s)
            except TimeoutError:
                pass
            self.raise_failure()
        return max(0, self.limit - len(self._tasks))

    def submit(self, tp: TopicPartition, key: Hashable, work: Work) -> None:
        """Start `work` once the record before it with the same partition and key is done."""
        order = (tp, key)
        before = self._tails.get(order)
        task = asyncio.create_task(self._after(before, work), name=f"{self.name}-{tp.partition}")
        self._tasks[task] = tp
        self._tails[order] = task
        self.peak = max(self.peak, len(self._tasks))
        task.add_done_callback(lambda done: self._done(done, order))

    def raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    async def drain(
        self,
        timeout_s: float,
        partitions: set[TopicPartition] | None = None,
        *,
        cancel: bool = True,
    ) -> int:
        """Wait up to `timeout_s` for the work of `partitions` (None: all) to finish; then
        cancel what is left (its records stay uncommitted: redelivered), or with `cancel`
        False let it run on. How many were left."""
        tasks = [t for t, tp in self._tasks.items() if partitions is None or tp in partitions]
        if not tasks:
            return 0
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        if cancel:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        return len(pending)

    async def _after(self, before: asyncio.Task[None] | None, work: Work) -> None:
        if before is not None and not before.done():
            await asyncio.wait([before])  # its outcome is its own; only the order matters here
        await work()

    def _done(self, task: asyncio.Task[None], order: tuple[TopicPartition, Hashable]) -> None:
        self._tasks.pop(task, None)
        if self._tails.get(order) is task:
            del self._tails[order]
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._failure = self._failure or exc
        self._finished.set()
