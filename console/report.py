"""`marlaas report`: one self-contained HTML page (inline SVG charts) + the numbers as CSV/JSON.

Pure: it turns events (`marlaas.events`) and rollout replica stats history (Redis) into a
report; reading them is `console.client`'s job. Every chart carries its exact numbers
(`data-values` on each series), so the page can be checked by parsing it.
"""

from __future__ import annotations

import csv
import html
import itertools
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from common.lifecycle import (
    DROPPED_EVENTS,
    REPLICA_COUNTERS,
    JobLifecycle,
    RolloutReplicaStats,
    StepMetrics,
)
from common.messages import Event, JobSpec
from console.svgchart import Point, Series, is_number, line_chart, plottable

RESTART_SLACK_S = 1.0
"""How much shorter than the gap between two samples the uptime may be (sampling jitter)
before the process is taken to have started in between."""


@dataclass
class JobSummary:
    job_id: str
    tenant: str
    env: str
    """From the job's spec; "-" when the report was given none."""
    state: str
    """After the job's last lifecycle event; "pending" when it has none yet."""
    steps: int
    """Highest step number trained."""
    max_steps: int | None
    first_reward: float | None
    last_reward: float | None
    best_reward: float | None
    max_staleness: float | None
    dropped_groups: int
    reason: str
    """Why it was rejected or failed; empty in any other state."""
    first_at: float | None
    last_at: float | None
    wall_s: float | None
    """From the job's first event to its last."""


@dataclass
class StepRow:
    job_id: str
    tenant: str
    step: int
    at: float
    elapsed_s: float
    """Since the job's first event."""
    mean_reward: float | None = None
    staleness_max: float | None = None
    staleness_mean: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    tokens: float | None = None
    samples: float | None = None
    step_s: float | None = None
    wall_step_s: float | None = None
    trainer_tokens_per_s: float | None = None
    """tokens / step_s, when the step reported both."""


STEP_COLUMNS = tuple(f.name for f in fields(StepRow) if f.name in StepMetrics.names())
"""The `StepMetrics` of a trainer `step` event copied into each step row (absent: None)."""


@dataclass
class UtilisationRow:
    replica: str
    segment: int
    """Which run of the replica process: 0, then one more after each restart."""
    at: float
    """End of the interval (the later of its two samples)."""
    elapsed_s: float
    """Since the report's start (its earliest event or sample)."""
    utilisation: float | None
    """Busy share of the interval: Δbusy_s / Δuptime_s, within [0, 1]."""
    tokens_per_s: float | None
    """Δgenerated_tokens / Δat over the interval."""
    in_flight: float | None
    """Requests in the engine at the interval's end."""


@dataclass
class Report:
    title: str
    generated_at: float
    started_at: float | None
    """Earliest event or replica sample: time zero of the charts over time."""
    jobs: list[JobSummary] = field(default_factory=list)
    steps: list[StepRow] = field(default_factory=list)
    utilisation: list[UtilisationRow] = field(default_factory=list)


def build_report(
    events: Sequence[Event],
    replica_history: Mapping[str, Sequence[RolloutReplicaStats]] | None = None,
    *,
    specs: Mapping[str, JobSpec] | None = None,
    title: str = "MARLaaS report",
    generated_at: float | None = None,
) -> Report:
    """The report of the jobs in `events` (and `specs`), with the replicas' utilisation.

    Events may come in any order and more than once (a redelivery keeps its `event_id`).
    """
    specs = specs or {}
    by_job = _events_by_job(events, specs)
    histories = {
        name: _timed_samples([s.as_map() for s in samples])
        for name, samples in (replica_history or {}).items()
    }
    report = Report(
        title,
        time.time() if generated_at is None else generated_at,
        _started_at(by_job, histories),
    )
    for job_id, job_events in by_job.items():
        spec = specs.get(job_id)
        tenant = spec.tenant if spec else next((e.tenant for e in job_events if e.tenant), "-")
        rows = _step_rows(tenant, job_events)
        report.jobs.append(_job_summary(job_id, tenant, spec, job_events, rows))
        report.steps += rows
    for replica, samples in sorted(histories.items()):
        report.utilisation += _utilisation_rows(replica, samples, report.started_at or 0.0)
    return report


# --- jobs -------------------------------------------------------------------------------


def _events_by_job(events: Sequence[Event], specs: Mapping[str, JobSpec]) -> dict[str, list[Event]]:
    """Each job's events, de-duplicated on `event_id`, in time order; spec'd jobs first."""
    unique = sorted({e.event_id: e for e in events}.values(), key=lambda e: e.at)
    by_job: dict[str, list[Event]] = {job_id: [] for job_id in specs}
    for event in unique:
        by_job.setdefault(event.job_id, []).append(event)
    return by_job


