"""`Tracker`: writes jobs' events to every selected sink, each event once per sink."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from common.wire.lifecycle import STATE_AFTER, TERMINAL_STATES
from common.wire.messages import Event, JobSpec
from console.tracking.runs import Sink, event_metrics, tracked_job


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
