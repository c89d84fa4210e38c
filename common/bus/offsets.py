"""Where a consumer may commit a partition: after every processed record, before every held one
and every one still in flight.

A handler may hold a record it accepted but whose work is not yet durable (the
trainer holds trajectories until their group is trained); the partition's
commit position then stops at the oldest held record, so a crash redelivers it. Records
handled at once (common/bus/dispatch.py) finish in any order: the position stops at the oldest
unfinished one, and a record whose handling was abandoned (cancelled at a stop) stays
unfinished, so it is read again.
"""

from __future__ import annotations


class OffsetTracker:
    """Commit bookkeeping of one assigned partition (pure logic, no I/O)."""

    def __init__(self) -> None:
        self._next_unprocessed: int | None = None
        self._held: set[int] = set()
        self._in_flight: set[int] = set()
        self._committed: int | None = None

    def processed(self, offset: int) -> None:
        """The record at `offset` was handled (durably, or held)."""
        if self._next_unprocessed is None or offset + 1 > self._next_unprocessed:
            self._next_unprocessed = offset + 1

    def started(self, offset: int) -> None:
        """The record at `offset` is being handled."""
        self._in_flight.add(offset)

    def finished(self, offset: int) -> None:
        """The record at `offset`, started before, was handled (durably, or held)."""
        self._in_flight.discard(offset)
        self.processed(offset)

    def hold(self, offset: int) -> None:
        self._held.add(offset)

    def release(self, offset: int) -> None:
        self._held.discard(offset)

    @property
    def next_unprocessed(self) -> int | None:
        """The oldest record started and not finished; else the offset after the last record
        handled here; None before the first."""
        if self._in_flight:
            return min(self._in_flight)
        return self._next_unprocessed

    @property
    def held(self) -> int:
        return len(self._held)

    def committable(self) -> int | None:
        """The offset to commit (the next record to read after a restart), or None."""
        if self._held or self._in_flight:
            return min(self._held | self._in_flight)
        return self._next_unprocessed

    def due(self) -> int | None:
        """The committable offset if it moved past the last commit, else None."""
        position = self.committable()
        if position is None or (self._committed is not None and position <= self._committed):
            return None
        return position

    def committed(self, offset: int) -> None:
        self._committed = offset
