"""JobProgress: what the CLI's status and the demo compute from a job's events."""

from __future__ import annotations

import msgspec
import pytest

from common.wire.messages import Event, job_event
from console.status.board import JobRow, StatusSnapshot
from console.status.live import ProgressLog
from marlaas.jobwatch import ETA_WINDOW, JobProgress


def at(event: Event, when: float) -> Event:
    return msgspec.structs.replace(event, at=when)


def progress(accepted_at: float, step_times: list[float], max_steps: int = 12) -> JobProgress:
    job = JobProgress("j", "acme", "arithmetic", max_steps)
    job.apply(at(job_event("j", "accepted", "env_svc", tenant="acme"), accepted_at))
    for step, when in enumerate(step_times, start=1):
        event = job_event("j", "step", "trainer_svc", step=step, metrics={"mean_reward": 0.5})
        job.apply(at(event, when))
    return job


def test_early_eta_uses_the_pace_since_acceptance_not_the_burst_of_the_first_steps() -> None:
    # Step 1 took 60 s (rollouts first), step 2 came 2 s later (generated during step 1).
    job = progress(1000.0, [1060.0, 1062.0])
    # 62 s for 2 steps -> 31 s per step, 10 steps to go; asked right at step 2.
    assert job.eta_s(1062.0) == pytest.approx(310.0)


def test_later_eta_follows_the_recent_pace() -> None:
    slow_then_fast = [1000.0 + 100 * i for i in range(1, 5)] + [
        1400.0 + 10 * i for i in range(1, 7)
    ]
    job = progress(1000.0, slow_then_fast)
    assert len(job.step_at) > ETA_WINDOW
    # The last 5 intervals are 10 s each; 2 steps to go; asked 5 s after the last step.
    assert job.eta_s(1465.0) == pytest.approx(2 * 10.0 - 5.0)


def test_no_eta_before_a_pace_is_known_or_once_the_job_has_ended() -> None:
    assert progress(1000.0, []).eta_s(1010.0) is None
    job = progress(1000.0, [1010.0, 1020.0], max_steps=2)
    job.apply(at(job_event("j", "completed", "trainer_svc"), 1021.0))
    assert job.eta_s(1030.0) is None


def test_off_a_terminal_each_step_evaluation_and_state_change_is_printed_once() -> None:
    job = progress(1000.0, [1010.0, 1020.0], max_steps=3)
    row = JobRow(job, "running", in_flight_episodes=0)
    log = ProgressLog()
    first = log.new_lines(StatusSnapshot([row], [], [], taken_at=1021.0))
    assert [line.split(" ", 1)[1] for line in first] == [
        "j: running",
        "j: step 1/3 mean reward 0.500",
        "j: step 2/3 mean reward 0.500",
    ]
    assert log.new_lines(StatusSnapshot([row], [], [], taken_at=1022.0)) == []
    job.apply(
        at(job_event("j", "step", "trainer_svc", step=3, metrics={"mean_reward": 0.75}), 1030.0)
    )
    eval_metrics = {"eval_accuracy": 0.8125, "eval_accuracy_stderr": 0.069}
    job.apply(at(job_event("j", "eval", "env_svc", step=3, metrics=eval_metrics), 1031.0))
    job.apply(at(job_event("j", "completed", "trainer_svc"), 1032.0))
    row = JobRow(job, "completed", in_flight_episodes=0)
    later = log.new_lines(StatusSnapshot([row], [], [], taken_at=1033.0))
    assert [line.split(" ", 1)[1] for line in later] == [
        "j: completed",
        "j: step 3/3 mean reward 0.750",
        "j: eval v3 accuracy 0.812 ±0.069",
    ]


def test_status_carries_the_learning_signals_and_a_version_worse_than_the_base() -> None:
    job = progress(1000.0, [1010.0], max_steps=3)
    signals = {"entropy": 0.9, "approx_kl": 0.02, "clip_fraction": 0.1, "zero_advantage_share": 0.5}
    job.apply(
        at(job_event("j", "step", "trainer_svc", step=2, metrics={"loss": 0.1, **signals}), 1020)
    )
    worse = "held-out accuracy 0.344 of v2 is below the base model's 0.656"
    for version, reason in ((0, ""), (2, worse)):
        metrics = {"eval_accuracy": 0.5}
        job.apply(at(job_event("j", "eval", "env_svc", step=version, metrics=metrics,
                               reason=reason), 1021))  # fmt: skip
    row = JobRow(job, "running", in_flight_episodes=0).to_json(now=1022.0)
    assert row["learning"] == signals  # `marlaas status --json`
    assert row["below_base"] == worse
    summary = job.summary(window=3)
    assert summary["learning"] == signals and summary["below_base"] == worse