def _started_at(
    by_job: Mapping[str, Sequence[Event]], histories: Mapping[str, Sequence[Mapping[str, float]]]
) -> float | None:
    firsts = [job_events[0].at for job_events in by_job.values() if job_events]
    firsts += [samples[0]["at"] for samples in histories.values() if samples]
    return min(firsts, default=None)


def _step_rows(tenant: str, job_events: Sequence[Event]) -> list[StepRow]:
    latest: dict[int, Event] = {}
    for event in job_events:
        if event.event == "step":
            # A step sent again under a new id was trained again (the trainer resumed from a
            # checkpoint): the later one is the adapter the following steps built on.
            latest[event.step] = event
    first_at = job_events[0].at if job_events else 0.0
    return [_step_row(event, tenant, first_at) for _, event in sorted(latest.items())]


def _step_row(event: Event, tenant: str, first_at: float) -> StepRow:
    metrics = event.metrics
    row = StepRow(
        event.job_id,
        tenant,
        event.step,
        event.at,
        event.at - first_at,
        **{name: metrics.get(name) for name in STEP_COLUMNS},
    )
    row.trainer_tokens_per_s = StepMetrics.of(metrics).trainer_tokens_per_s
    return row


def _job_summary(
    job_id: str,
    tenant: str,
    spec: JobSpec | None,
    job_events: Sequence[Event],
    rows: Sequence[StepRow],
) -> JobSummary:
    rewards = [r.mean_reward for r in rows if r.mean_reward is not None]
    finite_rewards = [r for r in rewards if math.isfinite(r)]
    staleness = [r.staleness_max for r in rows if r.staleness_max is not None]
    state, reason = _final_state(job_events)
    first_at = job_events[0].at if job_events else None
    last_at = job_events[-1].at if job_events else None
    return JobSummary(
        job_id=job_id,
        tenant=tenant,
        env=spec.env.name if spec else "-",
        state=state,
        steps=max((r.step for r in rows), default=0),
        max_steps=spec.rl.max_steps if spec else None,
        first_reward=rewards[0] if rewards else None,
        last_reward=rewards[-1] if rewards else None,
        best_reward=max(finite_rewards, default=None),
        max_staleness=max(staleness, default=None),
        dropped_groups=sum(e.event in DROPPED_EVENTS for e in job_events),
        reason=reason,
        first_at=first_at,
        last_at=last_at,
        wall_s=None if first_at is None or last_at is None else last_at - first_at,
    )


def _final_state(job_events: Sequence[Event]) -> tuple[str, str]:
    """The job's state after its last lifecycle event, and the reason when it matters."""
    lifecycle = JobLifecycle()
    for event in job_events:
        lifecycle.apply(event)
    return lifecycle.state, lifecycle.reason


# --- replicas ---------------------------------------------------------------------------


def _timed_samples(samples: Sequence[Mapping[str, float]]) -> list[Mapping[str, float]]:
    return sorted((s for s in samples if is_number(s.get("at"))), key=lambda s: s["at"])


def _utilisation_rows(
    replica: str, samples: Sequence[Mapping[str, float]], origin: float
) -> list[UtilisationRow]:
    """One row per interval between consecutive samples of the same replica process."""
    rows: list[UtilisationRow] = []
    segment = 0
    for before, after in itertools.pairwise(samples):
        if after["at"] <= before["at"]:
            continue  # two samples at one instant: no interval to divide by
        if _restarted(before, after):
            segment += 1  # counters began again: an interval across the restart means nothing
            continue
        rows.append(_interval_row(replica, segment, before, after, origin))
    return rows


def _restarted(before: Mapping[str, float], after: Mapping[str, float]) -> bool:
    went_down = any(
        (change := _change(before, after, name)) is not None and change < 0
        for name in REPLICA_COUNTERS
    )
    # Counters can climb past their old values when a restart falls in a long gap between
    # samples; an uptime shorter than that gap still shows the process is new.
    uptime = after.get("uptime_s")
    started_in_gap = uptime is not None and uptime + RESTART_SLACK_S < after["at"] - before["at"]
    return went_down or started_in_gap


def _interval_row(
    replica: str,
    segment: int,
    before: Mapping[str, float],
    after: Mapping[str, float],
    origin: float,
) -> UtilisationRow:
    busy_share = _ratio(_change(before, after, "busy_s"), _change(before, after, "uptime_s"))
    return UtilisationRow(
        replica=replica,
        segment=segment,
        at=after["at"],
        elapsed_s=after["at"] - origin,
        utilisation=None if busy_share is None else min(max(busy_share, 0.0), 1.0),
        tokens_per_s=_ratio(_change(before, after, "generated_tokens"), after["at"] - before["at"]),
        in_flight=after.get("in_flight"),
    )


