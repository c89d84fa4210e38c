"""`marlaas export JOB --best`: the trained version with the best held-out accuracy."""

from __future__ import annotations

from common.wire.messages import Event, job_event
from marlaas.export import best_version


def evaluated(version: int, accuracy: float) -> Event:
    return job_event("j", "eval", "env_svc", step=version, metrics={"eval_accuracy": accuracy})


def test_the_best_trained_version_wins_and_a_tie_goes_to_the_later_one() -> None:
    events = [evaluated(0, 0.9), evaluated(2, 0.5), evaluated(4, 0.75), evaluated(6, 0.75)]
    events.append(job_event("j", "step", "trainer_svc", step=7, metrics={"mean_reward": 1.0}))
    # The base (0.9) is no candidate: it has no adapter (and the job says it is below it).
    assert best_version(events) == (6, 0.75)


def test_nothing_evaluated_but_the_base_gives_none() -> None:
    assert best_version([evaluated(0, 0.5)]) is None
    assert best_version([]) is None
