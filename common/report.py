"""`marlaas report`: one self-contained HTML page (inline SVG charts) + the numbers as CSV/JSON.

Pure: it turns events (`marlaas.events`) and rollout replica stats history (Redis) into a
report; reading them is `common.client`'s job. Every chart carries its exact numbers
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

from common.jobwatch import JobProgress
from common.messages import Event, JobSpec

STEP_FIELDS = (
    "mean_reward",
    "staleness_max",
    "staleness_mean",
    "loss",
    "tokens",
    "samples",
    "step_s",
)
PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#7f7f7f",
    "#bcbd22",
)

Point = tuple[float, float]


@dataclass
class StepRow:
    job_id: str
    tenant: str
    step: int
    at: float
    elapsed_s: float
    """Since the report's first event."""
    mean_reward: float | None = None
    staleness_max: float | None = None
    staleness_mean: float | None = None
    loss: float | None = None
    tokens: float | None = None
    samples: float | None = None
    step_s: float | None = None
    trainer_tokens_per_s: float | None = None


@dataclass
class UtilisationRow:
    replica: str
    at: float
    elapsed_s: float
    utilisation: float
    """Busy share of the interval ending at `at`."""
    tokens_per_s: float
    in_flight: float


@dataclass
class Report:
    title: str
    generated_at: float
    jobs: list[dict[str, object]] = field(default_factory=list)
    steps: list[StepRow] = field(default_factory=list)
    utilisation: list[UtilisationRow] = field(default_factory=list)


def build_report(
    events: Sequence[Event],
    replica_history: Mapping[str, Sequence[Mapping[str, float]]] | None = None,
    *,
    specs: Mapping[str, JobSpec] | None = None,
    title: str = "MARLaaS report",
    generated_at: float | None = None,
) -> Report:
    unique = sorted({e.event_id: e for e in events}.values(), key=lambda e: e.at)
    samples = {name: list(s) for name, s in (replica_history or {}).items()}
    starts = [e.at for e in unique] + [s["at"] for ss in samples.values() for s in ss[:1]]
    origin = min(starts, default=0.0)
    report = Report(title, time.time() if generated_at is None else generated_at)
    progress = _progress(unique, specs or {})
    for job in progress.values():
        report.jobs.append(_summary(job, unique))
    report.steps = _step_rows(unique, progress, origin)
    for replica, history in sorted(samples.items()):
        report.utilisation += _utilisation_rows(replica, history, origin)
    return report


def _progress(events: Sequence[Event], specs: Mapping[str, JobSpec]) -> dict[str, JobProgress]:
    jobs = {job_id: JobProgress.of(spec) for job_id, spec in specs.items()}
    for event in events:
        if event.job_id not in jobs:
            jobs[event.job_id] = JobProgress(event.job_id, event.tenant or "-", "-", 0)
            jobs[event.job_id].submitted_at = event.at
        jobs[event.job_id].apply(event)
    return jobs


def _summary(job: JobProgress, events: Sequence[Event]) -> dict[str, object]:
    times = [e.at for e in events if e.job_id == job.job_id]
    return {
        "job_id": job.job_id,
        "tenant": job.tenant,
        "env": job.env,
        "state": job.status,
        "steps": job.steps,
        "max_steps": job.max_steps,
        "first_reward": job.rewards[0] if job.rewards else None,
        "last_reward": job.latest_reward,
        "best_reward": job.best_reward,
        "max_staleness_seen": job.max_staleness_seen,
        "dropped_groups": job.dropped_groups,
        "reason": job.reason,
        "wall_s": (max(times) - min(times)) if times else None,
    }


def _step_rows(
    events: Sequence[Event], jobs: Mapping[str, JobProgress], origin: float
) -> list[StepRow]:
    rows: dict[tuple[str, int], StepRow] = {}
    for event in events:
        if event.event != "step" or (event.job_id, event.step) in rows:
            continue  # a step trains once; a second event for it is a redelivery
        metrics = event.metrics
        row = StepRow(
            event.job_id,
            jobs[event.job_id].tenant,
            event.step,
            event.at,
            event.at - origin,
            **{k: metrics.get(k) for k in STEP_FIELDS},
        )
        if row.tokens is not None and row.step_s:
            row.trainer_tokens_per_s = row.tokens / row.step_s
        rows[(event.job_id, event.step)] = row
    return sorted(rows.values(), key=lambda r: (r.job_id, r.step))


