"""The trainer's compute thread: where its passes run and when it borrows lent cores."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from trainer_svc import compute
from trainer_svc.compute import MIN_WINDOW_S, ComputeThread, _busy_ticks, _Look

TICKS = os.sysconf("SC_CLK_TCK")


def _affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_passes_run_pinned_and_the_helpers_may_use_the_lent_core() -> None:
    own, lent = sorted(os.sched_getaffinity(0))[-1:], sorted(os.sched_getaffinity(0))[:1]
    thread = ComputeThread(set(own), set(lent), 1)

    def placement() -> tuple[int, set[int], int]:
        return thread.threads_for_next_pass(), _affinity(0), torch.get_num_threads()

    try:
        threads, where, torch_threads = asyncio.run(thread.run(placement))
        # The first look only starts the window: one thread, on the trainer's own core.
        assert (threads, where, torch_threads) == (1, set(own), 1)
        assert thread._helpers, "the OpenMP helpers were started"
        for tid in thread._helpers:
            assert set(lent) <= _affinity(tid)
    finally:
        thread.shutdown()


def test_it_borrows_while_others_leave_the_lent_core_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scripted looks: (seconds, busy ticks of the lent core, ticks of the own helpers)."""
    looks = iter(
        [
            (0.0, 0, 0),
            (1.0, round(0.1 * TICKS), 0),  # others 10%: borrow
            (1.0 + MIN_WINDOW_S / 2, 10 * TICKS, 0),  # too short a window: keep borrowing
            (2.0, round(1.1 * TICKS), round(0.5 * TICKS)),  # others 50% beside our helper: back
            (3.0, round(1.4 * TICKS), round(0.5 * TICKS)),  # others 30%: not below the line
            (4.0, round(1.6 * TICKS), round(0.5 * TICKS)),  # others 20%: borrow
        ]
    )
    thread = ComputeThread({1}, {0}, 1)
    monkeypatch.setattr(thread, "_look", lambda: _Look(*next(looks)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this is pytest's thread
    try:
        assert [thread.threads_for_next_pass() for _ in range(6)] == [1, 2, 2, 1, 1, 2]
        assert (thread.passes, thread.borrowed_passes) == (6, 3)
    finally:
        thread.shutdown()


def test_nothing_lent_means_its_own_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this is pytest's thread
    thread = ComputeThread({0}, {0}, 3)  # a core of its own is not lent
    assert not thread.lent
    assert thread.threads_for_next_pass() == 3
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
