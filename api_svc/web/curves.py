"""What the console's charts show: the report's curves (marlaas/report) of a tenant's latest
jobs, as the inline SVG the report draws, with each job's latest numbers beside them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from common.state.registry import JobRecord
from marlaas.report.charts import PALETTE, ChartSize
from marlaas.report.numbers import Report
from marlaas.report.page import charts

SHOWN = ("reward", "eval", "utilisation", "throughput")
"""Mean reward per step, held-out accuracy per evaluated version, the busy share over time of
the rollout engine and the trainer, and their tokens per second (the report's chart ids)."""
MAX_JOBS_CHARTED = len(PALETTE)
"""The latest jobs charted: each in a colour of its own."""
CONSOLE_SIZE = ChartSize(width=550, legend_width=190, min_height=280)
"""What a chart card of the console shows at 1280 pixels wide and up (two a row): drawn at
that size, its text keeps the size the report gives it."""


def charted(records: Sequence[JobRecord]) -> list[JobRecord]:
    """The `MAX_JOBS_CHARTED` latest of a tenant's jobs, newest first."""
    return sorted(records, key=lambda r: r.created_at, reverse=True)[:MAX_JOBS_CHARTED]


def console_charts(report: Report, *, left_out: int = 0) -> dict[str, Any]:
    """`charts`: each shown chart's SVG by id; `jobs`: each charted job's state, steps and
    rewards (JSON-safe: a reward that is not finite is null); `left_out`: older jobs not
    charted."""
    drawn = charts(report, CONSOLE_SIZE)
    return {
        "charts": {chart: drawn[chart] for chart in SHOWN},
        "jobs": {
            job.job_id: {
                "state": job.state,
                "steps": job.steps,
                "last_reward": _finite(job.last_reward),
                "best_reward": _finite(job.best_reward),
            }
            for job in report.jobs
        },
        "left_out": left_out,
    }


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