def _utilisation_rows(
    replica: str, history: Sequence[Mapping[str, float]], origin: float
) -> list[UtilisationRow]:
    rows = []
    for before, after in itertools.pairwise(history):
        d_uptime = after.get("uptime_s", 0.0) - before.get("uptime_s", 0.0)
        d_tokens = after.get("generated_tokens", 0.0) - before.get("generated_tokens", 0.0)
        d_at = after["at"] - before["at"]
        if d_uptime <= 0 or d_tokens < 0 or d_at <= 0:
            continue  # the replica restarted: its counters began again
        busy = (after.get("busy_s", 0.0) - before.get("busy_s", 0.0)) / d_uptime
        rows.append(
            UtilisationRow(
                replica,
                after["at"],
                after["at"] - origin,
                min(max(busy, 0.0), 1.0),
                d_tokens / d_at,
                after.get("in_flight", 0.0),
            )
        )
    return rows


# --- files ------------------------------------------------------------------------------


def write_report(report: Report, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_csv(out_dir / "steps.csv", [asdict(r) for r in report.steps], StepRow)
    _write_csv(out_dir / "utilisation.csv", [asdict(r) for r in report.utilisation], UtilisationRow)
    (out_dir / "report.json").write_text(json.dumps(asdict(report), indent=2))
    index = out_dir / "index.html"
    index.write_text(render_html(report))
    return index


def _write_csv(path: Path, rows: list[dict[str, object]], kind: type) -> None:
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=[f.name for f in fields(kind)])
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)


# --- HTML -------------------------------------------------------------------------------


def render_html(report: Report) -> str:
    by_job: dict[str, list[StepRow]] = {}
    for row in report.steps:
        by_job.setdefault(row.job_id, []).append(row)
    by_replica: dict[str, list[UtilisationRow]] = {}
    for util in report.utilisation:
        by_replica.setdefault(util.replica, []).append(util)

    def series(rows: dict[str, list[StepRow]], x: str, y: str) -> dict[str, list[Point]]:
        return {
            name: [(getattr(r, x), getattr(r, y)) for r in rs if getattr(r, y) is not None]
            for name, rs in rows.items()
        }

    throughput = {
        f"trainer {k}": v for k, v in series(by_job, "elapsed_s", "trainer_tokens_per_s").items()
    }
    throughput |= {
        f"rollout {name}": [(r.elapsed_s, r.tokens_per_s) for r in rows]
        for name, rows in by_replica.items()
    }
    charts = [
        line_chart(
            "reward",
            "Mean reward per step",
            "step",
            "mean reward",
            series(by_job, "step", "mean_reward"),
        ),
        line_chart(
            "staleness",
            "Staleness (max adapter versions behind) per step",
            "step",
            "versions",
            series(by_job, "step", "staleness_max"),
        ),
        line_chart(
            "throughput",
            "Throughput: trainer and rollout tokens/s",
            "seconds",
            "tokens/s",
            throughput,
        ),
        line_chart(
            "utilisation",
            "Rollout engine busy share over time",
            "seconds",
            "busy share",
            {
                name: [(r.elapsed_s, r.utilisation) for r in rows]
                for name, rows in by_replica.items()
            },
        ),
    ]
    generated = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(report.generated_at))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(report.title)}</title>
