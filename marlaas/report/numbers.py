"""`marlaas report`, its numbers: jobs, steps and replica utilisation from events and stats.

Pure: it turns events (`marlaas.events`) and rollout replica stats history (Redis) into a
`Report`; reading them is `marlaas.client`'s job, writing the page and files is
`marlaas.report.page`'s.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from common.wire.lifecycle import (
    DROPPED_EVENTS,
    REPLICA_COUNTERS,
    JobLifecycle,
    RolloutReplicaStats,
    StepMetrics,
)
from common.wire.messages import Event, JobSpec
from marlaas.export import best_version
from marlaas.report.charts import is_number

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
    below_base: str = ""
    """Why its latest evaluation is worse than the base model's (env_svc's `eval` event)."""
    best_version: str = ""
    """The trained version with the best held-out accuracy, `v<N> (<accuracy>)`: what
    `marlaas export JOB --best` writes."""


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
    entropy: float | None = None
    approx_kl: float | None = None
    fresh_kl: float | None = None
    clip_fraction: float | None = None
    zero_advantage_share: float | None = None
    trainer_tokens_per_s: float | None = None
    """tokens / step_s, when the step reported both."""


STEP_COLUMNS = tuple(f.name for f in fields(StepRow) if f.name in StepMetrics.names())
"""The `StepMetrics` of a trainer `step` event copied into each step row (absent: None)."""


@dataclass
class EvalRow:
    """One evaluated adapter version of a job (its `eval` event; version 0: the base)."""

    job_id: str
    tenant: str
    version: int
    at: float
    accuracy: float | None
    accuracy_stderr: float | None
    reward: float | None
    episodes: float | None


@dataclass
class UtilisationRow:
    replica: str
    """`replica <n>`, numbered in the order the replicas first reported (`_numbered`)."""
    segment: int
    """Which run of the replica process: 0, then one more after each restart."""
    at: float
    """End of the interval (the later of its two samples)."""
    elapsed_s: float
    """Since the report's start (its earliest event or sample)."""
    utilisation: float | None
    """Busy share of the interval: Δbusy_s / Δuptime_s, within [0, 1]: time with a request in
    the engine, computing much or little."""
    compute_utilisation: float | None
    """Compute share of the interval: Δcompute_s / (Δuptime_s x compute_slots), within
    [0, 1]: the engine's cores' time it computed (None: not reported, or a GPU)."""
    mean_batch: float | None
    """Δrequest_s / Δbusy_s: requests the engine held on average while busy."""
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
    evals: list[EvalRow] = field(default_factory=list)
    utilisation: list[UtilisationRow] = field(default_factory=list)
    trainer_busy: list[TrainerBusyRow] = field(default_factory=list)


@dataclass
class TrainerBusyRow:
    """The trainer's busy share over one `TRAINER_BUCKET_S` of the report."""

    elapsed_s: float
    """End of the bucket, since the report's start."""
    busy: float
    """Σ step_s of the steps that ended in the bucket over its length: the trainer's compute
    time per second (each job's `step_s` is its share of a pass over several jobs; several
    trainer replicas can pass 1)."""


TRAINER_BUCKET_S = 60.0


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
    histories = _numbered(
        {
            name: _timed_samples([s.as_map() for s in samples])
            for name, samples in (replica_history or {}).items()
        }
    )
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
        report.evals += _eval_rows(tenant, job_events)
    for replica, samples in histories.items():
        report.utilisation += _utilisation_rows(replica, samples, report.started_at or 0.0)
    report.trainer_busy = _trainer_busy_rows(report.steps, report.started_at or 0.0)
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


def _eval_rows(tenant: str, job_events: Sequence[Event]) -> list[EvalRow]:
    latest = {event.step: event for event in job_events if event.event == "eval"}
    rows = []
    for version, event in sorted(latest.items()):
        metrics = event.metrics
        row = EvalRow(
            event.job_id,
            tenant,
            version,
            event.at,
            metrics.get("eval_accuracy"),
            metrics.get("eval_accuracy_stderr"),
            metrics.get("eval_reward"),
            metrics.get("eval_episodes"),
        )
        rows.append(row)
    return rows


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
        below_base=_latest_eval_reason(job_events),
        best_version=_best(job_events),
    )


def _best(job_events: Sequence[Event]) -> str:
    found = best_version(job_events)
    return "" if found is None else f"v{found[0]} ({found[1]:.3f})"


def _latest_eval_reason(job_events: Sequence[Event]) -> str:
    evals = sorted((e for e in job_events if e.event == "eval"), key=lambda e: e.step)
    return evals[-1].reason if evals else ""


def _final_state(job_events: Sequence[Event]) -> tuple[str, str]:
    """The job's state after its last lifecycle event, and the reason when it matters."""
    lifecycle = JobLifecycle()
    for event in job_events:
        lifecycle.apply(event)
    return lifecycle.state, lifecycle.reason


# --- replicas ---------------------------------------------------------------------------


def _numbered(
    histories: Mapping[str, list[Mapping[str, float]]],
) -> dict[str, list[Mapping[str, float]]]:
    """The replicas as `replica 1`, `replica 2`, ... in the order they first reported. Their
    own names are `<host>-<pid>`: a report goes to tenants (the API's), who have no business
    with the servers' host names; the operator finds them in `marlaas status`."""
    first = {name: samples[0]["at"] if samples else math.inf for name, samples in histories.items()}
    order = sorted(histories, key=lambda name: (first[name], name))
    return {f"replica {n}": histories[name] for n, name in enumerate(order, 1)}


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
    uptime = _change(before, after, "uptime_s")
    busy = _change(before, after, "busy_s")
    slots = after.get("compute_slots")
    core_s = None if uptime is None or slots is None else uptime * slots
    return UtilisationRow(
        replica=replica,
        segment=segment,
        at=after["at"],
        elapsed_s=after["at"] - origin,
        utilisation=_share(_ratio(busy, uptime)),
        compute_utilisation=_share(_ratio(_change(before, after, "compute_s"), core_s)),
        mean_batch=_ratio(_change(before, after, "request_s"), busy),
        tokens_per_s=_ratio(_change(before, after, "generated_tokens"), after["at"] - before["at"]),
        in_flight=after.get("in_flight"),
    )


def _share(value: float | None) -> float | None:
    return None if value is None else min(max(value, 0.0), 1.0)


def _trainer_busy_rows(steps: Sequence[StepRow], origin: float) -> list[TrainerBusyRow]:
    """Σ step_s per `TRAINER_BUCKET_S` of the report, from its first bucket with a step to its
    last (an idle bucket between them reads 0)."""
    by_bucket: dict[int, float] = {}
    for row in steps:
        if row.step_s is not None and math.isfinite(row.step_s):
            bucket = int((row.at - origin) // TRAINER_BUCKET_S)
            by_bucket[bucket] = by_bucket.get(bucket, 0.0) + row.step_s
    if not by_bucket:
        return []
    buckets = range(min(by_bucket), max(by_bucket) + 1)
    return [
        TrainerBusyRow((b + 1) * TRAINER_BUCKET_S, by_bucket.get(b, 0.0) / TRAINER_BUCKET_S)
        for b in buckets
    ]


def _change(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float | None:
    old, new = before.get(name), after.get(name)
    return None if old is None or new is None else new - old


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator
