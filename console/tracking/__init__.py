"""`marlaas track`: each job's hyper-parameters, step metrics and evaluations, written where
people already track experiments: TensorBoard event files, an MLflow tracking store, Weights &
Biases runs (offline files by default) and a trackio project (local SQLite).

One run per job, named by its job id, with the tenant and environment as tags (or config).
Metrics have the same names in all four: `train/<name>` at each adapter version the trainer
announced (`step` events) and `eval/<name>` at each evaluated version (`eval` events). A run
ends with the job: MLflow's FINISHED, FAILED or KILLED, W&B's exit code and summary `state`,
trackio's config `state`. What was written is recorded per sink in `<out>/track.json`, so
`track` run again (or with `--follow` after a restart) writes only what is new.

A step trained again after a trainer restart (same version, new event) is written again:
both points show, as they happened; `marlaas report` keeps the later one.

Modules: `runs` (the run model and the `Sink` protocol), `tracker` (the cursor), a module per
sink, `selection` (which sinks, opened where).
"""

from console.tracking.mlflow_sink import MLFLOW_END_STATUS, MlflowSink
from console.tracking.runs import (
    PROJECT,
    TRACK_EXTRA,
    Sink,
    TrackedJob,
    TrackingUnavailableError,
    event_metrics,
    tracked_job,
)
from console.tracking.selection import (
    SINK_NAMES,
    TrackSettings,
    chosen_sinks,
    open_sinks,
    sink_names,
)
from console.tracking.tensorboard_sink import TensorBoardSink
from console.tracking.tracker import Tracker
from console.tracking.trackio_sink import TrackioSink
from console.tracking.wandb_sink import WandbSink

__all__ = [
    "MLFLOW_END_STATUS",
    "PROJECT",
    "SINK_NAMES",
    "TRACK_EXTRA",
    "MlflowSink",
    "Sink",
    "TensorBoardSink",
    "TrackSettings",
    "TrackedJob",
    "Tracker",
    "TrackingUnavailableError",
    "TrackioSink",
    "WandbSink",
    "chosen_sinks",
    "event_metrics",
    "open_sinks",
    "sink_names",
    "tracked_job",
]
