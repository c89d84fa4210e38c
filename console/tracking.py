"""`marlaas track`: each job's hyper-parameters, step metrics and evaluations, written where
people already track experiments: TensorBoard event files and an MLflow tracking store.

One run per job, named by its job id, with the tenant and environment as tags. Metrics are
`train/<name>` at each adapter version the trainer announced (`step` events) and
`eval/<name>` at each evaluated version (`eval` events). An MLflow run ends with the job
(FINISHED, FAILED or KILLED). What was written is recorded per sink in `<out>/track.json`,
so `track` run again (or with `--follow` after a restart) writes only what is new.

A step trained again after a trainer restart (same version, new event) is written again:
both points show, as they happened; `marlaas report` keeps the later one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from common.wire.lifecycle import STATE_AFTER, TERMINAL_STATES
from common.wire.messages import Event, JobSpec

TRACK_EXTRA = "pip install 'marlaas[track]'"
MLFLOW_EXPERIMENT = "marlaas"
MLFLOW_END_STATUS = {"completed": "FINISHED", "cancelled": "KILLED"}
"""MLflow's run status at a job's end; every other end (failed, rejected) is FAILED."""


class TrackingUnavailableError(RuntimeError):
    """A sink's package is not installed; the message says which extra brings it."""


@dataclass(frozen=True)
class TrackedJob:
    job_id: str
    tenant: str
    env: str
    params: Mapping[str, str | int | float | bool]


def tracked_job(spec: JobSpec) -> TrackedJob:
    """The job as a run: its settings flattened to `section.name` hyper-parameters."""
    settings = msgspec.to_builtins(spec)
    params = dict(_flatten({k: settings[k] for k in ("base_model", "env", "lora", "rl", "eval")}))
    return TrackedJob(spec.job_id, spec.tenant, spec.env.name, params)


def _flatten(value: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, Mapping):
            yield from _flatten(item, f"{name}.")
        elif isinstance(item, str | int | float | bool):
            yield name, item
        else:  # lists (LoRA target modules, stop strings), None
            yield name, json.dumps(item)


def event_metrics(event: Event) -> dict[str, float]:
    """The metrics an event contributes to a run, by their tracked names; {} for events
    that carry none worth plotting (lifecycle, drops)."""
    if event.event == "step":
        return {f"train/{name}": value for name, value in event.metrics.items()}
    if event.event == "eval":
        return {f"eval/{name.removeprefix('eval_')}": v for name, v in event.metrics.items()}
    return {}


class Sink(Protocol):
    name: str

    def open_run(self, job: TrackedJob) -> None: ...
    def log(self, job_id: str, step: int, metrics: Mapping[str, float], at: float) -> None: ...
    def end_run(self, job_id: str, state: str) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """`<dir>/<job id>/` event files (one more per `track` run), with the job's settings in
    TensorBoard's hyper-parameters plugin."""

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as exc:
            raise TrackingUnavailableError(f"TensorBoard is not installed: {TRACK_EXTRA}") from exc
        self._writer_class = EventFileWriter
        self.log_dir = log_dir
        self._writers: dict[str, Any] = {}

    def open_run(self, job: TrackedJob) -> None:
        from tensorboard.compat.proto.event_pb2 import Event as TbEvent
        from tensorboard.plugins.hparams import summary_v2

        writer = self._writers[job.job_id] = self._writer_class(str(self.log_dir / job.job_id))
        hparams = {**job.params, "tenant": job.tenant}
        summary = summary_v2.hparams_pb(hparams, trial_id=job.job_id)
        writer.add_event(TbEvent(wall_time=time.time(), summary=summary))

    def log(self, job_id: str, step: int, metrics: Mapping[str, float], at: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event as TbEvent
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=value) for name, value in metrics.items()]
        self._writers[job_id].add_event(
            TbEvent(wall_time=at, step=step, summary=Summary(value=values))
        )

    def end_run(self, job_id: str, state: str) -> None:
        self._writers[job_id].flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


