"""TensorBoard: a run directory of event files per job, its settings in the hparams plugin."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from console.tracking.runs import TrackedJob, installed


class TensorBoardSink:
    """`<dir>/<job id>/` event files (one more per `track` run), with the job's settings in
    TensorBoard's hyper-parameters plugin."""

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        writers = installed("tensorboard.summary.writer.event_file_writer", "TensorBoard")
        self._writer_class = writers.EventFileWriter
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
