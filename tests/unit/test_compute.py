"""The trainer's compute thread: where its passes run and when it borrows lent cores."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from trainer_svc import compute
from trainer_svc.compute import MIN_WINDOW_S, WINDOW_S, ComputeThread, _busy_ticks, _Look

TICKS = os.sysconf("SC_CLK_TCK")


def _affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_passes_run_pinned_and_the_helpers_may_use_the_lent_core() -> None:
    own, lent = sorted(os.sched_getaffinity(0))[-1:], sorted(os.sched_getaffinity(0))[:1]
    thread = ComputeThread(set(own), set(lent), 1)

    def placement() -> tuple[int, set[int], int]:
        return thread.adjust(), _affinity(0), torch.get_num_threads()

    try:
        threads, where, torch_threads = asyncio.run(thread.run(placement))
        # The first look only starts the window: one thread, on the trainer's own core.
        assert (threads, where, torch_threads) == (1, set(own), 1)
        assert thread._helpers, "the OpenMP helpers were started"
        for tid in thread._helpers:
            assert set(lent) <= _affinity(tid)
    finally:
        thread.shutdown()


def _scripted(
    monkeypatch: pytest.MonkeyPatch, looks: list[tuple[float, int, int]]
) -> ComputeThread:
    """A thread whose looks at /proc are `looks`: (seconds, busy ticks of the lent core,
    ticks of its own helpers), one per call of `adjust`."""
    thread = ComputeThread({1}, {0}, 1)
    scripted = iter(looks)
    monkeypatch.setattr(thread, "_look", lambda: _Look(*next(scripted)))
    monkeypatch.setattr(compute, "LOOK_EVERY_S", 0.0)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this is pytest's thread
    return thread


def test_it_borrows_while_others_leave_the_lent_core_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    thread = _scripted(
        monkeypatch,
        [
            (0.0, 0, 0),
            (1.0, round(0.1 * TICKS), 0),  # others 10%: borrow
            (1.1, round(0.2 * TICKS), 0),  # (0, 1.1]: others 18%: still
            (2.0, round(1.1 * TICKS), round(0.5 * TICKS)),  # (1.1, 2.0]: others 44%: back
            (3.0, round(1.4 * TICKS), round(0.5 * TICKS)),  # (2.0, 3.0]: others 30%: no
            (4.0, round(1.6 * TICKS), round(0.5 * TICKS)),  # (3.0, 4.0]: others 20%: borrow
        ],
    )
    try:
        assert [thread.adjust() for _ in range(6)] == [1, 2, 2, 1, 1, 2]
        assert (thread.calls, thread.borrowed_calls) == (6, 3)
    finally:
        thread.shutdown()


def test_it_decides_on_the_last_half_second_not_on_the_whole_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine busy for 10 s that stops for 5 and starts again, looked at every 0.1 s: the
    trainer borrows within a window of the stop (not once the mean since some earlier look
    falls) and gives the core back within one of the restart."""

    def engine_s(at: float) -> float:  # busy, then 10% busy (an idle engine's polling), busy
        return min(at, 10.0) + 0.1 * min(max(0.0, at - 10.0), 5.0) + max(0.0, at - 15.0)

    at_s = [index / 10 for index in range(201)]
    thread = _scripted(monkeypatch, [(at, round(engine_s(at) * TICKS), 0) for at in at_s])
    try:
        borrowed = [at for at in at_s if thread.adjust() == 2]
        assert borrowed, "it never borrowed"
        assert 10.0 < borrowed[0] <= 10.0 + WINDOW_S
        assert 15.0 - WINDOW_S < borrowed[-1] < 15.0 + WINDOW_S
        assert borrowed == [at for at in at_s if borrowed[0] <= at <= borrowed[-1]]
    finally:
        thread.shutdown()


def test_a_short_window_keeps_the_last_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until a window spans MIN_WINDOW_S the trainer keeps to its own cores."""
    thread = _scripted(monkeypatch, [(0.0, 0, 0), (MIN_WINDOW_S / 2, 0, 0), (MIN_WINDOW_S, 0, 0)])
    try:
        assert [thread.adjust() for _ in range(3)] == [1, 1, 2]
    finally:
        thread.shutdown()


def test_nothing_lent_means_its_own_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this is pytest's thread
    thread = ComputeThread({0}, {0}, 3)  # a core of its own is not lent
    assert not thread.lent
    assert thread.adjust() == 3
    thread.shutdown()


def test_busy_ticks_leave_out_idle_iowait_and_guest(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(
        "cpu  50 0 20 900 10 0 0 0 0 0\n"
        "cpu0 30 1 10 400 5 2 3 0 7 0\n"
        "cpu1 20 0 10 500 5 0 0 0 0 0\n"
    )
    # Guest time is already in user time.
    assert _busy_ticks({0}, stat) == 30 + 1 + 10 + 2 + 3 + 0
    assert _busy_ticks({0, 1}, stat) == 46 + 30
    assert compute._busy_ticks({5}, stat) == 0
