"""The trainer's busy share, read from its step events: the seconds its steps computed per
second of wall time, over the last minute and since the first step began.

Each step event carries `step_s`, the job's share of the training pass it was in (a pass over
several jobs is split between them by trained tokens), so their sum is the trainer's compute
time without counting a shared pass twice. With several trainer replicas the share can pass 1:
it is in trainer replicas' time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.wire.messages import Event

RECENT_S = 60.0
"""The window of the "now" share."""
SEEN_KEPT = 100_000
"""Step events remembered by id (a redelivered one is not counted twice)."""


@dataclass(frozen=True)
class TrainerBusy:
    recent: float | None
    """Step seconds per second over the last `RECENT_S` (None: no step seen yet)."""
    since_first_step: float | None
    """The same since the first step seen began."""
    steps: int


class TrainerLoad:
    """Step events in, the trainer's busy share out."""

    def __init__(self) -> None:
        self._recent: deque[tuple[float, float]] = deque()
        """(finished at, step seconds) of the steps in the last `RECENT_S`."""
        self._seen: dict[str, None] = {}
        """Ids of the step events counted, oldest first (at most `SEEN_KEPT`)."""
        self._total_s = 0.0
        self._first_began: float | None = None
        self._steps = 0

    def add(self, event: Event) -> None:
        step_s = event.metrics.get("step_s")
        if event.event != "step" or step_s is None or event.event_id in self._seen:
            return
        self._seen[event.event_id] = None
        if len(self._seen) > SEEN_KEPT:
            del self._seen[next(iter(self._seen))]
        began = event.at - step_s
        self._first_began = began if self._first_began is None else min(self._first_began, began)
        self._total_s += step_s
        self._steps += 1
        self._recent.append((event.at, step_s))

    def busy(self, now: float) -> TrainerBusy:
        while self._recent and self._recent[0][0] < now - RECENT_S:
            self._recent.popleft()
        if self._first_began is None:
            return TrainerBusy(None, None, 0)
        window = min(RECENT_S, now - self._first_began)
        recent = sum(step_s for _, step_s in self._recent) / window if window > 0 else None
        since = now - self._first_began
        return TrainerBusy(recent, self._total_s / since if since > 0 else None, self._steps)
