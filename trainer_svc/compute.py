"""The one thread the trainer's model runs on, and the cores it borrows while they idle.

On one machine the embedded stack gives the rollout engine half the cores and the trainer the
other half (common/cores.py), and the trainer is the busier: in the 8-job run on 2 cores its
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

A second pass instead of a second thread: when a step has several jobs, one of them can run
its own pass on the lent cores at the same time (`second_pass`), each pass on one thread.
Two passes at once did two jobs' steps 1.85x as fast as one thread, one pass on two threads
1.61x (bench/results/trainer-threads-profile-20261206-cpu2-avx2.txt): a matmul split over
two threads does not scale as well as two matmuls. That pass runs on `LentPass`'s thread,
pinned to the lent cores while others leave them idle and moved to the trainer's own cores
(sharing them with the compute thread) as soon as they do not; its time on the lent cores
is the trainer's own in the borrowing decision, like the helpers'.
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar

from common.cores import format_cores

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
        self._decide_lock = threading.Lock()
        self.second_pass = LentPass(self) if self.lent else None
        """Runs a pass on the lent cores beside the compute thread's; None when none are lent."""

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
        if self.second_pass is not None:
            self.second_pass.shutdown()

    def lent_idle(self) -> bool:
        """Whether others leave the lent cores idle now (a fresh look; any thread)."""
        if not self.lent:
            return False
        self._decide()
        return self._borrowing

    def adjust(self) -> int:
        """Sets and returns the OpenMP threads of what the compute thread runs next; the
        policy calls it before each layer. Elsewhere it changes nothing."""
        import torch

        if self.second_pass is not None and self.second_pass.on_its_thread():
            return self.second_pass.adjust()
        if self._ident is not None and threading.get_ident() != self._ident:
            return int(torch.get_num_threads())
        self.calls += 1
        if self.lent:
            self._decide()
        lent_free = self._borrowing and not (self.second_pass and self.second_pass.busy)
        threads = self.threads + (len(self.lent) if lent_free else 0)
        self.borrowed_calls += lent_free
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def _decide(self) -> None:
        """Borrow while others left the lent cores idle over about the last `WINDOW_S`."""
        with self._decide_lock:  # the compute thread, the lent pass's and the service's
            self._decide_locked()

    def _decide_locked(self) -> None:
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
        ours = _thread_ticks(self._helpers)
        if self.second_pass is not None:
            ours += self.second_pass.ticks_on_lent()
        return _Look(time.monotonic(), _busy_ticks(self.lent), ours)


class LentPass:
    """One thread that runs a pass on the lent cores beside the compute thread's pass, with
    one OpenMP thread per lent core while others leave them idle, else on the trainer's own
    cores with one (decided, like the compute thread's threads, before each layer)."""

    def __init__(self, owner: ComputeThread) -> None:
        self._owner = owner
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="trainer-lent-pass", initializer=self._start
        )
        self._ident: int | None = None
        self._tid: int | None = None
        self._on_lent = False
        self._ticks_before = 0
        """Ticks this thread spent on the lent cores before its current placement."""
        self._placed_at_ticks = 0
        """Its ticks when it was last placed on the lent cores."""
        self.busy = False
        self.passes = 0

    def available(self) -> bool:
        """Whether a pass submitted now would start at once (on the lent cores while others
        leave them idle, else on the trainer's own beside the compute thread's pass)."""
        return not self.busy

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        """Run `fn` (a pass) on this thread; `busy` until it returns."""
        self.busy = True
        self.passes += 1
        return self._executor.submit(self._run, fn)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def on_its_thread(self) -> bool:
        return self._ident is not None and threading.get_ident() == self._ident

    def adjust(self) -> int:
        """On this thread, before a layer: the lent cores while others leave them idle, else
        the trainer's own (where the compute thread runs too); returns its threads."""
        import torch

        self._place(self._owner.lent_idle())
        threads = len(self._owner.lent) if self._on_lent else 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def ticks_on_lent(self) -> int:
        """User + system ticks this thread spent on the lent cores (the borrowing decision
        counts them as the trainer's, not as others')."""
        if self._tid is None:
            return 0
        if not self._on_lent:
            return self._ticks_before
        return self._ticks_before + _thread_ticks([self._tid]) - self._placed_at_ticks

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            self.adjust()
            fn()
        finally:
            self.busy = False

    def _place(self, on_lent: bool) -> None:
        if on_lent == self._on_lent:
            return
        assert self._tid is not None
        ticks = _thread_ticks([self._tid])
        if on_lent:
            self._placed_at_ticks = ticks
        else:
            self._ticks_before += ticks - self._placed_at_ticks
        os.sched_setaffinity(0, self._owner.lent if on_lent else self._owner.own)
        self._on_lent = on_lent

    def _start(self) -> None:
        self._ident = threading.get_ident()
        self._tid = threading.get_native_id()
        os.sched_setaffinity(0, self._owner.own)


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
