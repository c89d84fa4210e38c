"""Prometheus metrics of every service: this module owns their names, labels and buckets.

They live in prometheus_client's default registry, which `/metrics` serves
(common/runtime/health.py): the consumer metrics always, a service's own ones once it called
`export_service_metrics` (so env_svc does not export a rollout gauge stuck at 0). In
rollout_svc, vLLM's own `vllm:*` metrics join them there.
Per-job series are labelled `job_id`, not `job`: Prometheus puts its scrape job in `job`
on every series and would rename ours to `exported_job`. They carry those labels on /metrics
only where the operator asks (`MARLAAS_METRICS_TENANT_LABELS`); otherwise /metrics serves
them through `WithoutJobLabels`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# A `*_created` twin of every counter and histogram doubles the series for a timestamp that
# PromQL's rate() does not need.
disable_created_metrics()

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STEP_BUCKETS_S = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# --- every consumer (common.bus.kafka.ConsumerLoop) ------------------------------------------

MESSAGES_PROCESSED = Counter(
    "marlaas_messages_processed_total",
    "Records whose handler returned (their offset may now be committed).",
    ["service", "topic"],
)
MESSAGES_FAILED = Counter(
    "marlaas_messages_failed_total",
    "Records that could not be decoded or whose handler raised; every retried attempt counts.",
    ["service", "topic"],
)
JOB_SPEC_DECODES = Counter(
    "marlaas_job_spec_decodes_total",
    "Job specs decoded from their registered bytes: once per job per process "
    "(common/state/admitted.py).",
)
HANDLER_SECONDS = Histogram(
    "marlaas_handler_seconds",
    "Time in the handler per decoded record, failed attempts included.",
    ["service", "topic"],
    buckets=_LATENCY_BUCKETS_S,
)
CONSUMER_LAG = Gauge(
    "marlaas_consumer_lag",
    "End offset minus committed offset, summed over the partitions this replica owns.",
    ["service", "topic"],
)
CONSUMER_IN_FLIGHT = Gauge(
    "marlaas_consumer_records_in_flight",
    "Records this replica's consumer is handling at once (common/bus/dispatch.py).",
    ["service"],
)
DEAD_LETTERS = Counter(
    "marlaas_dead_letters_total",
    "Records sent to marlaas.dlq, by the topic they came from.",
    ["service", "topic"],
)


@dataclass(frozen=True)
class ConsumerMetrics:
    """One consumer's series for one topic, resolved once instead of per record."""

    processed: Counter
    failed: Counter
    handler_seconds: Histogram
    dead_letters: Counter
    lag: Gauge


def consumer_metrics(service: str, topic: str) -> ConsumerMetrics:
    """The series of `service` consuming `topic`; they are exported (at 0) from now on."""
    return ConsumerMetrics(
        processed=MESSAGES_PROCESSED.labels(service, topic),
        failed=MESSAGES_FAILED.labels(service, topic),
        handler_seconds=HANDLER_SECONDS.labels(service, topic),
        dead_letters=DEAD_LETTERS.labels(service, topic),
        lag=CONSUMER_LAG.labels(service, topic),
    )


# --- rollout_svc (registry=None: served once export_service_metrics is called) -------

ROLLOUT_BUSY_FRACTION = Gauge(
    "marlaas_rollout_engine_busy_fraction",
    "Share of the last stats interval with at least one request in the engine.",
    registry=None,
)
ROLLOUT_COMPUTE_FRACTION = Gauge(
    "marlaas_rollout_engine_compute_fraction",
    "Share of its cores' time the engine computed over the last stats interval (CPU engines).",
    registry=None,
)
ROLLOUT_MEAN_BATCH = Gauge(
    "marlaas_rollout_engine_mean_batch",
    "Requests the engine held on average while busy over the last stats interval.",
    registry=None,
)
ROLLOUT_TOKENS_PER_SECOND = Gauge(
    "marlaas_rollout_tokens_per_second",
    "Completion tokens generated per second over the last stats interval.",
    registry=None,
)
ROLLOUT_GENERATED_TOKENS = Counter(
    "marlaas_rollout_generated_tokens_total",
    "Completion tokens the engine returned.",
    registry=None,
)
ROLLOUT_REQUESTS_IN_FLIGHT = Gauge(
    "marlaas_rollout_requests_in_flight",
    "Requests submitted to the engine and not finished.",
    registry=None,
)
ROLLOUT_ADAPTERS_LOADED = Gauge(
    "marlaas_rollout_adapters_loaded",
    "Adapter versions registered with the engine and not retired.",
    registry=None,
)

# --- trainer_svc (likewise) -------------------------------------------------------------

