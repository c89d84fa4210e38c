"""What a consumer tells of its work: the `marlaas_*` consumer metrics of each topic, the lag
gauges, and a periodic log line of how many records of each topic this replica handled (so a
log shows each replica's share of the work)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

from common.bus.commits import PartitionLag
from common.runtime.metrics import ConsumerMetrics, consumer_metrics

log = logging.getLogger(__name__)


class ConsumerTelemetry:
    """The consumer metrics and activity line of one service's consumer."""

    def __init__(
        self,
        service: str,
        topics: Iterable[str],
        *,
        lag_interval_s: float,
        activity_interval_s: float,
    ) -> None:
        self.service = service
        self._lag_interval_s = lag_interval_s
        self._activity_interval_s = activity_interval_s
        self._handled: Counter[str] = Counter()
        self._activity_since = time.monotonic()
        self._metrics = {str(topic): consumer_metrics(service, str(topic)) for topic in topics}

    def metrics_for(self, topic: str) -> ConsumerMetrics:
        if (metrics := self._metrics.get(topic)) is None:
            metrics = self._metrics[topic] = consumer_metrics(self.service, topic)
        return metrics

    def handled(self, topic: str) -> None:
        """One record of `topic` was handled (for the activity line)."""
        self._handled[topic] += 1

    def log_activity(self, now: float | None = None) -> None:
        """Log what was handled since the last line, once `activity_interval_s` has passed
        (nothing when idle)."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._activity_since
        if elapsed < self._activity_interval_s:
            return
        if self._handled:
            counts = ", ".join(f"{n} {topic}" for topic, n in sorted(self._handled.items()))
            log.info("%s: handled %s in the last %.0f s", self.service, counts, elapsed)
        self._handled.clear()
        self._activity_since = now

    async def export_lag(self, lag: Callable[[], Awaitable[list[PartitionLag]]]) -> None:
        """Set the lag gauge of every consumed topic from `lag` now and every `lag_interval_s`,
        and log the activity line when due.

        Telemetry only: a failed refresh keeps the last values and is retried; the poll
        loop itself reports an unreachable broker.
        """
        while True:
            try:
                partitions = await asyncio.wait_for(lag(), self._lag_interval_s)
            except Exception as exc:
                log.debug("%s: consumer lag not refreshed: %r", self.service, exc)
            else:
                self._set_lag(partitions)
            self.log_activity()
            await asyncio.sleep(self._lag_interval_s)

    def _set_lag(self, partitions: list[PartitionLag]) -> None:
        # A topic this replica owns no partition of (any more) reads 0.
        lag_by_topic = dict.fromkeys(self._metrics, 0)
        for partition in partitions:
            lag_by_topic[partition.topic] = lag_by_topic.get(partition.topic, 0) + partition.lag
        for topic, lag in lag_by_topic.items():
            self.metrics_for(topic).lag.set(lag)
