"""`marlaas track`'s writer (console/tracking.py), read back by TensorBoard's and MLflow's
own readers; the CLI against a real broker is in tests/integration/test_cli.py."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from common.wire.messages import EnvSettings, EvalSettings, Event, JobSpec, RLSettings, job_event
from console.tracking import (
    MlflowSink,
    TensorBoardSink,
    Tracker,
    TrackingUnavailableError,
    event_metrics,
    tracked_job,
)
from tests.track_readers import mlflow_run, tensorboard_hparams, tensorboard_scalars

SPEC = JobSpec(
    job_id="track-1",
    tenant="acme",
    base_model="smollm2-135m-instruct",
    env=EnvSettings(name="arithmetic", params={"max_operand": 9}),
    rl=RLSettings(group_size=4, learning_rate=2e-4),
    eval=EvalSettings(tasks=16, every_steps=2),
)


def history(steps: int, *, ended: bool) -> list[Event]:
    events = [job_event(SPEC.job_id, "accepted", "env_svc", tenant="acme")]
    eval_metrics = {"eval_accuracy": 0.5, "eval_accuracy_stderr": 0.125, "eval_episodes": 16.0}
    events.append(job_event(SPEC.job_id, "eval", "env_svc", tenant="acme", metrics=eval_metrics))
    for step in range(1, steps + 1):
        metrics = {"mean_reward": step / 10, "loss": 0.5 - step / 100, "entropy": 1.5}
        events.append(
            job_event(SPEC.job_id, "step", "trainer_svc", tenant="acme", step=step, metrics=metrics)
        )
        events.append(job_event(SPEC.job_id, "dropped_stale", "trainer_svc", tenant="acme"))
    if ended:
        metrics = {"eval_accuracy": 0.75, "eval_accuracy_stderr": 0.11, "eval_episodes": 16.0}
        events.append(
            job_event(SPEC.job_id, "eval", "env_svc", tenant="acme", step=steps, metrics=metrics)
        )
        events.append(job_event(SPEC.job_id, "completed", "trainer_svc", tenant="acme"))
    return events


def assert_points(found: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    assert [step for step, _ in found] == [step for step, _ in expected]
    assert [value for _, value in found] == pytest.approx([value for _, value in expected])


def tracker(out: Path, *, tensorboard: bool = True, mlflow: bool = True) -> Tracker:
    sinks: list[TensorBoardSink | MlflowSink] = []
    if tensorboard:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    if mlflow:
        sinks.append(MlflowSink(f"sqlite:///{out / 'mlflow.db'}"))
    return Tracker(out, sinks)


def test_metrics_are_named_by_where_they_come_from() -> None:
    step, evaluation = history(1, ended=True)[2], history(1, ended=True)[-2]
    # The learning signals too (issue 26): entropy, KL, clip fraction, zero-advantage share.
    assert event_metrics(step) == {
        "train/mean_reward": 0.1,
        "train/loss": 0.49,
        "train/entropy": 1.5,
    }
    assert event_metrics(evaluation)["eval/accuracy"] == 0.75
    assert event_metrics(evaluation)["eval/accuracy_stderr"] == 0.11
    assert event_metrics(history(1, ended=True)[-1]) == {}


def test_settings_become_flat_hyper_parameters() -> None:
    params = tracked_job(SPEC).params
    assert params["rl.group_size"] == 4 and params["rl.learning_rate"] == 2e-4
    assert params["env.params.max_operand"] == 9 and params["eval.every_steps"] == 2
    assert params["lora.target_modules"] == '["q_proj", "k_proj", "v_proj", "o_proj"]'
    assert "job_id" not in params and "tenant" not in params


def test_a_job_reads_back_from_tensorboard_and_mlflow(tmp_path: Path) -> None:
    written = tracker(tmp_path)
    assert written.write(history(3, ended=True), {SPEC.job_id: SPEC}) == 2 * 6
    written.close()
    log_dir = tmp_path / "tensorboard" / SPEC.job_id
    assert_points(tensorboard_scalars(log_dir, "train/mean_reward"), [(1, 0.1), (2, 0.2), (3, 0.3)])
    assert tensorboard_scalars(log_dir, "eval/accuracy") == [(0, 0.5), (3, 0.75)]
    hparams = tensorboard_hparams(log_dir)
    assert hparams["rl.learning_rate"] == pytest.approx(2e-4) and hparams["tenant"] == "acme"
    run, metrics = mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", SPEC.job_id)
    assert run.info.status == "FINISHED" and run.info.run_name == SPEC.job_id
    assert run.data.tags["marlaas.tenant"] == "acme" and run.data.tags["env"] == "arithmetic"
    assert run.data.params["rl.group_size"] == "4"
    assert_points(metrics["train/mean_reward"], [(1, 0.1), (2, 0.2), (3, 0.3)])
    assert metrics["eval/accuracy"] == [(0, 0.5), (3, 0.75)]


def test_tracking_again_writes_only_what_is_new(tmp_path: Path) -> None:
    events = history(3, ended=True)
    first = tracker(tmp_path)
    first.write(events[:6], {SPEC.job_id: SPEC})  # through step 2
    first.close()
    run, _ = mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", SPEC.job_id)
    assert run.info.status == "RUNNING"
    # The whole history again, as a restarted `marlaas track` reads it from the topic start.
    again = tracker(tmp_path)
    assert again.write(events, {SPEC.job_id: SPEC}) == 2 * 3  # step 3, its eval, the end
    again.close()
    run, metrics = mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", SPEC.job_id)
    assert run.info.status == "FINISHED"
    assert [step for step, _ in metrics["train/mean_reward"]] == [1, 2, 3]
    log_dir = tmp_path / "tensorboard" / SPEC.job_id
    assert [step for step, _ in tensorboard_scalars(log_dir, "train/loss")] == [1, 2, 3]


def test_a_sink_left_out_keeps_its_cursor(tmp_path: Path) -> None:
    events = history(2, ended=False)
    only_tensorboard = tracker(tmp_path, mlflow=False)
    assert only_tensorboard.write(events, {SPEC.job_id: SPEC}) == 3  # eval, 2 steps
    only_tensorboard.close()
    both = tracker(tmp_path)
    assert both.write(events, {SPEC.job_id: SPEC}) == 3  # MLflow's; TensorBoard has them
    both.close()
    again = tracker(tmp_path, mlflow=False)
    assert again.write(events, {SPEC.job_id: SPEC}) == 0
    again.close()


def test_failed_and_cancelled_jobs_end_their_mlflow_run_so(tmp_path: Path) -> None:
    for state, status in (("failed", "FAILED"), ("cancelled", "KILLED")):
        spec = msgspec.structs.replace(SPEC, job_id=f"track-{state}")
        events = [job_event(spec.job_id, state, "trainer_svc", tenant="acme", reason="x")]  # type: ignore[arg-type]
        written = tracker(tmp_path, tensorboard=False)
        written.write(events, {spec.job_id: spec})
        run, _ = mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", spec.job_id)
        assert run.info.status == status


def test_events_of_an_unknown_job_are_not_written(tmp_path: Path) -> None:
    assert tracker(tmp_path).write(history(1, ended=True), {}) == 0


@pytest.mark.parametrize(
    ("module", "sink"),
    [
        ("tensorboard.summary.writer.event_file_writer", lambda p: TensorBoardSink(p)),
        ("mlflow.tracking", lambda p: MlflowSink(f"sqlite:///{p / 'm.db'}")),
    ],
)
def test_a_missing_package_names_the_extra(
    module: str, sink: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(TrackingUnavailableError, match=r"marlaas\[track\]"):
        sink(tmp_path)  # type: ignore[operator]
