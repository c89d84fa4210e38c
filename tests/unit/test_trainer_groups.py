"""trainer_svc.groups: which groups are trained and which are dropped, and why."""

from __future__ import annotations

import functools
from collections import deque

from common.wire.messages import Trajectory
from tests.handler_kit import job_spec
from trainer_svc.groups import MIN_SIGNAL_SHARE, SIGNAL_WINDOW, Group, verdict, worth_resampling
from trainer_svc.owned import OwnedJob


def trajectory(
    episode: str, versions: list[int], reward: float = 1.0, error: str = ""
) -> Trajectory:
    return Trajectory(
        episode_id=episode,
        job_id="j",
        group_id="g",
        sample_index=0,
        group_size=3,
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        behaviour_logprobs=[0.0, -1.0, -1.0],
        reward=reward,
        adapter_versions=versions,
        error=error,
    )


def group(*trajectories: Trajectory) -> tuple[Group, list[str]]:
    released: list[str] = []
    built = Group("g")
    for t in trajectories:
        built.add(t, functools.partial(released.append, t.episode_id))
    return built, released


def test_the_oldest_turn_decides_staleness() -> None:
    g, _ = group(trajectory("a", [3, 4]), trajectory("b", [4]), trajectory("c", [2, 4, 4]))
    assert g.oldest_version == 2
    assert verdict(g, trained_version=4, max_staleness=2) == ("train", "2 versions behind")
    kind, reason = verdict(g, trained_version=5, max_staleness=2)
    assert kind == "dropped_stale" and reason.startswith("3 versions behind")


def test_on_policy_bound_accepts_only_the_current_version() -> None:
    g, _ = group(trajectory("a", [7]), trajectory("b", [7]), trajectory("c", [7]))
    assert verdict(g, trained_version=7, max_staleness=0)[0] == "train"
    assert verdict(g, trained_version=8, max_staleness=0)[0] == "dropped_stale"


def test_a_group_needs_two_rewarded_trajectories() -> None:
    g, _ = group(
        trajectory("a", [0]),
        trajectory("b", [0], error="reward 'correct' failed: ZeroDivisionError"),
        trajectory("c", [0], error="reward 'correct' failed: ZeroDivisionError"),
    )
    kind, reason = verdict(g, trained_version=0, max_staleness=1)
    assert kind == "dropped_invalid"
    assert reason == "1 rewarded trajectories; reward 'correct' failed: ZeroDivisionError"
    g2, _ = group(
        trajectory("a", [0]), trajectory("b", [0], reward=0.0), trajectory("c", [0], error="x")
    )
    assert verdict(g2, trained_version=0, max_staleness=1)[0] == "train"
    assert [t.episode_id for t in g2.valid] == ["a", "b"]


def test_dynamic_sampling_drops_only_groups_whose_rewards_are_all_equal() -> None:
    """With `resample_uniform` a group whose rewards are all equal (every advantage 0) is
    dropped to be replaced; a failed trajectory does not make a group uneven, and staleness
    and too few rewards are still the reasons they were."""
    solved, _ = group(trajectory("a", [0]), trajectory("b", [0]), trajectory("c", [0]))
    kind, reason = verdict(solved, trained_version=0, max_staleness=1, resample_uniform=True)
    assert (kind, reason) == ("dropped_uniform", "all 3 rewards 1: resampled")
    assert verdict(solved, trained_version=0, max_staleness=1)[0] == "train"
    failed, _ = group(
        trajectory("a", [0], reward=0.0),
        trajectory("b", [0], reward=0.0),
        trajectory("c", [0], reward=1.0, error="episode timed out"),
    )
    assert verdict(failed, trained_version=0, max_staleness=1, resample_uniform=True) == (
        "dropped_uniform",
        "all 2 rewards 0: resampled",
    )
    mixed, _ = group(trajectory("a", [0]), trajectory("b", [0], reward=0.5))
    assert verdict(mixed, trained_version=0, max_staleness=1, resample_uniform=True)[0] == "train"
    assert verdict(solved, trained_version=3, max_staleness=1, resample_uniform=True)[0] == (
        "dropped_stale"
    )
    lone, _ = group(trajectory("a", [0]), trajectory("b", [0], error="x"))
    assert verdict(lone, trained_version=0, max_staleness=1, resample_uniform=True)[0] == (
        "dropped_invalid"
    )


