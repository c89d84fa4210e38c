"""`marlaas track`'s writer (console/tracking/), read back by each tool's own reader:
TensorBoard's event loader, MLflow's client, W&B's transaction-log reader (offline files) and
trackio's storage; the CLI against a real broker is in tests/integration/test_cli.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgspec
import pytest

from common.runtime.config import SettingsError, load
from common.wire.messages import EnvSettings, EvalSettings, Event, JobSpec, RLSettings, job_event
from console.tracking import (
    SINK_NAMES,
    MlflowSink,
    TensorBoardSink,
    Tracker,
    TrackingUnavailableError,
    TrackioSink,
    TrackSettings,
    WandbSink,
    chosen_sinks,
    event_metrics,
    open_sinks,
    sink_names,
    tracked_job,
)
from tests.track_readers import (
    mlflow_run,
    tensorboard_hparams,
    tensorboard_scalars,
    tensorboard_tags,
    trackio_run,
    wandb_offline_run,
)

SPEC = JobSpec(
    job_id="track-1",
    tenant="acme",
    base_model="smollm2-135m-instruct",
    env=EnvSettings(name="arithmetic", params={"max_operand": 9}),
    rl=RLSettings(group_size=4, learning_rate=2e-4),
    eval=EvalSettings(tasks=16, every_steps=2),
)


@pytest.fixture(autouse=True)
def _offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline, reporting nothing, keeping its settings and caches in the test's dir."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def history(steps: int, *, ended: bool) -> list[Event]:
    events = [job_event(SPEC.job_id, "accepted", "env_svc", tenant="acme")]
    eval_metrics = {"eval_accuracy": 0.5, "eval_accuracy_stderr": 0.125, "eval_episodes": 16.0}
    events.append(job_event(SPEC.job_id, "eval", "env_svc", tenant="acme", metrics=eval_metrics))
    for step in range(1, steps + 1):
        events.append(step_event(step, mean_reward=step / 10))
        events.append(job_event(SPEC.job_id, "dropped_stale", "trainer_svc", tenant="acme"))
    if ended:
        events.append(eval_event(steps, accuracy=0.75))
        events.append(job_event(SPEC.job_id, "completed", "trainer_svc", tenant="acme"))
    return events


def step_event(step: int, *, mean_reward: float) -> Event:
    metrics = {"mean_reward": mean_reward, "loss": 0.5 - step / 100, "entropy": 1.5}
    return job_event(SPEC.job_id, "step", "trainer_svc", tenant="acme", step=step, metrics=metrics)


def eval_event(version: int, *, accuracy: float) -> Event:
    metrics = {"eval_accuracy": accuracy, "eval_accuracy_stderr": 0.11, "eval_episodes": 16.0}
    return job_event(SPEC.job_id, "eval", "env_svc", tenant="acme", step=version, metrics=metrics)


def as_it_happens() -> list[Event]:
    """Evaluations land after the trainer has moved on (version 1's after step 2), step 3 is
    trained again after a trainer restart, and the final evaluation comes after the end;
    a second apart (MLflow keeps one of two equal points of the same millisecond)."""
    events = [
        job_event(SPEC.job_id, "accepted", "env_svc", tenant="acme"),
        eval_event(0, accuracy=0.5),
        step_event(1, mean_reward=0.1),
        step_event(2, mean_reward=0.2),
        eval_event(1, accuracy=0.625),
        step_event(3, mean_reward=0.3),
        step_event(3, mean_reward=0.35),
        job_event(SPEC.job_id, "completed", "trainer_svc", tenant="acme"),
        eval_event(3, accuracy=0.75),
    ]
    start = time.time()
    return [msgspec.structs.replace(e, at=start + i) for i, e in enumerate(events)]


def assert_points(found: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    assert [step for step, _ in found] == [step for step, _ in expected]
    assert [value for _, value in found] == pytest.approx([value for _, value in expected])


def tracker(out: Path, *names: str) -> Tracker:
    """A tracker writing to the named sinks (TensorBoard and MLflow when none is named)."""
    sinks = open_sinks(
        names or ("tensorboard", "mlflow"),
        out,
        mlflow_uri=f"sqlite:///{out / 'mlflow.db'}",
        wandb_mode="offline",
    )
    return Tracker(out, sinks)


def every_metric(out: Path, job_id: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Each sink's metrics of the job, as (step, value) in the order written, by name."""
    log_dir = out / "tensorboard" / job_id
    _, mlflow_history = mlflow_run(f"sqlite:///{out / 'mlflow.db'}", job_id)
    _, trackio_history = trackio_run(out / "trackio", job_id)
    return {
        "tensorboard": {
            name: tensorboard_scalars(log_dir, name) for name in tensorboard_tags(log_dir)
        },
        "mlflow": mlflow_history,
        "wandb": wandb_offline_run(out, job_id).metrics(),
        "trackio": trackio_history,
    }


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


ALL_SINKS = ("tensorboard", "mlflow", "wandb", "trackio")


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


def test_the_same_metrics_read_back_from_all_four_sinks(tmp_path: Path) -> None:
    written = tracker(tmp_path, *ALL_SINKS)
    assert written.write(as_it_happens(), {SPEC.job_id: SPEC}) == 4 * 8
    written.close()
    found = every_metric(tmp_path, SPEC.job_id)
    tensorboard = found["tensorboard"]
    assert sorted(tensorboard) == [
        "eval/accuracy",
        "eval/accuracy_stderr",
        "eval/episodes",
        "train/entropy",
        "train/loss",
        "train/mean_reward",
    ]
    # Late evaluations, a step trained twice, an evaluation after the end: all there, as
    # they happened, at the adapter versions TensorBoard has them.
    assert tensorboard["eval/accuracy"] == [(0, 0.5), (1, 0.625), (3, 0.75)]
    assert_points(tensorboard["train/mean_reward"], [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.35)])
    for sink in ("mlflow", "wandb", "trackio"):
        assert sorted(found[sink]) == sorted(tensorboard), sink
        for name, points in tensorboard.items():
            assert_points(found[sink][name], points)


