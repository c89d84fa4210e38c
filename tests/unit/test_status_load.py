"""The trainer's busy share as `marlaas status` reads it from step events."""

from __future__ import annotations

import msgspec

from common.wire.messages import Event, job_event
from console.status.load import RECENT_S, TrainerLoad


def step(job_id: str, at: float, step_s: float) -> Event:
    sent = job_event(job_id, "step", "trainer_svc", step=1, metrics={"step_s": step_s})
    return msgspec.structs.replace(sent, at=at)


def test_the_trainer_is_as_busy_as_its_steps_seconds_per_second() -> None:
    load = TrainerLoad()
    assert load.busy(1000.0).recent is None and load.busy(1000.0).steps == 0
    first = step("a", 1010.0, 10.0)  # began at 1000
    for event in (first, step("b", 1010.0, 5.0), step("a", 1030.0, 15.0), first):
        load.add(event)  # the last one is a redelivery: counted once
    load.add(job_event("a", "eval", "env_svc", metrics={"step_s": 99.0}))  # not a step
    busy = load.busy(1040.0)
    assert busy.steps == 3
    assert busy.since_first_step == 30.0 / 40.0
    assert busy.recent == 30.0 / 40.0  # the window is no longer than the time since the start
    later = load.busy(1030.0 + RECENT_S + 1)  # only steps that ended in the last minute count
    assert later.recent == 0.0 and later.since_first_step == 30.0 / (RECENT_S + 31)
