"""Read what `marlaas track` wrote back with TensorBoard's and MLflow's own readers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a tag, as TensorBoard's event loader reads the run directory."""
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


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