def test_wandb_and_trackio_runs_hold_the_job_and_its_end(tmp_path: Path) -> None:
    events = as_it_happens()
    for through in (-1, None):  # the end, then (another `track`) the evaluation after it
        written = tracker(tmp_path, "wandb", "trackio")
        written.write(events[:through], {SPEC.job_id: SPEC})
        written.close()
    wandb = wandb_offline_run(tmp_path, SPEC.job_id)
    assert wandb.run_id == SPEC.job_id and wandb.name == SPEC.job_id
    assert wandb.tags == ["acme", "arithmetic"]
    assert wandb.config["tenant"] == "acme" and wandb.config["rl.group_size"] == 4
    assert wandb.config["rl.learning_rate"] == pytest.approx(2e-4)
    # Offline, a file per `track`: the second one's evaluation leaves the run's end as it was.
    assert wandb.summary["state"] == "completed" and wandb.exit_codes == [0, 0]
    assert wandb.points("eval/accuracy") == [(0, 0.5), (1, 0.625), (3, 0.75)]
    assert [row["_timestamp"] for row in wandb.rows] == sorted(
        row["_timestamp"] for row in wandb.rows
    )
    config, _ = trackio_run(tmp_path / "trackio", SPEC.job_id)
    assert config["tenant"] == "acme" and config["env.name"] == "arithmetic"
    assert config["rl.group_size"] == 4 and config["state"] == "completed"


def test_tracking_again_writes_only_what_is_new(tmp_path: Path) -> None:
    events = history(3, ended=True)
    first = tracker(tmp_path, *ALL_SINKS)
    first.write(events[:6], {SPEC.job_id: SPEC})  # through step 2
    first.close()
    run, _ = mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", SPEC.job_id)
    assert run.info.status == "RUNNING"
    # The whole history again, as a restarted `marlaas track` reads it from the topic start.
    again = tracker(tmp_path, *ALL_SINKS)
    assert again.write(events, {SPEC.job_id: SPEC}) == 4 * 3  # step 3, its eval, the end
    again.close()
    run, _ = mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", SPEC.job_id)
    assert run.info.status == "FINISHED"
    found = every_metric(tmp_path, SPEC.job_id)
    for sink in ALL_SINKS:
        assert [step for step, _ in found[sink]["train/loss"]] == [1, 2, 3], sink
        assert [step for step, _ in found[sink]["eval/accuracy"]] == [0, 3], sink
    # W&B offline does not resume: a file per `track`, its rows after the first file's.
    wandb = wandb_offline_run(tmp_path, SPEC.job_id)
    assert wandb.exit_codes == [0, 0] and wandb.summary["state"] == "completed"
    assert [row["_step"] for row in wandb.rows] == list(range(5))


def test_a_sink_left_out_keeps_its_cursor(tmp_path: Path) -> None:
    events = history(2, ended=False)
    only_tensorboard = tracker(tmp_path, "tensorboard")
    assert only_tensorboard.write(events, {SPEC.job_id: SPEC}) == 3  # eval, 2 steps
    only_tensorboard.close()
    both = tracker(tmp_path)
    assert both.write(events, {SPEC.job_id: SPEC}) == 3  # MLflow's; TensorBoard has them
    both.close()
    again = tracker(tmp_path, "tensorboard")
    assert again.write(events, {SPEC.job_id: SPEC}) == 0
    again.close()


