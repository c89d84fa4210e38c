"""common.offsets: commit positions never pass a held record."""

from __future__ import annotations

from common.offsets import OffsetTracker


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
