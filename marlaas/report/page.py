"""`marlaas report`, its files: one self-contained HTML page (inline SVG charts) + CSV/JSON.

Every chart carries its exact numbers (`data-values` on each series), so the page can be
checked by parsing it.
"""

from __future__ import annotations

import csv
import html
import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from marlaas.report.charts import REPORT_SIZE, ChartSize, Point, Series, line_chart, plottable
from marlaas.report.numbers import EvalRow, JobSummary, Report, StepRow, UtilisationRow

# --- files ------------------------------------------------------------------------------


def write_report(report: Report, out_dir: Path) -> Path:
    """Write index.html, steps.csv, evals.csv, utilisation.csv and report.json; returns
    index.html."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_csv(out_dir / "steps.csv", report.steps, StepRow)
    _write_csv(out_dir / "evals.csv", report.evals, EvalRow)
    _write_csv(out_dir / "utilisation.csv", report.utilisation, UtilisationRow)
    # Strict JSON: a NaN or infinite metric (a diverged loss) becomes null.
    report_json = json.dumps(_finite_or_none(asdict(report)), indent=2, allow_nan=False)
    (out_dir / "report.json").write_text(report_json + "\n", encoding="utf-8")
    index = out_dir / "index.html"
    index.write_text(render_html(report), encoding="utf-8")
    return index


def _write_csv(path: Path, rows: Sequence[StepRow | EvalRow | UtilisationRow], kind: type) -> None:
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
    # In UTC: the server's own time zone is none of a tenant's business.
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(report.generated_at))
    title = html.escape(report.title)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{_CSS}</style></head><body>
<h1>{title}</h1>
<p class="meta">Generated {html.escape(generated)} · {len(report.jobs)} jobs ·
{len(report.steps)} steps · numbers: <a href="steps.csv">steps.csv</a>,
<a href="utilisation.csv">utilisation.csv</a>, <a href="report.json">report.json</a></p>
{_jobs_table(report.jobs)}
{"".join(charts(report).values())}
</body></html>
"""


_STEP_CHARTS = (
    ("reward", "Mean reward per step", "mean reward", "mean_reward"),
    (
        "staleness",
        "Staleness (max adapter versions behind) per step",
        "versions behind",
        "staleness_max",
    ),
    (
        "entropy",
        "Policy entropy per step (nats per token, from the sampled tokens): near 0, "
        "the policy stopped exploring",
        "entropy",
        "entropy",
    ),
    (
        "kl",
        "KL from the sampling policy to the trained one per step (k3 estimate)",
        "KL",
        "approx_kl",
    ),
    (
        "clip",
        "Clip fraction per step: tokens whose update the clip cut off",
        "share of tokens",
        "clip_fraction",
    ),
    (
        "zero_advantage",
        "Share of trajectories with zero advantage per step (no learning signal)",
        "share",
        "zero_advantage_share",
    ),
)
"""Per-step charts: (id, title, y axis, StepRow metric); staleness counts whole versions."""


def charts(report: Report, size: ChartSize = REPORT_SIZE) -> dict[str, str]:
    """Every chart of the page (an inline SVG) by its id, its `data-chart`, in the page's
    order; the web console of the tenant API shows some of them, at its own `size`."""
    steps_by_job: dict[str, list[StepRow]] = {}
    for row in report.steps:
        steps_by_job.setdefault(row.job_id, []).append(row)
    util_by_replica: dict[str, list[UtilisationRow]] = {}
    for util in report.utilisation:
        util_by_replica.setdefault(util.replica, []).append(util)
    per_step = {
        chart: line_chart(
            chart,
            title,
            "step",
            y_label,
            [
                Series(job_id, job_id, [plottable((r.step, getattr(r, metric)) for r in rows)])
                for job_id, rows in steps_by_job.items()
            ],
            whole_x=True,
            whole_y=metric == "staleness_max",
            size=size,
        )
        for chart, title, y_label, metric in _STEP_CHARTS
    }
    reward = per_step.pop("reward")
    return {
        "reward": reward,
        "eval": _held_out_chart(report.evals, size),
        **per_step,
        "throughput": _throughput_chart(
            steps_by_job, util_by_replica, report.started_at or 0.0, size
        ),
        "utilisation": _busy_chart(report, util_by_replica, size),
    }


def _busy_chart(
    report: Report, util_by_replica: dict[str, list[UtilisationRow]], size: ChartSize
) -> str:
    """What computed how much of the time: each engine's compute share (its cores' time),
    its share of time with a request in it, and the trainer's step seconds per second."""
    rollout = [
        Series(f"{name} {what}", f"rollout {name}: {label}", _segments(rows, what), "rollout")
        for name, rows in util_by_replica.items()
        for what, label in (
            ("compute_utilisation", "computing"),
            ("utilisation", "a request in the engine"),
        )
    ]
    trainer = Series(
        "trainer",
        "trainer: step seconds per second",
        [plottable((r.elapsed_s, r.busy) for r in report.trainer_busy)],
        "trainer",
    )
    return line_chart(
        "utilisation",
        "Busy share over time: the engine computing, a request in the engine, the trainer",
        "seconds since report start",
        "busy share",
        [*rollout, trainer] if report.trainer_busy else rollout,
        size=size,
    )


def _held_out_chart(evals: Sequence[EvalRow], size: ChartSize) -> str:
    evals_by_job: dict[str, list[EvalRow]] = {}
    for evaluated in evals:
        evals_by_job.setdefault(evaluated.job_id, []).append(evaluated)
    return line_chart(
        "eval",
        "Held-out accuracy (greedy) per evaluated adapter version (0: the base model)",
        "adapter version",
        "accuracy",
        [
            Series(job_id, job_id, [plottable((r.version, r.accuracy) for r in rows)])
            for job_id, rows in evals_by_job.items()
        ],
        whole_x=True,
        size=size,
    )


def _throughput_chart(
    steps_by_job: dict[str, list[StepRow]],
    util_by_replica: dict[str, list[UtilisationRow]],
    origin: float,
    size: ChartSize,
) -> str:
    trainer = [
        Series(
            job_id,
            f"trainer: {job_id}",
            [plottable((r.at - origin, r.trainer_tokens_per_s) for r in rows)],
            "trainer",
        )
        for job_id, rows in steps_by_job.items()
    ]
    rollout = [
        Series(name, f"rollout: {name}", _segments(rows, "tokens_per_s"), "rollout")
        for name, rows in util_by_replica.items()
    ]
    return line_chart(
        "throughput",
        "Throughput: trainer tokens/s per step, rollout tokens/s",
        "seconds since report start",
        "tokens/s",
        trainer + rollout,
        size=size,
    )


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
        "best_version",
        "below_base",
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
