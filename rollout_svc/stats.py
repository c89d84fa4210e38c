"""A rollout replica's engine numbers: Prometheus gauges and `stats:rollout:{replica}`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from common.runtime.backoff import is_transient
from common.runtime.metrics import ROLLOUT_BUSY_FRACTION, ROLLOUT_TOKENS_PER_SECOND
from common.state.store import RedisStore
from common.wire.lifecycle import RolloutReplicaStats
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
    ) -> None:
        self._engine = engine
        self._replica = replica
        self._max_model_len = max_model_len
        self._started_at = started_at
        self._last_at = time.monotonic()
        self._last_busy_s = 0.0
        self._last_tokens = 0

    def sample(self, now: float) -> RolloutReplicaStats:
        """The numbers at monotonic `now`; the gauges follow the last interval's rates."""
        engine = self._engine
        # Over the last interval, not since start: the dashboards' "now".
        busy_s, tokens = engine.busy_seconds, engine.generated_tokens
        interval = now - self._last_at
        recent_busy = (busy_s - self._last_busy_s) / interval if interval > 0 else 0.0
        recent_tokens_per_s = (tokens - self._last_tokens) / interval if interval > 0 else 0.0
        ROLLOUT_BUSY_FRACTION.set(recent_busy)
        ROLLOUT_TOKENS_PER_SECOND.set(recent_tokens_per_s)
        self._last_at, self._last_busy_s, self._last_tokens = now, busy_s, tokens
        uptime = now - self._started_at()
        return RolloutReplicaStats(
            busy_s=busy_s,
            uptime_s=uptime,
            utilisation=busy_s / uptime if uptime > 0 else 0.0,
            recent_utilisation=recent_busy,
            generated_tokens=float(tokens),
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
        self._last_at = time.monotonic()
        self._last_busy_s = self._engine.busy_seconds
        self._last_tokens = self._engine.generated_tokens
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
