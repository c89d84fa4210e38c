"""The one thread the trainer's model runs on, and the cores it borrows while they idle.

On one machine the embedded stack gives the rollout engine half the cores and the trainer the
other half (common/runtime/cores.py), and the trainer is the busier: in the 8-job run on 2 cores its
core was busy 93% of the time, the engine's 52% (bench/results/multitask-8x4-20261204-
cpu2-avx2.json). While the engine idles, a second trainer thread on its core makes a step
x1.4 faster (`cores-20261204-cpu2-avx2.json`); while it generates, that thread halves both.
So the trainer may be lent cores (`TRAINER_BORROW_CORES`, the engine's in the embedded stack)
and adds one OpenMP thread per lent core while other processes keep those cores less than
`BORROW_BELOW` busy over the last `WINDOW_S` (/proc/stat, less the trainer's own helper
threads): an idle engine keeps its core 5-15% busy, a generating one 100%, in runs of
seconds. The policy asks before each of its layers, forward and backward (`adjust`): a
pass of a long multi-turn step runs for seconds, and deciding once per pass on the time since
the last one left the engine's core idle for 10 s at a time, or shared with a generating
engine (bench/README.md, "The trainer's borrowed core, decided per layer").

Placement is what makes this work, and it needs one thread: OpenMP's thread count and its
helper threads belong to the thread that runs the parallel regions. Every model call runs on
`ComputeThread`'s single thread, pinned to the trainer's own cores, so a pass on one thread
never lands on a lent core. Its OpenMP helpers are started once, while the thread is briefly
allowed the lent cores too, and keep that wider mask: when they run, the scheduler puts them
where the pinned thread is not.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar

from common.runtime.cores import format_cores

log = logging.getLogger(__name__)

BORROW_BELOW = 0.3
"""Borrow while other processes kept the lent cores busy less than this share of the time."""
WINDOW_S = 0.5
"""The decision looks this far back: long enough to count (50 ticks of 10 ms), short enough
that an engine starting or stopping shows in well under a second."""
MIN_WINDOW_S = 0.2
"""Shorter windows keep the last choice (a tick is 10 ms; fewer say little)."""
LOOK_EVERY_S = 0.05
"""Calls closer together than this keep the last choice without reading /proc."""
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class _Look:
    at: float
    core_busy: int
    """Busy ticks of the lent cores, all processes (/proc/stat)."""
    helpers: int
    """Ticks of this process's OpenMP helper threads."""


class ComputeThread:
    """Runs the model's calls one at a time on one thread; says how many OpenMP threads what
    it runs next may use."""

    def __init__(self, own: set[int], lent: set[int], threads: int) -> None:
        """`own`: the cores the trainer runs on (empty: whatever the process may use);
        `lent`: cores it may add threads on while others leave them idle; `threads`: the
        OpenMP threads of a pass on its own cores (0: one per own core)."""
        self.own = own or os.sched_getaffinity(0)
        self.lent = lent - self.own
        self.threads = threads or len(self.own)
        self._helpers: set[int] = set()
        self._looks: deque[_Look] = deque()
        self._borrowing = False
        self._ident: int | None = None
        self.calls = 0
        self.borrowed_calls = 0
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="trainer-compute", initializer=self._start
        )

    async def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`fn(*args, **kwargs)` on the compute thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`fn(*args, **kwargs)` on the compute thread, waited for (for callers without an
        event loop)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def adjust(self) -> int:
        """Sets and returns the OpenMP threads of what the compute thread runs next; the
        policy calls it before each layer. Elsewhere it changes nothing."""
        import torch

        if self._ident is not None and threading.get_ident() != self._ident:
            return int(torch.get_num_threads())
        self.calls += 1
        if self.lent:
            self._decide()
        threads = self.threads + (len(self.lent) if self._borrowing else 0)
        self.borrowed_calls += self._borrowing
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def _decide(self) -> None:
        """Borrow while others left the lent cores idle over about the last `WINDOW_S`."""
        looks = self._looks
        if looks and time.monotonic() - looks[-1].at < LOOK_EVERY_S:
            return
        look = self._look()
        looks.append(look)
        # Keep one look at least WINDOW_S old as the window's start, none older.
        while len(looks) > 2 and look.at - looks[1].at >= WINDOW_S:
            looks.popleft()
        first = looks[0]
        if look.at - first.at < MIN_WINDOW_S:
            return
        others = (look.core_busy - first.core_busy) - (look.helpers - first.helpers)
        window = (look.at - first.at) * _TICKS_PER_S * len(self.lent)
        borrowing = max(0, others) / window < BORROW_BELOW
        if borrowing != self._borrowing:
            log.debug(
                "others kept cores %s %.0f%% busy: %s",
                format_cores(self.lent),
                100 * others / window,
                "borrowing" if borrowing else "giving back",
            )
        self._borrowing = borrowing

    def _start(self) -> None:
        """Thread initializer: start the OpenMP helpers with the lent cores allowed, then pin
        this thread to its own cores."""
        import torch

        if self.lent:
            before = _task_ids()
            os.sched_setaffinity(0, self.own | self.lent)
            torch.set_num_threads(self.threads + len(self.lent))
            torch.ones(1 << 22).mul_(2)  # large enough for a parallel region: starts the helpers
            self._helpers = _task_ids() - before
            log.info(
                "trainer computes on cores %s, borrowing %s while others leave them idle "
                "(%d helper threads)",
                format_cores(self.own),
                format_cores(self.lent),
                len(self._helpers),
            )
        os.sched_setaffinity(0, self.own)
        torch.set_num_threads(self.threads)
        self._ident = threading.get_ident()

    def _look(self) -> _Look:
        return _Look(time.monotonic(), _busy_ticks(self.lent), _thread_ticks(self._helpers))


def _task_ids() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/task")} - {threading.get_native_id()}


def _busy_ticks(cores: Iterable[int], stat: Path = Path("/proc/stat")) -> int:
    """Ticks `cores` spent on anything but idle and I/O wait since boot."""
    wanted = {f"cpu{core}" for core in cores}
    busy = 0
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if name in wanted:
            ticks = [int(field) for field in fields]
            busy += sum(ticks) - ticks[3] - ticks[4]  # idle, iowait
            # guest time is already in user time
            busy -= sum(ticks[8:10]) if len(ticks) >= 10 else 0
    return busy


def _thread_ticks(tids: Iterable[int]) -> int:
    """User + system ticks of this process's threads `tids` (gone ones count 0)."""
    total = 0
    for tid in tids:
        try:
            text = Path(f"/proc/self/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total
