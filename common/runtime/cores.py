"""CPU core lists as Linux and vLLM write them ("0-3,6"), and the split of one machine's cores
between the rollout engine and the trainer.

Measured on the 2-core reference machine (bench/results/cores-20261203-cpu2.json): while the
engine generates, a trainer on torch's default threads (one per core) shares the engine's
core, and both slow down (trainer 4.34 s/step, engine 58 tok/s); the trainer on one thread
pinned to the other core takes 2.39 s/step and leaves the engine 110 tok/s. Only while the
engine idles do the trainer's two threads pay (1.65 vs 2.43 s/step): then the trainer
borrows the engine's core (trainer_svc/compute.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def parse_cores(spec: str) -> set[int]:
    """ "0-3,6" -> {0, 1, 2, 3, 6}; raises ValueError with the reason on anything else."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"bad CPU core list {spec!r}: {part!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU core list {spec!r}: {part!r} is not an ascending range")
        cores.update(range(first, last + 1))
    return cores


def format_cores(cores: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    ordered = sorted(set(cores))
    parts: list[str] = []
    start = previous = None
    for core in [*ordered, None]:
        if core is not None and previous is not None and core == previous + 1:
            previous = core
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = core
    return ",".join(parts)


def engine_trainer_split(cores: Iterable[int]) -> tuple[list[int], list[int]] | None:
    """The first half of `cores` (at least one) for the engine, the rest for the trainer;
    None when there is only one core to share."""
    ordered = sorted(set(cores))
    if len(ordered) < 2:
        return None
    half = max(1, len(ordered) // 2)
    return ordered[:half], ordered[half:]


def pin_to_cores(spec: str, threads: int = 0) -> int:
    """Bind this process to the cores of `spec` (empty: leave it), before it starts threads
    (they inherit it); returns the threads to run: `threads`, or when 0 one per such core."""
    if spec:
        os.sched_setaffinity(0, parse_cores(spec))
    return threads or len(os.sched_getaffinity(0))