def test_resampling_pays_only_while_enough_recent_groups_had_a_signal() -> None:
    assert worth_resampling([]) and worth_resampling([False] * 3)
    assert not worth_resampling([False] * 4)
    solved = [False] * SIGNAL_WINDOW
    assert not worth_resampling(solved)
    needed = round(MIN_SIGNAL_SHARE * SIGNAL_WINDOW)
    assert not worth_resampling([True] * (needed - 1) + solved[needed - 1 :])
    assert worth_resampling([True] * needed + solved[needed:])


def test_completion_and_releasing_holds() -> None:
    g, released = group(trajectory("a", [0]), trajectory("b", [0]))
    assert not g.complete(3)
    g.add(trajectory("c", [0]), lambda: released.append("c"))
    assert g.complete(3)
    g.release()
    assert released == ["a", "b", "c"]
    g.release()  # releasing twice commits nothing twice
    assert released == ["a", "b", "c"]


def filled(name: str, version: int) -> Group:
    built = Group(name)
    built.add(trajectory(name, [version]), lambda: None)
    return built


def test_a_step_takes_the_groups_sampled_with_the_oldest_version_first() -> None:
    """Ready in the order they completed; a step takes the oldest-sampled two (then in that
    order), so g5, sampled with v2, is not left to outrun the bound behind g6 and g7 (v3)."""
    spec = job_spec("order", group_size=1, groups_per_step=2, max_staleness=1, max_steps=9)
    job = OwnedJob(spec, partition=0, version=3)
    job.ready.extend(
        filled(name, version) for name, version in (("g6", 3), ("g5", 2), ("g7", 3), ("g4", 2))
    )
    assert [g.group_id for g in job.take_ready()] == ["g5", "g4"]
    assert [g.group_id for g in job.ready] == ["g6", "g7"]
    assert [g.group_id for g in job.take_ready()] == ["g6", "g7"] and not job.ready


def test_a_step_waits_a_while_for_an_older_group_it_would_leave_too_stale() -> None:
    """At v2 with S = 1, g5 (sampled with v1) is still filling while g6 and g7 (v2) are
    ready: trained now, the step makes v3 and g5 is dropped 2 versions behind. The step
    waits for it, up to the limit; not when what it takes is as old as g5."""
    spec = job_spec("wait", group_size=2, groups_per_step=2, max_staleness=1, max_steps=9)
    job = OwnedJob(spec, partition=0, version=2)
    job.filling["g5"] = filled("g5", 1)
    job.ready.extend([filled("g6", 2), filled("g7", 2)])
    assert job.waits(100.0, limit_s=30) and job.waits(129.0, limit_s=30)
    assert not job.waits(130.0, limit_s=30)  # waited long enough: g5 is left behind
    assert not job.waits(131.0, limit_s=0)  # never waits
    job.waiting_since = None
    job.ready.appendleft(filled("g4", 1))  # g4 + g6: g6 would still take g5's place
    assert job.waits(200.0, limit_s=30)
    job.ready.remove(next(g for g in job.ready if g.group_id == "g6"))
    job.ready.appendleft(filled("g3", 1))  # g3 + g4, both as old as g5: nothing to gain
    assert not job.waits(201.0, limit_s=30) and job.waiting_since is None
    job.filling["g5"] = filled("g5", 2)  # sampled with v2: still trainable after the step
    job.ready = deque([filled("g6", 2), filled("g7", 2)])
    assert not job.waits(202.0, limit_s=30)
    del job.filling["g5"]
    assert not job.waits(203.0, limit_s=30)
