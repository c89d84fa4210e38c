"""The status board as rich tables: jobs, services, a job's recent events."""

from __future__ import annotations

import time

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from common.wire.messages import Event
from console.status.board import JobRow, ReplicaRow, StatusSnapshot
from console.status.load import TrainerBusy
from marlaas.jobwatch import JobProgress

STATE_STYLES = {
    "running": "green",
    "paused": "yellow",
    "completed": "bold green",
    "cancelled": "dim",
    "rejected": "red",
    "failed": "bold red",
    "pending": "cyan",
}


def render(snapshot: StatusSnapshot, *, detail: bool = False) -> RenderableType:
    """The jobs table, the services table and (with `detail`) each job's recent events."""
    parts: list[RenderableType] = [_jobs_table(snapshot), _services_table(snapshot)]
    if detail:
        parts += [_events_table(row) for row in snapshot.jobs]
    return Group(*parts)


def _jobs_table(snapshot: StatusSnapshot) -> Table:
    table = Table(
        title=f"MARLaaS jobs — {time.strftime('%H:%M:%S')}",
        title_justify="left",
        caption="eval acc: held-out accuracy (greedy), base model → latest evaluated version; "
        "stale: staleness of the last step / max seen; in flight: episodes not yet trained"
        if snapshot.jobs
        else "no jobs yet: marlaas submit examples/jobs/*.toml",
        # No lines between columns, and no bar: four jobs fit 120 columns with every value
        # whole (boxed, with a bar, rich cut `calculator` and the accuracies to fit).
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    table.add_column("job", overflow="fold")
    for column in ("tenant", "env"):
        table.add_column(column, no_wrap=True)
    table.add_column("state", overflow="fold")  # a rejected job's reason follows it
    for column in ("step", "reward", "best", "eval acc", "stale", "in\nflight", "ETA"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in snapshot.jobs:
        p = row.progress
        state = Text(row.state, style=STATE_STYLES.get(row.state, ""))
        if p.reason and row.state in ("rejected", "failed"):
            state.append(f": {p.reason}", style="dim")
        table.add_row(
            p.job_id,
            p.tenant,
            p.env,
            state,
            f"{p.steps}/{p.max_steps or '?'}",
            _reward(p.latest_reward),
            _reward(p.best_reward),
            eval_accuracy_text(p),
            f"{p.last_staleness}/{p.max_staleness_seen}",
            str(row.in_flight_episodes),
            _duration(p.eta_s(snapshot.taken_at)),
        )
    return table


def eval_accuracy_text(progress: JobProgress) -> str:
    """Held-out accuracy of the base model -> the latest evaluated version (v<n>), with the
    latest's standard error ("0.44→0.81±0.05 v4"); "-" before the first evaluation."""
    if not progress.evals:
        return "-"
    latest = max(progress.evals)
    metrics = progress.evals[latest]
    text = f"{metrics.get('eval_accuracy', 0.0):.2f}±{metrics.get('eval_accuracy_stderr', 0.0):.2f}"
    base = progress.eval_accuracy(0)
    if latest == 0 or base is None:
        return f"{text} v{latest}"
    return f"{base:.2f}→{text} v{latest}"


def _services_table(snapshot: StatusSnapshot) -> Table:
    table = Table(
        title="services",
        title_justify="left",
        caption="lag: records not yet committed",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    columns = (
        "service",
        "consumer group",
        "lag",
        "restarts",
        "computing (busy)",
        "batch",
        "tokens/s",
        "in engine",
        "computes in",
    )
    for column in columns:
        table.add_column(column)
    for lag in snapshot.lags:
        replicas = list(snapshot.replicas) if lag.service == "rollout_svc" else []
        restarts = str(snapshot.restarts.get(lag.service, 0))
        computes_in = snapshot.computes_in(lag.service)
        if not replicas:
            computing = _trainer_busy(snapshot.trainer) if lag.service == "trainer_svc" else ""
            table.add_row(
                lag.service, lag.group, str(lag.lag), restarts, computing, "", "", "", computes_in
            )
        for index, replica in enumerate(replicas):
            first = index == 0
            table.add_row(
                lag.service if first else "",
                lag.group if first else "",
                str(lag.lag) if first else "",
                restarts if first else "",
                _busy(replica),
                _number(replica.mean_batch, ".1f"),
                _number(replica.tokens_per_s, ".1f"),
                str(replica.in_flight),
                computes_in if first else "",
            )
    return table


def _events_table(row: JobRow) -> Table:
    table = Table(title=f"recent events of {row.progress.job_id}", title_justify="left")
    for column in ("time", "service", "event", "step", "details"):
        table.add_column(column)
    for event in row.recent_events[-15:]:
        table.add_row(*event_cells(event, brief=True))
    return table


BRIEF_METRICS = (
    "mean_reward",
    "loss",
    "staleness_max",
    "tokens",
    "step_s",
    "eval_accuracy",
    "eval_accuracy_stderr",
    "eval_reward",
)
"""The step metrics `marlaas status JOB` shows; `marlaas logs` shows them all."""


def event_cells(event: Event, *, brief: bool = False) -> tuple[str, str, str, str, str]:
    """One event as table cells / a log line: time, service, kind, step, reason or metrics."""
    metrics = sorted(event.metrics.items())
    if brief:
        metrics = [(k, event.metrics[k]) for k in BRIEF_METRICS if k in event.metrics]
    details = event.reason or " ".join(f"{k}={v:.4g}" for k, v in metrics)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.at))
    step = str(event.step) if event.step or event.event == "eval" else ""
    return stamp, event.service, event.event, step, details


def _busy(replica: ReplicaRow) -> str:
    """The engine's compute share now and since start, and (in brackets) its share of time
    with a request in it: computing little while busy is serving requests one at a time."""
    computing = _shares(replica.recent_compute_utilisation, replica.compute_utilisation)
    busy = _shares(replica.recent_utilisation, replica.utilisation)
    return f"{computing} ({busy}) {replica.name}"


def _trainer_busy(busy: TrainerBusy) -> str:
    return "-" if busy.steps == 0 else _shares(busy.recent, busy.since_first_step)


def _shares(now: float | None, overall: float | None) -> str:
    """`<now> now / <overall>`, each a percentage or "-"."""
    return f"{_number(now, '.0%')} now / {_number(overall, '.0%')}"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
