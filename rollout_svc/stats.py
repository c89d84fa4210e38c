"""A rollout replica's engine numbers: Prometheus gauges and `stats:rollout:{replica}`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from common.runtime.backoff import is_transient
from common.runtime.metrics import (
    ROLLOUT_BUSY_FRACTION,
    ROLLOUT_COMPUTE_FRACTION,
    ROLLOUT_MEAN_BATCH,
    ROLLOUT_TOKENS_PER_SECOND,
)
from common.state.store import RedisStore
from common.wire.lifecycle import RolloutReplicaStats
from rollout_svc.compute import EngineCompute
from rollout_svc.engine_protocol import GenerationEngine

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 5.0


class StatsReport:
    """Reports the engine's numbers every `STATS_INTERVAL_S`, over the last interval and since
    the replica started (`started_at`, monotonic)."""

    def __init__(
        self,
        engine: GenerationEngine,
        replica: str,
        max_model_len: int,
        started_at: Callable[[], float],
        compute: EngineCompute | None = None,
    ) -> None:
        self._engine = engine
        self._replica = replica
        self._max_model_len = max_model_len
        self._started_at = started_at
        self._compute = compute or EngineCompute()
        # Both set by the first reading, not here: the replica builds this before its engine
        # starts, and the meter decides CPU or GPU once the engine has.
        self._compute_at_start: float | None = None
        self._last: _Counters | None = None

    def _counters(self, now: float) -> _Counters:
        compute_s = self._compute.seconds()
        if self._compute_at_start is None:
            self._compute_at_start = compute_s
        if compute_s is not None and self._compute_at_start is not None:
            compute_s -= self._compute_at_start  # since the replica started, as uptime
        engine = self._engine
        return _Counters(
            now, engine.busy_seconds, engine.request_seconds, engine.generated_tokens, compute_s
        )

    def sample(self, now: float) -> RolloutReplicaStats:
        """The numbers at monotonic `now`; the gauges follow the last interval's rates."""
        engine = self._engine
        counters = self._counters(now)
        last = self._last or counters
        # Over the last interval, not since start: the dashboards' "now".
        interval = now - last.at
        slots = self._compute.slots
        recent_busy = _per(counters.busy_s - last.busy_s, interval) or 0.0
        recent_tokens_per_s = _per(counters.tokens - last.tokens, interval) or 0.0
        recent_compute = None
        if counters.compute_s is not None and last.compute_s is not None:
            recent_compute = _per(counters.compute_s - last.compute_s, interval * slots)
        ROLLOUT_BUSY_FRACTION.set(recent_busy)
        ROLLOUT_TOKENS_PER_SECOND.set(recent_tokens_per_s)
        mean_batch = _per(counters.request_s - last.request_s, counters.busy_s - last.busy_s)
        if recent_compute is not None:
            ROLLOUT_COMPUTE_FRACTION.set(recent_compute)
        ROLLOUT_MEAN_BATCH.set(mean_batch or 0.0)
        self._last = counters
        uptime = now - self._started_at()
        return RolloutReplicaStats(
            busy_s=counters.busy_s,
            compute_s=counters.compute_s,
            compute_slots=float(slots),
            request_s=counters.request_s,
            uptime_s=uptime,
            utilisation=_per(counters.busy_s, uptime) or 0.0,
            recent_utilisation=recent_busy,
            compute_utilisation=(
                None if counters.compute_s is None else _per(counters.compute_s, uptime * slots)
            ),
            recent_compute_utilisation=recent_compute,
            mean_batch=mean_batch,
            generated_tokens=float(counters.tokens),
            prompt_tokens=float(engine.prompt_tokens),
            cached_prompt_tokens=float(engine.cached_prompt_tokens),
            preemptions=float(engine.preemptions),
            tokens_per_s=recent_tokens_per_s,
            in_flight=float(engine.in_flight),
            max_model_len=float(self._max_model_len),
        )

    async def run(
        self,
        store: RedisStore,
        stopping: asyncio.Event,
        after_each: Callable[[float], Awaitable[None]],
    ) -> None:
        """Report until `stopping`; `after_each(now)` runs after every report."""
        # From here, as uptime: the engine's start-up (loading the model) is not its work.
        self._compute_at_start = None
        self._last = self._counters(time.monotonic())
        while not stopping.is_set():
            now = time.monotonic()
            stats = self.sample(now)
            try:
                await store.replicas.put_stats(self._replica, stats, ttl_s=60)
            except Exception as exc:  # telemetry: a Redis restart skips a report, no more
                if not is_transient(exc):
                    raise
                log.warning(
                    "rollout stats not published (%r); next try in %.0fs", exc, STATS_INTERVAL_S
                )
            await after_each(now)
            try:
                await asyncio.wait_for(stopping.wait(), STATS_INTERVAL_S)
            except TimeoutError:
                pass


@dataclass(frozen=True)
class _Counters:
    """The engine's counters at one instant (monotonic `at`)."""

    at: float
    busy_s: float
    request_s: float
    tokens: int
    compute_s: float | None


def _per(amount: float, over: float) -> float | None:
    """`amount / over`, or None over nothing."""
    return amount / over if over > 0 else None
