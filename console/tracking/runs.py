"""What every tracking sink writes: a job as a run (`TrackedJob`), an event's metrics by their
tracked names, and the `Sink` protocol each tool's writer follows."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import msgspec

from common.wire.messages import Event, JobSpec

TRACK_EXTRA = "pip install 'marlaas[track]'"
PROJECT = "marlaas"
"""The MLflow experiment, W&B project and trackio project every job's run is in."""


class TrackingUnavailableError(RuntimeError):
    """A sink's package is not installed; the message says which extra brings it."""


def installed(module: str, package: str) -> ModuleType:
    """`module` imported; TrackingUnavailableError naming `package` and the extra that brings
    it when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackingUnavailableError(f"{package} is not installed: {TRACK_EXTRA}") from exc


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
    """One tool's writer: a run per job, opened once per `Tracker`, `step` the adapter
    version, `at` the event's Unix time; `end_run` with the job's terminal state."""

    name: str

    def open_run(self, job: TrackedJob) -> None: ...
    def log(self, job_id: str, step: int, metrics: Mapping[str, float], at: float) -> None: ...
    def end_run(self, job_id: str, state: str) -> None: ...
    def close(self) -> None: ...
