"""common.bus.offsets: commit positions never pass a held record."""

from __future__ import annotations

from common.bus.offsets import OffsetTracker


def test_commits_past_the_last_processed_record() -> None:
    tracker = OffsetTracker()
    assert tracker.committable() is None and tracker.due() is None
    for offset in (5, 6, 7):
        tracker.processed(offset)
    assert tracker.due() == 8
    tracker.committed(8)
    assert tracker.due() is None  # nothing new since the commit


def test_a_held_record_stops_the_commit_until_released() -> None:
    tracker = OffsetTracker()
    tracker.processed(10)
    tracker.hold(11)
    tracker.processed(11)
    tracker.hold(12)
    tracker.processed(12)
    tracker.processed(13)
    assert tracker.committable() == 11  # a restart re-reads 11 and 12
    tracker.release(12)
    assert tracker.committable() == 11
    tracker.release(11)
    assert tracker.committable() == 14
    assert tracker.held == 0


def test_position_never_moves_back_after_a_commit() -> None:
    tracker = OffsetTracker()
    tracker.processed(20)
    tracker.committed(21)
    tracker.hold(15)  # a stale hold from before a seek cannot move the commit back
    assert tracker.due() is None
    tracker.release(15)
    tracker.processed(21)
    assert tracker.due() == 22


def test_out_of_order_processing_keeps_the_highest_position() -> None:
    tracker = OffsetTracker()
    tracker.processed(9)
    tracker.processed(3)
    assert tracker.committable() == 10


def test_records_finishing_out_of_order_commit_below_the_oldest_unfinished() -> None:
    tracker = OffsetTracker()
    for offset in (20, 21, 22):
        tracker.started(offset)
    tracker.finished(22)
    tracker.finished(21)
    assert tracker.committable() == 20  # 20 is still in hand: a crash re-reads 20-22
    assert tracker.next_unprocessed == 20
    tracker.finished(20)
    assert tracker.committable() == 23


def test_a_record_never_finished_keeps_the_commit_below_it() -> None:
    """A record whose handling was cancelled at a stop is read again by the next owner,
    even though the records after it finished."""
    tracker = OffsetTracker()
    tracker.started(4)
    tracker.started(5)
    tracker.finished(5)
    assert tracker.due() == 4