class MlflowSink:
    """Runs in experiment `marlaas` of an MLflow tracking store (a local SQLite file, or a
    tracking server's URI); a job's run is found again by its `marlaas.job_id` tag."""

    name = "mlflow"

    def __init__(self, tracking_uri: str) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise TrackingUnavailableError(f"MLflow is not installed: {TRACK_EXTRA}") from exc
        self.client = MlflowClient(tracking_uri=tracking_uri)
        experiment = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        self.experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(MLFLOW_EXPERIMENT)
        )
        self._runs: dict[str, str] = {}

    def open_run(self, job: TrackedJob) -> None:
        from mlflow.entities import Param

        found = self.client.search_runs(
            [self.experiment_id], f"tags.`marlaas.job_id` = '{job.job_id}'", max_results=1
        )
        if found:
            self._runs[job.job_id] = found[0].info.run_id
            return
        tags = {"marlaas.job_id": job.job_id, "marlaas.tenant": job.tenant, "env": job.env}
        run = self.client.create_run(self.experiment_id, run_name=job.job_id, tags=tags)
        self._runs[job.job_id] = run.info.run_id
        params = [Param(name, str(value)) for name, value in job.params.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 per batch
            self.client.log_batch(run.info.run_id, params=params[start : start + 100])

    def log(self, job_id: str, step: int, metrics: Mapping[str, float], at: float) -> None:
        from mlflow.entities import Metric

        stamp = int(at * 1000)
        batch = [Metric(name, value, stamp, step) for name, value in metrics.items()]
        self.client.log_batch(self._runs[job_id], metrics=batch)

    def end_run(self, job_id: str, state: str) -> None:
        status = MLFLOW_END_STATUS.get(state, "FAILED")
        self.client.set_terminated(self._runs[job_id], status)

    def close(self) -> None:
        pass


class Tracker:
    """Writes jobs' events to every sink, once each: `<out>/track.json` keeps, per sink,
    the event ids already written."""

    def __init__(self, out_dir: Path, sinks: Sequence[Sink]) -> None:
        self.out_dir = out_dir
        self.sinks = list(sinks)
        self._cursor_path = out_dir / "track.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        self._cursor: dict[str, list[str]] = (
            json.loads(self._cursor_path.read_text()) if self._cursor_path.exists() else {}
        )
        self._written: dict[str, set[str]] = {
            sink.name: set(self._cursor.get(sink.name, [])) for sink in self.sinks
        }
        self._open: dict[str, set[str]] = {sink.name: set() for sink in self.sinks}

    def write(self, events: Sequence[Event], specs: Mapping[str, JobSpec]) -> int:
        """Write the events not yet written (of jobs with a spec); returns how many sink
        writes that took."""
        written = 0
        for event in events:
            spec = specs.get(event.job_id)
            if spec is None:
                continue
            metrics = event_metrics(event)
            state = STATE_AFTER.get(event.event)
            ends = state in TERMINAL_STATES
            if not metrics and not ends:
                continue
            for sink in self.sinks:
                if event.event_id in self._written[sink.name]:
                    continue
                if event.job_id not in self._open[sink.name]:
                    sink.open_run(tracked_job(spec))
                    self._open[sink.name].add(event.job_id)
                if metrics:
                    sink.log(event.job_id, event.step, metrics, event.at)
                if ends:
                    assert state is not None
                    sink.end_run(event.job_id, state)
                self._written[sink.name].add(event.event_id)
                written += 1
        if written:
            self._save()
        return written

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def _save(self) -> None:
        # Other sinks' entries stay: a run with --no-mlflow must not forget what MLflow has.
        self._cursor.update({name: sorted(ids) for name, ids in self._written.items()})
        temporary = self._cursor_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self._cursor))
        temporary.replace(self._cursor_path)
