"""Group assembly rules of the trainer: when a group is complete, stale or unusable."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from common.state.flow import group_index_of
from common.wire.messages import DropKind, JobSpec, Trajectory

Verdict = Literal["train"] | DropKind
"""Train the group, or drop it (and why: the drop kinds of `GroupDropped`)."""


@dataclass
class Group:
    """Trajectories of one group as they arrive, with the commits they hold."""

    group_id: str
    trajectories: dict[str, Trajectory] = field(default_factory=dict)
    releases: list[Callable[[], None]] = field(default_factory=list)

    def add(self, trajectory: Trajectory, release: Callable[[], None]) -> None:
        """Keep a new episode's trajectory and the function that releases its commit."""
        self.trajectories[trajectory.episode_id] = trajectory
        self.releases.append(release)

    def complete(self, group_size: int) -> bool:
        return len(self.trajectories) >= group_size

    def release(self) -> None:
        for release in self.releases:
            release()
        self.releases.clear()

    @property
    def oldest_version(self) -> int:
        """The adapter version of the group's oldest sampled turn."""
        return min(v for t in self.trajectories.values() for v in t.adapter_versions or [0])

    @property
    def valid(self) -> list[Trajectory]:
        """Trajectories whose reward could be computed."""
        return [t for t in self.trajectories.values() if not t.error]

    @property
    def uniform(self) -> bool:
        """Every reward equal: every advantage is 0, the group carries no signal."""
        return len({t.reward for t in self.valid}) <= 1


SIGNAL_WINDOW = 16
"""A job's last complete groups, whose signal decides whether resampling pays
(`worth_resampling`)."""
MIN_SIGNAL_SHARE = 0.25
"""Below this share of recent groups with a signal, a replacement group is unlikely to
carry one either: resampling stops until the share recovers."""
_MIN_JUDGED = 4


def worth_resampling(recent_signal: Sequence[bool]) -> bool:
    """Whether dropping a uniform group for a fresh one pays, given whether each of the job's
    last complete groups (`SIGNAL_WINDOW`, the one judged and dropped ones included) had a
    signal.

    A replacement has a signal about as often as recent groups had: at a share q, one costs
    1/q groups of generation. A job that solves (or fails) nearly everything has q near 0,
    and resampling for it generates `resample_uniform_groups` groups a step for nothing
    (the calculators, solved, took a shared run from 556 s to 905 s). Until a
    few groups are judged, resample."""
    judged = len(recent_signal)
    return judged < _MIN_JUDGED or sum(recent_signal) >= MIN_SIGNAL_SHARE * judged


def verdict(
    group: Group, *, trained_version: int, max_staleness: int, resample_uniform: bool = False
) -> tuple[Verdict, str]:
    """Train the group on adapter `trained_version`, or drop it, and why.

    Stale: the oldest turn is more than S versions behind the adapter being trained.
    Invalid: fewer than two trajectories with a reward, so no relative advantage exists.
    Uniform (only with `resample_uniform`, the job's dynamic sampling): every reward equal,
    so every advantage is 0 and the group would add nothing to the step.
    """
    lag = trained_version - group.oldest_version
    if lag > max_staleness:
        return "dropped_stale", f"{lag} versions behind (max_staleness {max_staleness})"
    valid = group.valid
    if len(valid) < 2:
        errors = sorted({t.error for t in group.trajectories.values() if t.error})
        return "dropped_invalid", f"{len(valid)} rewarded trajectories; " + "; ".join(errors)
    if resample_uniform and group.uniform:
        return "dropped_uniform", f"all {len(valid)} rewards {valid[0].reward:g}: resampled"
    return "train", f"{lag} versions behind"


def not_of_job(t: Trajectory, spec: JobSpec) -> str | None:
    """Why a trajectory cannot belong to one of the job's groups (it is then not held at
    all), or None."""
    if group_index_of(spec.job_id, t.group_id) is None:
        return f"group {t.group_id!r} is not one of job {spec.job_id!r}"
    if not 0 <= t.sample_index < spec.rl.group_size:
        return f"sample_index {t.sample_index} outside the job's group of {spec.rl.group_size}"
    if t.group_size != spec.rl.group_size:
        return f"group_size {t.group_size}, the job's is {spec.rl.group_size}"
    return None


def checked(trajectory: Trajectory, spec: JobSpec, vocab_size: int) -> Trajectory:
    """The trajectory as it arrived, or, when its content does not fit its job (a forged or
    corrupt record: misaligned lists, token ids the model does not have), a copy that
    carries why in `error`: it still completes its group but is never trained on."""
    problem = _problem(trajectory, spec, vocab_size)
    if problem is None:
        return trajectory
    return msgspec.structs.replace(trajectory, error=f"invalid trajectory: {problem}")


def _problem(t: Trajectory, spec: JobSpec, vocab_size: int) -> str | None:
    if t.error:
        return None  # already failed: nothing of it is trained
    if not len(t.token_ids) == len(t.loss_mask) == len(t.behaviour_logprobs):
        return (
            f"{len(t.token_ids)} tokens, {len(t.loss_mask)} mask entries and "
            f"{len(t.behaviour_logprobs)} logprobs"
        )
    if len(t.token_ids) > spec.rl.max_context_tokens:
        return f"{len(t.token_ids)} tokens > max_context_tokens {spec.rl.max_context_tokens}"
    if any(not 0 <= token < vocab_size for token in t.token_ids):
        return f"token ids outside the vocabulary of {vocab_size}"
    if any(bit not in (0, 1) for bit in t.loss_mask) or 1 not in t.loss_mask:
        return "the loss mask must be 0/1 with at least one sampled token"
    if not math.isfinite(t.reward) or not all(map(math.isfinite, t.behaviour_logprobs)):
        return "non-finite reward or logprobs"
    return None
