"""Read what `marlaas track` wrote back with each tool's own reader: TensorBoard's event
loader, MLflow's client, W&B's transaction-log reader and trackio's storage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a tag, as TensorBoard's event loader reads the run directory."""
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def tensorboard_tags(log_dir: Path) -> list[str]:
    """The run directory's scalar tags (metric names)."""
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return list(accumulator.Tags()["scalars"])


def tensorboard_hparams(log_dir: Path) -> dict[str, Any]:
    """The run's hyper-parameters, as TensorBoard's hparams plugin decodes them."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    content = accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    found: dict[str, Any] = {}
    for name, value in data.session_start_info.hparams.items():
        kind = value.WhichOneof("kind")
        found[name] = getattr(value, kind)
    return found


def mlflow_run(tracking_uri: str, job_id: str) -> tuple[Any, dict[str, list[tuple[int, float]]]]:
    """The job's run in experiment `marlaas` (found by its tag) and each metric's history."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("marlaas")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], f"tags.`marlaas.job_id` = '{job_id}'")
    assert len(runs) == 1, runs
    run = runs[0]
    history = {
        name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        for name in run.data.metrics
    }
    return run, history


@dataclass
class WandbOfflineRun:
    """A W&B run as its offline files hold it: every file of the run id, in start order."""

    run_id: str
    name: str
    config: dict[str, Any]
    tags: list[str]
    summary: dict[str, Any]
    exit_codes: list[int]
    """One per file (per `track` that wrote the run), in order."""
    rows: list[dict[str, Any]]
    """History rows, in W&B's step order."""

    def points(self, name: str, x: str = "adapter_version") -> list[tuple[int, float]]:
        """(x, value) of each row holding metric `name`."""
        return [(int(row[x]), row[name]) for row in self.rows if name in row]

    def metrics(self) -> dict[str, list[tuple[int, float]]]:
        """Each `train/*` and `eval/*` metric's points, by name."""
        names = {name for row in self.rows for name in row if name.startswith(("train/", "eval/"))}
        return {name: self.points(name) for name in names}


def wandb_offline_run(root: Path, job_id: str) -> WandbOfflineRun:
    """The run's `<root>/wandb/offline-run-*/run-<id>.wandb` transaction logs, decoded by
    W&B's own reader (`wandb leet inspect --json`, in wandb-core), history and all."""
    files = sorted((root / "wandb").glob(f"offline-run-*/run-{job_id}.wandb"))
    assert files, f"no offline W&B file of {job_id} under {root}"
    segments = sorted((_wandb_records(path) for path in files), key=_started)
    records = [record for segment in segments for record in segment]
    last = [record["run"] for record in records if record["type"] == "run"][-1]
    summary: dict[str, Any] = {}
    rows, exit_codes = [], []
    for record in records:
        if record["type"] == "summary":
            summary.update(record["summary"].get("update", {}))
        elif record["type"] == "history":
            rows.append(record["history"]["item"])
        elif record["type"] == "exit":
            exit_codes.append(record["exit"].get("exit_code", 0))
    config = {k: v for k, v in last["config"]["update"].items() if k != "_wandb"}
    rows.sort(key=lambda row: row["_step"])
    return WandbOfflineRun(
        run_id=last["run_id"],
        name=last["display_name"],
        config=config,
        tags=last["tags"],
        summary=summary,
        exit_codes=exit_codes,
        rows=rows,
    )


def _wandb_records(path: Path) -> list[dict[str, Any]]:
    # Offline, and not reporting wandb-core's errors to W&B: the reader sends nothing either.
    env = os.environ | {"WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    printed = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in printed.stdout.splitlines() if line.strip()]


def _started(records: list[dict[str, Any]]) -> str:
    return next(record["run"]["start_time"] for record in records if record["type"] == "run")


def trackio_run(directory: Path, job_id: str) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The job's run in trackio project `marlaas` under `directory`, by trackio's own storage:
    its config and each metric's (step, value) in trackio's order (time, then insertion)."""
    import trackio.sqlite_storage as storage

    storage.TRACKIO_DIR = directory  # trackio's own tests point it so
    config = storage.SQLiteStorage.get_run_config("marlaas", run_id=job_id)
    assert config is not None, f"no trackio run {job_id} under {directory}"
    history: dict[str, list[Any]] = {}
    for row in storage.SQLiteStorage.get_logs("marlaas", run_id=job_id):
        for name, value in row.items():
            if name not in ("step", "timestamp"):
                history.setdefault(name, []).append((row["step"], value))
    return config, history
