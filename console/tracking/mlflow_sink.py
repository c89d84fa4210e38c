"""MLflow: a run per job in experiment `marlaas`, ended with the job's state."""

from __future__ import annotations

from collections.abc import Mapping

from console.tracking.runs import PROJECT, TrackedJob, installed

MLFLOW_END_STATUS = {"completed": "FINISHED", "cancelled": "KILLED"}
"""MLflow's run status at a job's end; every other end (failed, rejected) is FAILED."""


class MlflowSink:
    """Runs in experiment `marlaas` of an MLflow tracking store (a local SQLite file, or a
    tracking server's URI); a job's run is found again by its `marlaas.job_id` tag."""

    name = "mlflow"

    def __init__(self, tracking_uri: str) -> None:
        tracking = installed("mlflow.tracking", "MLflow")
        self.client = tracking.MlflowClient(tracking_uri=tracking_uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        self.experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(PROJECT)
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