<style>{_CSS}</style></head><body>
<h1>{html.escape(report.title)}</h1>
<p class="meta">Generated {html.escape(generated)} · {len(report.jobs)} jobs ·
{len(report.steps)} steps · numbers: <a href="steps.csv">steps.csv</a>,
<a href="utilisation.csv">utilisation.csv</a>, <a href="report.json">report.json</a></p>
{_jobs_table(report.jobs)}
{"".join(charts)}
</body></html>
"""


def _jobs_table(jobs: list[dict[str, object]]) -> str:
    columns = (
        "job_id",
        "tenant",
        "env",
        "state",
        "steps",
        "first_reward",
        "last_reward",
        "best_reward",
        "max_staleness_seen",
        "dropped_groups",
        "wall_s",
        "reason",
    )
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in columns)
    rows = "".join(
        "<tr>" + "".join(f'<td data-field="{c}">{_cell(c, job[c])}</td>' for c in columns) + "</tr>"
        for job in jobs
    )
    return f'<table class="jobs"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'


def _cell(column: str, value: object) -> str:
    if value is None:
        return "-"
    if column.endswith("reward") and isinstance(value, float):
        return f"{value:.3f}"
    if column == "wall_s" and isinstance(value, float):
        return f"{value:.0f}"
    return html.escape(str(value))


def line_chart(
    chart: str, title: str, x_label: str, y_label: str, series: Mapping[str, list[Point]]
) -> str:
    """An inline SVG line chart; each series' exact numbers ride along in `data-values`."""
    width, height, left, right, top, bottom = 760, 320, 64, 200, 34, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    points = [p for values in series.values() for p in values]
    parts = [
        f'<svg class="chart" data-chart="{chart}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">',
        f'<text x="{left}" y="20" class="title">{html.escape(title)}</text>',
    ]
    if not points:
        parts.append(
            f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" class="nodata" '
            'text-anchor="middle">no data</text></svg>'
        )
        return "".join(parts)
    x_lo, x_hi = _span([p[0] for p in points])
    y_lo, y_hi = _span([p[1] for p in points], floor_zero=True)

    def sx(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * plot_w

    def sy(y: float) -> float:
        return top + plot_h - (y - y_lo) / (y_hi - y_lo) * plot_h

    # Styles inline, not only in the page's CSS: the SVG stays right when copied out alone.
    parts.append(
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#bbb"/>'
    )
    for yv, label in _ticks(y_lo, y_hi):
        parts.append(
            f'<line x1="{left}" x2="{left + plot_w}" y1="{sy(yv):.1f}" y2="{sy(yv):.1f}" '
            f'stroke="#eee"/><text x="{left - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">'
            f"{label}</text>"
        )
    for xv, label in _ticks(x_lo, x_hi):
        parts.append(
            f'<text x="{sx(xv):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{label}</text>'
        )
    parts.append(
        f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle" '
        f'class="axis">{html.escape(x_label)}</text>'
        f'<text x="14" y="{top + plot_h / 2}" text-anchor="middle" class="axis" '
        f'transform="rotate(-90 14 {top + plot_h / 2})">{html.escape(y_label)}</text>'
    )
    for index, (name, values) in enumerate(sorted(series.items())):
        colour = PALETTE[index % len(PALETTE)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values)
        data = html.escape(json.dumps([[x, y] for x, y in values]), quote=True)
        parts.append(
            f'<polyline data-series="{html.escape(name, quote=True)}" '
            f'data-values="{data}" points="{path}" fill="none" stroke="{colour}" '
            'stroke-width="2"/>'
        )
        parts += [
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>'
            for x, y in values
        ]
        legend_y = top + 14 + 18 * index
        parts.append(
            f'<rect x="{width - right + 12}" y="{legend_y - 9}" width="10" '
            f'height="10" fill="{colour}"/><text x="{width - right + 28}" '
            f'y="{legend_y}" class="legend">{html.escape(_short(name))}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _span(values: list[float], *, floor_zero: bool = False) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if floor_zero and lo > 0:
        lo = 0.0
    if math.isclose(lo, hi):
        lo, hi = lo - 0.5, hi + 0.5
    return lo, hi


def _ticks(lo: float, hi: float, count: int = 6) -> list[tuple[float, str]]:
    """Round tick values (1, 2 or 5 times a power of ten apart) within [lo, hi], labelled."""
    raw = (hi - lo) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    decimals = max(0, -math.floor(math.log10(step)))
    first = math.ceil(lo / step - 1e-9) * step
    values = [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]
    return [(v, f"{v:.{decimals}f}") for v in values]


def _short(name: str, limit: int = 26) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } .meta { color: #666; margin: 0 0 16px; }
table.jobs { border-collapse: collapse; margin-bottom: 20px; }
table.jobs th, table.jobs td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; }
table.jobs th { background: #f5f5f5; }
svg.chart { display: block; margin: 0 0 18px; background: #fff; }
svg.chart text { font-size: 11px; fill: #444; } svg.chart .title { font-size: 14px; fill: #222; }
svg.chart .nodata { font-size: 14px; fill: #999; }
"""
