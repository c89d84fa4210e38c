"""trackio: a run per job in project `marlaas` of a local trackio directory (a SQLite file per
project), written through trackio's own storage.

Not through `trackio.init()`: that keeps one current run per process (each `init` finishes
the previous one, where `track` keeps a run open per job), asks the Hugging Face Hub who the
user is, and prints to stdout. The storage writes synchronously, with each event's time.
trackio has no run state: the job's end is the config's `state`, written with an empty row.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from console.tracking.runs import PROJECT, TrackedJob, installed

if TYPE_CHECKING:
    from trackio.sqlite_storage import SQLiteStorage


class TrackioSink:
    """Runs named and identified by their job id (a later `track` writes to the same run), the
    job's settings and tenant as config; view with `TRACKIO_DIR=<dir> trackio show`."""

    name = "trackio"

    def __init__(self, directory: Path) -> None:
        self._storage_module: Any = installed("trackio.sqlite_storage", "trackio")
        self.directory = directory
        self._configs: dict[str, dict[str, Any]] = {}

    def open_run(self, job: TrackedJob) -> None:
        # Every write replaces the run's config: keep what an earlier `track` wrote (its end).
        written = self._storage().get_run_config(PROJECT, run_id=job.job_id) or {}
        self._configs[job.job_id] = {**written, **job.params, "tenant": job.tenant}

    def log(self, job_id: str, step: int, metrics: Mapping[str, float], at: float) -> None:
        self._write(job_id, dict(metrics), step, at)

    def end_run(self, job_id: str, state: str) -> None:
        self._configs[job_id]["state"] = state
        last_step = self._storage().get_max_step_for_run(PROJECT, run_id=job_id)
        self._write(job_id, {}, last_step or 0, time.time())

    def close(self) -> None:
        pass

    def _write(self, job_id: str, metrics: dict[str, float], step: int, at: float) -> None:
        self._storage().bulk_log(
            project=PROJECT,
            run=job_id,
            run_id=job_id,
            metrics_list=[metrics],
            steps=[step],
            timestamps=[datetime.fromtimestamp(at, UTC).isoformat()],
            config=self._configs[job_id],
        )

    def _storage(self) -> type[SQLiteStorage]:
        # trackio reads TRACKIO_DIR once, when imported, into this module's global (its own
        # tests point it elsewhere the same way): point it here before every use.
        self._storage_module.TRACKIO_DIR = self.directory
        return self._storage_module.SQLiteStorage