TRAINER_BUSY_SECONDS = Counter(
    "marlaas_trainer_busy_seconds",
    "Seconds the trainer computed steps (each job's share of a pass over several jobs, so "
    "a pass counts once): its rate is the trainer's busy share.",
    registry=None,
)
TRAINER_STEP_SECONDS = Histogram(
    "marlaas_trainer_step_seconds",
    "Wall time of one training step: forward and backward passes, checkpoint, publishing "
    "(every job's: a job's own are in its step events).",
    buckets=_STEP_BUCKETS_S,
    registry=None,
)
TRAINER_TOKENS_PER_SECOND = Gauge(
    "marlaas_trainer_tokens_per_second",
    "Trajectory tokens per second of the forward and backward passes of the job's last step.",
    ["job_id"],
    registry=None,
)
TRAINER_STEPS = Counter(
    "marlaas_trainer_steps_total",
    "Training steps done (adapter versions published).",
    ["job_id", "tenant"],
    registry=None,
)
TRAINER_GROUPS_DROPPED = Counter(
    "marlaas_trainer_groups_dropped_total",
    "Groups dropped instead of trained, by verdict (dropped_stale, dropped_invalid; "
    "dropped_uniform: resampled by the job's dynamic sampling).",
    ["job_id", "kind"],
    registry=None,
)

ENDED_JOB = "(ended)"
"""The `job_id` under which the trainer keeps the counts of the jobs it no longer holds."""


def forget_job(job_id: str) -> None:
    """Drop `job_id`'s series from the trainer's per-job metrics (the job ended, or another
    replica took it over), so that series do not pile up with every job ever trained: each
    counter's count moves to its `ENDED_JOB` series (a sum over jobs never goes down, as a
    counter's must not), the gauge goes."""
    for counter in (TRAINER_STEPS, TRAINER_GROUPS_DROPPED):
        for family in counter.collect():
            for sample in family.samples:
                labels = sample.labels
                if sample.name.endswith("_total") and labels.get("job_id") == job_id:
                    rest = [v for k, v in labels.items() if k != "job_id"]
                    counter.labels(ENDED_JOB, *rest).inc(sample.value)
                    counter.remove(job_id, *rest)
    TRAINER_TOKENS_PER_SECOND.remove(job_id)


SERVICE_METRICS: dict[str, tuple[Collector, ...]] = {
    "rollout_svc": (
        ROLLOUT_BUSY_FRACTION,
        ROLLOUT_COMPUTE_FRACTION,
        ROLLOUT_MEAN_BATCH,
        ROLLOUT_TOKENS_PER_SECOND,
        ROLLOUT_GENERATED_TOKENS,
        ROLLOUT_REQUESTS_IN_FLIGHT,
        ROLLOUT_ADAPTERS_LOADED,
    ),
    "trainer_svc": (
        TRAINER_BUSY_SECONDS,
        TRAINER_STEP_SECONDS,
        TRAINER_TOKENS_PER_SECOND,
        TRAINER_STEPS,
        TRAINER_GROUPS_DROPPED,
    ),
}
_exported: set[Collector] = set()


def export_service_metrics(service: str) -> None:
    """Serve `service`'s own metrics from now on; calling it again changes nothing."""
    for metric in SERVICE_METRICS.get(service, ()):
        if metric not in _exported:
            REGISTRY.register(metric)
            _exported.add(metric)


# --- what /metrics shows of jobs ------------------------------------------------------

JOB_LABELS = frozenset({"job_id", "tenant"})
"""Labels that name a job or its tenant."""
JOB_NAMED_FAMILIES = frozenset({"vllm:lora_requests_info"})
"""Families whose label values list jobs' adapters by name (`<job>@v<n>`)."""


class WithoutJobLabels(Collector):
    """`registry`'s metrics with no job or tenant in them, for a /metrics that anyone who
    reaches the port may read: counters and histograms are summed over jobs (the sum of
    every job's steps is the trainer's), a per-job gauge is left out (one job's level does
    not add up with another's), and so is a family that names adapters."""

    def __init__(self, registry: Collector) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if family.name in JOB_NAMED_FAMILIES:
                continue
            if not any(JOB_LABELS & sample.labels.keys() for sample in family.samples):
                yield family
            elif family.type != "gauge":
                yield _summed_over_jobs(family)


def _summed_over_jobs(family: Metric) -> Metric:
    """`family` with its job labels dropped and the samples that then coincide added up (a
    histogram's buckets keep their order: the first job's samples set it)."""
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        labels = tuple((k, v) for k, v in sample.labels.items() if k not in JOB_LABELS)
        key = (sample.name, labels)
        values[key] = values.get(key, 0.0) + sample.value
    summed = Metric(family.name, family.documentation, family.type, family.unit)
    for (name, labels), value in values.items():
        summed.add_sample(name, dict(labels), value)
    return summed
