"""Where a phase's CPU time went: per core (/proc/stat) and per process tree (/proc/<pid>/stat).

Linux only. A process's figure includes its live descendants (vLLM's engine core runs in a
child process), read at both ends of the phase; a descendant that started and ended inside
the phase is missed, which the per-core totals still catch.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


def core_busy_s() -> dict[int, float]:
    """Busy seconds (everything but idle and iowait) since boot, per core in this affinity."""
    mine = os.sched_getaffinity(0)
    busy: dict[int, float] = {}
    for line in (PROC / "stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        core = int(name[3:])
        if core in mine:
            ticks = [int(value) for value in fields]
            busy[core] = (sum(ticks[:8]) - ticks[3] - ticks[4]) / TICK  # minus idle, iowait
    return busy


@dataclass(frozen=True)
class _Stat:
    parent: int
    cpu_s: float
    """User + system seconds."""
    name: str
    """The command name (vLLM names its processes, e.g. `VLLM::Worker`)."""


def _stat(pid: int) -> _Stat | None:
    """One live process's parent, CPU seconds and name."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
    name = text[text.index("(") + 1 : text.rindex(")")]
    return _Stat(int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, name)


def _processes() -> tuple[dict[int, _Stat], dict[int, list[int]]]:
    """Every live process's stat, and each pid's children."""
    pids = [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]
    stats = {pid: stat for pid in pids if (stat := _stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, stat in stats.items():
        children.setdefault(stat.parent, []).append(pid)
    return stats, children


def cpu_s_by_name(root: int, root_name: str) -> dict[str, float]:
    """User + system seconds of `root` (as `root_name`) and of each live descendant, summed by
    command name."""
    stats, children = _processes()
    totals: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if (stat := stats.get(pid)) is not None:
            name = root_name if pid == root else stat.name
            totals[name] = totals.get(name, 0.0) + stat.cpu_s
        todo += children.get(pid, [])
    return totals


def tree_cpu_s(roots: dict[str, int]) -> dict[str, float]:
    """User + system seconds of each named process and its live descendants that are not
    themselves named (so this process can be one root and the servers it started others)."""
    stats, children = _processes()
    named = set(roots.values())
    totals: dict[str, float] = {}
    for name, root in roots.items():
        todo, total = [root], 0.0
        while todo:
            pid = todo.pop()
            if pid in stats:
                total += stats[pid].cpu_s
            todo += [child for child in children.get(pid, []) if child not in named]
        totals[name] = total
    return totals


@dataclass
class Snapshot:
    cores: dict[int, float]
    processes: dict[str, float]

    @classmethod
    def take(cls, roots: dict[str, int]) -> Snapshot:
        return cls(core_busy_s(), tree_cpu_s(roots))

    def since(self, before: Snapshot, wall_s: float) -> dict[str, Any]:
        """Busy share of each core and CPU seconds of each process between two snapshots."""
        processes = {k: v - before.processes.get(k, 0.0) for k, v in self.processes.items()}
        cores = {k: v - before.cores.get(k, 0.0) for k, v in self.cores.items()}
        return {
            "cpu_s": round(sum(cores.values()), 1),
            "core_busy_share": {str(k): round(v / wall_s, 3) for k, v in sorted(cores.items())},
            "process_cpu_s": {k: round(v, 1) for k, v in processes.items()},
            "process_cpu_share": {k: round(v / wall_s, 3) for k, v in processes.items()},
            "unaccounted_cpu_s": round(sum(cores.values()) - sum(processes.values()), 1),
        }


@dataclass
class Timeline:
    """Each core's busy share and each named process tree's CPU share, per interval of a
    phase: where the idle time of `Snapshot.since`'s totals fell."""

    roots: dict[str, int]
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        self.at_s: list[float] = []
        self.cores: dict[str, list[float]] = {}
        self.processes: dict[str, list[float]] = {}

    async def run(self) -> None:
        """Sample until cancelled."""
        started = last_at = time.monotonic()
        last = Snapshot.take(self.roots)
        while True:
            await asyncio.sleep(self.interval_s)
            now, snap = time.monotonic(), Snapshot.take(self.roots)
            shares = snap.since(last, now - last_at)
            self.at_s.append(round(now - started, 1))
            for core, share in shares["core_busy_share"].items():
                self.cores.setdefault(core, []).append(share)
            for name, share in shares["process_cpu_share"].items():
                self.processes.setdefault(name, []).append(share)
            last, last_at = snap, now

    def to_json(self) -> dict[str, object]:
        return {
            "at_s": self.at_s,
            "core_busy_share": self.cores,
            "process_cpu_share": self.processes,
        }