def _change(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float | None:
    old, new = before.get(name), after.get(name)
    return None if old is None or new is None else new - old


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


# --- files ------------------------------------------------------------------------------


def write_report(report: Report, out_dir: Path) -> Path:
    """Write index.html, steps.csv, utilisation.csv and report.json; returns index.html."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_csv(out_dir / "steps.csv", report.steps, StepRow)
    _write_csv(out_dir / "utilisation.csv", report.utilisation, UtilisationRow)
    # Strict JSON: a NaN or infinite metric (a diverged loss) becomes null.
    report_json = json.dumps(_finite_or_none(asdict(report)), indent=2, allow_nan=False)
    (out_dir / "report.json").write_text(report_json + "\n", encoding="utf-8")
    index = out_dir / "index.html"
    index.write_text(render_html(report), encoding="utf-8")
    return index


def _write_csv(path: Path, rows: Sequence[StepRow | UtilisationRow], kind: type) -> None:
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=[f.name for f in fields(kind)])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in asdict(row).items()})


def _finite_or_none(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


# --- HTML -------------------------------------------------------------------------------


def render_html(report: Report) -> str:
    generated = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(report.generated_at))
    title = html.escape(report.title)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{_CSS}</style></head><body>
<h1>{title}</h1>
<p class="meta">Generated {html.escape(generated)} · {len(report.jobs)} jobs ·
{len(report.steps)} steps · numbers: <a href="steps.csv">steps.csv</a>,
<a href="utilisation.csv">utilisation.csv</a>, <a href="report.json">report.json</a></p>
{_jobs_table(report.jobs)}
{"".join(_charts(report))}
</body></html>
"""


def _charts(report: Report) -> list[str]:
    steps_by_job: dict[str, list[StepRow]] = {}
    for row in report.steps:
        steps_by_job.setdefault(row.job_id, []).append(row)
    util_by_replica: dict[str, list[UtilisationRow]] = {}
    for util in report.utilisation:
        util_by_replica.setdefault(util.replica, []).append(util)
    origin = report.started_at or 0.0

    def per_step(metric: str) -> list[Series]:
        return [
            Series(job_id, job_id, [plottable((r.step, getattr(r, metric)) for r in rows)])
            for job_id, rows in steps_by_job.items()
        ]

    trainer_throughput = [
        Series(
            job_id,
            f"trainer: {job_id}",
            [plottable((r.at - origin, r.trainer_tokens_per_s) for r in rows)],
            "trainer",
        )
        for job_id, rows in steps_by_job.items()
    ]
    rollout_throughput = [
        Series(name, f"rollout: {name}", _segments(rows, "tokens_per_s"), "rollout")
        for name, rows in util_by_replica.items()
    ]
    utilisation = [
        Series(name, name, _segments(rows, "utilisation")) for name, rows in util_by_replica.items()
    ]
    return [
        line_chart(
            "reward",
            "Mean reward per step",
            "step",
            "mean reward",
            per_step("mean_reward"),
            whole_x=True,
        ),
        line_chart(
            "staleness",
            "Staleness (max adapter versions behind) per step",
            "step",
            "versions behind",
            per_step("staleness_max"),
            whole_x=True,
            whole_y=True,
        ),
        line_chart(
            "throughput",
            "Throughput: trainer tokens/s per step, rollout tokens/s",
            "seconds since report start",
            "tokens/s",
            trainer_throughput + rollout_throughput,
        ),
        line_chart(
            "utilisation",
            "Rollout engine busy share over time",
            "seconds since report start",
            "busy share",
            utilisation,
        ),
    ]


def _segments(rows: Sequence[UtilisationRow], metric: str) -> list[list[Point]]:
    """A replica's points, split where it restarted."""
    return [
        plottable((r.elapsed_s, getattr(r, metric)) for r in segment_rows)
        for _, segment_rows in itertools.groupby(rows, key=lambda r: r.segment)
    ]


def _jobs_table(jobs: Sequence[JobSummary]) -> str:
    columns = (
        "job_id",
        "tenant",
        "env",
        "state",
        "steps",
        "max_steps",
        "first_reward",
        "last_reward",
        "best_reward",
        "max_staleness",
        "dropped_groups",
        "wall_s",
        "reason",
    )
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in columns)
    rows = "".join(
        f'<tr data-job="{html.escape(job.job_id)}">'
        + "".join(f'<td data-field="{c}">{_cell(c, getattr(job, c))}</td>' for c in columns)
        + "</tr>"
        for job in jobs
    )
    return f'<table class="jobs"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'


def _cell(column: str, value: object) -> str:
    if value is None or value == "":
        return "-"
    if column.endswith("reward") and isinstance(value, float):
        return f"{value:.3f}"
    if column == "wall_s" and isinstance(value, float):
        return f"{value:.0f}"
    return html.escape(str(value))


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } .meta { color: #666; margin: 0 0 16px; }
table.jobs { border-collapse: collapse; margin-bottom: 20px; }
table.jobs th, table.jobs td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; }
table.jobs th { background: #f5f5f5; }
svg.chart { display: block; margin: 0 0 18px; background: #fff; }
svg.chart text { fill: #444; } svg.chart .title { fill: #222; } svg.chart .nodata { fill: #999; }
"""
