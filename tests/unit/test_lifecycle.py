"""The job lifecycle contract: one fold of events into a state, used by every reader."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest

from common.wire.lifecycle import (
    COMMAND_EVENT,
    CONSUMED_TOPICS,
    SERVICES,
    STATE_AFTER,
    TERMINAL_STATES,
    JobLifecycle,
    RolloutReplicaStats,
    StepMetrics,
)
from common.wire.messages import Event, EventKind, JobAction, Topic, job_event
from marlaas.jobwatch import JobProgress
from marlaas.report.numbers import build_report


def fold(*kinds: EventKind, reason: str = "") -> JobLifecycle:
    lifecycle = JobLifecycle()
    for kind in kinds:
        lifecycle.apply(job_event("j", kind, "test", reason=reason))
    return lifecycle


@pytest.mark.parametrize(
    ("kinds", "state"),
    [
        ((), "pending"),
        (("accepted",), "running"),
        (("step",), "running"),  # its `accepted` was not read
        (("accepted", "paused", "step"), "paused"),  # in-flight work still trains
        (("accepted", "paused", "resumed"), "running"),
        (("accepted", "completed", "paused"), "completed"),  # terminal states stick
        (("accepted", "cancelled", "resumed", "step"), "cancelled"),
        (("rejected", "accepted"), "rejected"),
        (("accepted", "dropped_stale", "dropped_invalid"), "running"),
    ],
)
def test_the_fold(kinds: tuple[EventKind, ...], state: str) -> None:
    lifecycle = fold(*kinds)
    assert lifecycle.state == state
    assert lifecycle.done == (state in TERMINAL_STATES)


def test_a_reason_is_kept_only_for_states_that_need_one() -> None:
    assert fold("rejected", reason="unknown environment").reason == "unknown environment"
    assert fold("accepted", "failed", reason="disk full").reason == "disk full"
    assert fold("accepted", "paused", reason="tenant asked").reason == ""


def test_every_command_announces_an_event_that_moves_the_state() -> None:
    assert set(COMMAND_EVENT) == set(get_args(JobAction))
    assert {STATE_AFTER[COMMAND_EVENT[a]] for a in COMMAND_EVENT} == {
        "paused",
        "running",
        "cancelled",
    }
    assert set(STATE_AFTER) <= set(get_args(EventKind))


def test_the_watcher_and_the_report_agree_with_the_fold() -> None:
    kinds: list[EventKind] = ["accepted", "step", "paused", "completed", "resumed"]
    sent = [
        msgspec.structs.replace(job_event("j", k, "test", step=1), at=float(i))
        for i, k in enumerate(kinds)
    ]
    progress = JobProgress("j", "acme", "arithmetic", 5)
    for event in sent:
        progress.apply(event)
    (summary,) = build_report(sent).jobs
    assert progress.status == summary.state == fold(*kinds).state == "completed"


def test_services_and_what_they_consume() -> None:
    assert SERVICES == ("env_svc", "rollout_svc", "trainer_svc")
    assert set(CONSUMED_TOPICS) == set(SERVICES)
    # Dropped groups reach env_svc on their own topic, never through the dashboards' events.
    assert Topic.CONTROL in CONSUMED_TOPICS["env_svc"]
    assert all(Topic.EVENTS not in topics for topics in CONSUMED_TOPICS.values())


def test_step_metrics_travel_as_a_map_and_ignore_unknown_names() -> None:
    metrics = StepMetrics(mean_reward=0.5, tokens=600.0, step_s=3.0)
    event: Event = job_event("j", "step", "trainer_svc", metrics=metrics.as_map())
    assert event.metrics == {"mean_reward": 0.5, "tokens": 600.0, "step_s": 3.0}
    read = StepMetrics.of({**event.metrics, "from_a_newer_trainer": 1.0})
    assert read == metrics
    assert read.trainer_tokens_per_s == 200.0
    assert StepMetrics().trainer_tokens_per_s is None


def test_replica_stats_keep_only_what_was_reported() -> None:
    stats = RolloutReplicaStats.of({"busy_s": 4.0, "uptime_s": 5.0})
    assert stats.as_map() == {"busy_s": 4.0, "uptime_s": 5.0}
    assert stats.tokens_per_s is None
