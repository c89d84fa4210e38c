"""`marlaas status`: every job's progress and the services' health, from Kafka and Redis only.

Job progress comes from `marlaas.events` (read from the start, then followed); job state,
flow-control counters and rollout replica stats from Redis; consumer lag from the broker.
Nothing here talks to a service, so it works from any machine that reaches both servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from common.lifecycle import CONSUMED_TOPICS
from common.messages import Event, JobSpec
from common.store import RedisStore, UnknownJobError
from console.eventfeed import EventFeed
from console.jobwatch import JobProgress
from console.stack.topics import group_lag

RECENT_EVENTS = 200
"""Events kept per job for `marlaas status JOB` and `--json`."""


@dataclass
class JobRow:
    progress: JobProgress
    state: str
    """The registry's state when it knows the job (authoritative), else the events'."""
    in_flight_episodes: int
    """Episodes of groups issued but not yet trained or dropped."""
    recent_events: list[Event] = field(default_factory=list)

    def to_json(self, now: float) -> dict[str, Any]:
        p = self.progress
        return {
            "job_id": p.job_id,
            "tenant": p.tenant,
            "env": p.env,
            "state": self.state,
            "step": p.steps,
            "max_steps": p.max_steps,
            "latest_reward": p.latest_reward,
            "best_reward": p.best_reward,
            "rewards": p.rewards,
            "staleness": p.last_staleness,
            "max_staleness_seen": p.max_staleness_seen,
            "dropped_groups": p.dropped_groups,
            "in_flight_episodes": self.in_flight_episodes,
            "eta_s": p.eta_s(now),
            "reason": p.reason,
            "evals": {str(v): m for v, m in sorted(p.evals.items())},
        }


@dataclass(frozen=True)
class ServiceLag:
    service: str
    group: str
    lag: int
    """Records on the service's topics not yet committed by its consumer group."""


@dataclass(frozen=True)
class ReplicaRow:
    name: str
    utilisation: float
    """Share of its uptime the engine had at least one request running."""
    recent_utilisation: float | None
    """The same over the replica's last report interval (5 s); None from older replicas."""
    tokens_per_s: float | None
    """Generated tokens per second over the last report interval."""
    in_flight: int


@dataclass
class StatusSnapshot:
    jobs: list[JobRow]
    lags: list[ServiceLag]
    replicas: list[ReplicaRow]
    taken_at: float
    restarts: dict[str, int] = field(default_factory=dict)
    """Restarts of each service by the embedded stack's supervisor."""
    runtimes: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    """What each live replica computes on and in, by (service, replica)."""

    def computes_in(self, service: str) -> str:
        """`service`'s precision and hardware (each distinct one of its replicas'), or ""."""
        found = {
            f"{fields.get('precision', '-')} on {fields.get('hardware', '?')}"
            for (name, _), fields in self.runtimes.items()
            if name == service
        }
        return "; ".join(sorted(found))

    def to_json(self) -> dict[str, Any]:
        return {
            "taken_at": self.taken_at,
            "jobs": [row.to_json(self.taken_at) for row in self.jobs],
            "services": [lag.__dict__ for lag in self.lags],
            "rollout_replicas": [replica.__dict__ for replica in self.replicas],
            "restarts": self.restarts,
            "runtimes": [
                {"service": service, "replica": replica, **fields}
                for (service, replica), fields in sorted(self.runtimes.items())
            ],
        }