@pytest.mark.parametrize(
    ("state", "mlflow_status", "wandb_exit_code"),
    [("failed", "FAILED", 1), ("cancelled", "KILLED", 1), ("completed", "FINISHED", 0)],
)
def test_a_job_ends_its_run_with_its_state(
    state: str, mlflow_status: str, wandb_exit_code: int, tmp_path: Path
) -> None:
    spec = msgspec.structs.replace(SPEC, job_id=f"track-{state}")
    events = [job_event(spec.job_id, state, "trainer_svc", tenant="acme", reason="x")]  # type: ignore[arg-type]
    written = tracker(tmp_path, "mlflow", "wandb", "trackio")
    written.write(events, {spec.job_id: spec})
    written.close()
    run, _ = mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", spec.job_id)
    assert run.info.status == mlflow_status
    wandb = wandb_offline_run(tmp_path, spec.job_id)
    assert wandb.exit_codes == [wandb_exit_code] and wandb.summary["state"] == state
    config, history = trackio_run(tmp_path / "trackio", spec.job_id)
    assert config["state"] == state and history == {}


def test_events_of_an_unknown_job_are_not_written(tmp_path: Path) -> None:
    assert tracker(tmp_path).write(history(1, ended=True), {}) == 0


def test_sinks_are_chosen_by_name_in_one_order() -> None:
    assert sink_names(" Trackio,wandb,,wandb ") == ["wandb", "trackio"]
    assert sink_names(",".join(reversed(SINK_NAMES))) == list(SINK_NAMES)
    with pytest.raises(
        ValueError, match="unknown tracking sink 'neptune': choose from tensorboard"
    ):
        sink_names("wandb,neptune")


def test_the_flags_add_or_leave_out_one_sink() -> None:
    default = "tensorboard,mlflow"
    assert chosen_sinks("", default, tensorboard=None, mlflow="") == ["tensorboard", "mlflow"]
    assert chosen_sinks("wandb,trackio", default, tensorboard=None, mlflow="") == [
        "wandb",
        "trackio",
    ]
    assert chosen_sinks("wandb", default, tensorboard=True, mlflow="http://mlflow:5000") == [
        "tensorboard",
        "mlflow",
        "wandb",
    ]
    assert chosen_sinks("", default, tensorboard=False, mlflow="") == ["mlflow"]
    with pytest.raises(ValueError, match="nothing to write"):
        chosen_sinks("", default, tensorboard=False, mlflow="off")


def test_the_deployment_chooses_the_default_sinks_and_wandb_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MARLAAS_TRACK_TO", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert load(TrackSettings).to == "tensorboard,mlflow"
    assert load(TrackSettings).wandb_mode == "offline"
    monkeypatch.setenv("MARLAAS_TRACK_TO", "wandb,trackio")
    monkeypatch.setenv("WANDB_MODE", "online")
    assert sink_names(load(TrackSettings).to) == ["wandb", "trackio"]
    assert load(TrackSettings).wandb_mode == "online"
    monkeypatch.setenv("MARLAAS_TRACK_TO", "wandb,neptune")
    with pytest.raises(SettingsError) as error:
        load(TrackSettings)
    assert str(error.value) == (
        "MARLAAS_TRACK_TO='wandb,neptune': unknown tracking sink 'neptune': "
        "choose from tensorboard, mlflow, wandb, trackio"
    )


def test_wandb_writes_offline_or_online_and_offline_sends_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="offline or online"):
        WandbSink(tmp_path, "disabled")
    monkeypatch.delenv("WANDB_ERROR_REPORTING")
    WandbSink(tmp_path, "offline")
    assert os.environ["WANDB_ERROR_REPORTING"] == "false"  # wandb-core's own error reports


@pytest.mark.parametrize(
    ("module", "sink"),
    [
        ("tensorboard.summary.writer.event_file_writer", lambda p: TensorBoardSink(p)),
        ("mlflow.tracking", lambda p: MlflowSink(f"sqlite:///{p / 'm.db'}")),
        ("wandb", lambda p: WandbSink(p)),
        ("trackio.sqlite_storage", lambda p: TrackioSink(p)),
    ],
)
def test_a_missing_package_names_the_extra(
    module: str, sink: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(TrackingUnavailableError, match=r"marlaas\[track\]"):
        sink(tmp_path)  # type: ignore[operator]