class StatusBoard:
    """Keeps following events between refreshes, so a live view reads each event once."""

    def __init__(
        self,
        bootstrap: str,
        store: RedisStore,
        consumer_groups: dict[str, str],
        *,
        job_ids: Collection[str] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.bootstrap = bootstrap
        self.store = store
        self.consumer_groups = consumer_groups
        """Consumer group of each service, e.g. {"env_svc": "marlaas-env"}."""
        self.job_ids = set(job_ids) if job_ids else None
        self.timeout_s = timeout_s
        self._feed = EventFeed(bootstrap, self.job_ids, connect_timeout_s=timeout_s)
        self._progress: dict[str, JobProgress] = {}
        self._events: dict[str, deque[Event]] = {}

    async def start(self) -> None:
        await self._feed.start()
        self._apply(await self._feed.read_to_end(timeout_s=self.timeout_s * 3))

    async def stop(self) -> None:
        await self._feed.stop()

    async def __aenter__(self) -> StatusBoard:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def snapshot(self) -> StatusSnapshot:
        self._apply(await self._feed.poll(0.05))
        job_ids = self.job_ids or set(await self.store.job_ids()) | set(self._progress)
        rows = [await self._row(job_id) for job_id in sorted(job_ids)]
        if self.job_ids:
            for row, job_id in zip(rows, sorted(job_ids), strict=True):
                if row is None:
                    raise UnknownJobError(job_id)
        lags, replicas, restarts, runtimes = await asyncio.gather(
            self._lags(), self._replicas(), self.store.restarts(), self.store.runtimes()
        )
        jobs = [row for row in rows if row is not None]
        jobs.sort(key=lambda row: (row.progress.done, row.progress.submitted_at))
        return StatusSnapshot(
            jobs=jobs,
            lags=lags,
            replicas=replicas,
            taken_at=time.time(),
            restarts=restarts,
            runtimes=runtimes,
        )

    def expect(self, specs: Collection[JobSpec]) -> None:
        """Jobs just submitted: shown as `pending` until env_svc has registered them."""
        for spec in specs:
            self._progress.setdefault(spec.job_id, JobProgress.of(spec))

    def _apply(self, events: list[Event]) -> None:
        for event in events:
            progress = self._progress.get(event.job_id)
            if progress is None:
                progress = JobProgress(event.job_id, event.tenant or "-", "-", 0)
                progress.submitted_at = event.at
                self._progress[event.job_id] = progress
            progress.apply(event)
            self._events.setdefault(event.job_id, deque(maxlen=RECENT_EVENTS)).append(event)

    async def _row(self, job_id: str) -> JobRow | None:
        record = await self.store.job(job_id)
        progress = self._progress.get(job_id)
        if record is None and progress is None:
            return None
        if progress is None:
            progress = JobProgress.of(record.spec)  # type: ignore[union-attr]
            self._progress[job_id] = progress
        in_flight = 0
        state = progress.status
        if record is not None:
            spec = record.spec
            progress.tenant, progress.env, progress.max_steps = (
                spec.tenant,
                spec.env.name,
                spec.rl.max_steps,
            )
            state = record.status
            progress.submitted_at = spec.submitted_at or progress.submitted_at
            if state in ("running", "paused"):
                flow = await self.store.flow(job_id)
                in_flight = flow.untrained_groups(spec.rl.groups_per_step) * spec.rl.group_size
        return JobRow(progress, state, in_flight, list(self._events.get(job_id, ())))

    async def _lags(self) -> list[ServiceLag]:
        async def one(service: str, group: str) -> ServiceLag:
            partitions = await group_lag(
                self.bootstrap, group, CONSUMED_TOPICS[service], timeout_s=self.timeout_s
            )
            return ServiceLag(service, group, sum(max(p.lag, 0) for p in partitions))

        return list(await asyncio.gather(*(one(s, g) for s, g in self.consumer_groups.items())))

    async def _replicas(self) -> list[ReplicaRow]:
        return [
            ReplicaRow(
                name,
                utilisation=stats.utilisation or 0.0,
                recent_utilisation=stats.recent_utilisation,
                tokens_per_s=stats.tokens_per_s,
                in_flight=int(stats.in_flight or 0),
            )
            for name, stats in sorted((await self.store.replica_stats()).items())
        ]


async def live_view(
    board: StatusBoard,
    console: Console,
    *,
    until_done: bool,
    interval_s: float = 2.0,
    timeout_s: float | None = None,
) -> StatusSnapshot:
    """Refresh the view until Ctrl-C, or (until_done) until every job has ended and the
    final evaluations of completed ones are in.

    Raises TimeoutError when `timeout_s` passes first.

    Off a terminal (a pipe, a log file, a container) a live table would show only at the end:
    there each job's steps, evaluations and state changes are printed as lines instead.
    """
    detail = board.job_ids is not None and len(board.job_ids) == 1
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    snapshot = await board.snapshot()
    progress_log = None if console.is_terminal else ProgressLog()
    with contextlib.ExitStack() as screen:
        live = None
        if progress_log is None:
            live = screen.enter_context(
                Live(render(snapshot, detail=detail), console=console, auto_refresh=False)
            )
        while True:
            if progress_log is not None:
                for line in progress_log.new_lines(snapshot):
                    console.print(line, highlight=False, soft_wrap=True, markup=False)
            if until_done and all(row.progress.reported for row in snapshot.jobs):
                break
            if deadline is not None and time.monotonic() > deadline:
                pending = [r.progress.job_id for r in snapshot.jobs if not r.progress.reported]
                raise TimeoutError(f"jobs not finished after {timeout_s:.0f}s: {pending}")
            await asyncio.sleep(interval_s)
            snapshot = await board.snapshot()
            if live is not None:
                live.update(render(snapshot, detail=detail), refresh=True)
    return snapshot


@dataclass
class ProgressLog:
    """What changed since the last snapshot, as log lines: one per trained step, evaluation
    and state change of each job (`HH:MM:SS job: ...`)."""

    _steps: dict[str, int] = field(default_factory=dict)
    _evals: dict[str, set[int]] = field(default_factory=dict)
    _states: dict[str, str] = field(default_factory=dict)

    def new_lines(self, snapshot: StatusSnapshot) -> list[str]:
        lines = []
        for row in snapshot.jobs:
            p = row.progress
            clock = time.strftime("%H:%M:%S", time.localtime(snapshot.taken_at))
            if self._states.get(p.job_id) != row.state:
                self._states[p.job_id] = row.state
                reason = f": {p.reason}" if p.reason else ""
                lines.append(f"{clock} {p.job_id}: {row.state}{reason}")
            for index in range(self._steps.get(p.job_id, 0), len(p.rewards)):
                lines.append(
                    f"{clock} {p.job_id}: step {index + 1}/{p.max_steps} "
                    f"mean reward {p.rewards[index]:.3f}"
                )
            self._steps[p.job_id] = len(p.rewards)
            seen = self._evals.setdefault(p.job_id, set())
            for version in sorted(set(p.evals) - seen):
                metrics = p.evals[version]
                lines.append(
                    f"{clock} {p.job_id}: eval v{version} accuracy "
                    f"{metrics.get('eval_accuracy', 0.0):.3f} "
                    f"±{metrics.get('eval_accuracy_stderr', 0.0):.3f}"
                )
                seen.add(version)
        return lines


# --- rendering --------------------------------------------------------------------------

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
        caption="eval acc: held-out accuracy (greedy), base model → latest evaluated version"
        if snapshot.jobs
        else "no jobs yet: marlaas submit examples/jobs/*.toml",
    )
    table.add_column("job", no_wrap=True, overflow="fold")
    for column in ("tenant", "env", "state", "progress"):
        table.add_column(column)
    for column in ("reward", "best", "eval acc", "stale", "in flight", "ETA"):
        table.add_column(column, justify="right")
    for row in snapshot.jobs:
        p = row.progress
        state = Text(row.state, style=STATE_STYLES.get(row.state, ""))
        if p.reason and row.state in ("rejected", "failed"):
            state.append(f": {p.reason}", style="dim")
        total = max(p.max_steps, 1)
        progress = Table.grid(padding=(0, 1))
        progress.add_row(
            ProgressBar(total=total, completed=min(p.steps, total), width=12),
            f"{p.steps}/{p.max_steps or '?'}",
        )
        table.add_row(
            p.job_id,
            p.tenant,
            p.env,
            state,
            progress,
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
    latest's standard error; "-" before the first evaluation."""
    if not progress.evals:
        return "-"
    latest = max(progress.evals)
    metrics = progress.evals[latest]
    text = f"{metrics.get('eval_accuracy', 0.0):.2f}±{metrics.get('eval_accuracy_stderr', 0.0):.2f}"
    base = progress.eval_accuracy(0)
    if latest == 0 or base is None:
        return f"{text} (v{latest})"
    return f"{base:.2f} → {text} (v{latest})"


def _services_table(snapshot: StatusSnapshot) -> Table:
    table = Table(
        title="services",
        title_justify="left",
        caption="stale: staleness of the last step / max seen; lag: records not yet committed",
    )
    columns = (
        "service",
        "consumer group",
        "lag",
        "restarts",
        "engine busy",
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
            table.add_row(lag.service, lag.group, str(lag.lag), restarts, "", "", "", computes_in)
        for index, replica in enumerate(replicas):
            first = index == 0
            table.add_row(
                lag.service if first else "",
                lag.group if first else "",
                str(lag.lag) if first else "",
                restarts if first else "",
                _busy(replica),
                "-" if replica.tokens_per_s is None else f"{replica.tokens_per_s:.1f}",
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
    now = "" if replica.recent_utilisation is None else f"{replica.recent_utilisation:.0%} now, "
    return f"{now}{replica.utilisation:.0%} since start ({replica.name})"


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
