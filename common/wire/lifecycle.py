"""The job lifecycle contract: states, the one fold of events into a state, typed metrics.

Services write it (env_svc accepts, pauses and cancels jobs; trainer_svc completes them and
reports each step; rollout_svc reports its replica's stats) and the console reads it (status
board, job watcher, report). Whatever turns a job's events into its state calls
`JobLifecycle.apply`; whatever moves a job's state in the store looks the state up in
`STATE_AFTER`. docs/architecture.md, "Job lifecycle".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Self, get_args

import msgspec

from common.wire.messages import Event, EventKind, JobAction, Topic

# --- services ---------------------------------------------------------------------------

ServiceName = Literal["env_svc", "rollout_svc", "trainer_svc"]
SERVICES: tuple[ServiceName, ...] = get_args(ServiceName)
"""The three services, in the order the embedded stack starts them."""

CONSUMED_TOPICS: Mapping[str, tuple[Topic, ...]] = {
    "env_svc": (Topic.JOBS, Topic.ROLLOUTS, Topic.ADAPTERS, Topic.CONTROL),
    "rollout_svc": (Topic.PROMPTS,),
    "trainer_svc": (Topic.TRAJECTORIES,),
}
"""What each service reads in its consumer group (its lag is measured on these).

rollout_svc also reads marlaas.adapters, outside any group (every replica reads every update).
"""

# --- job states -------------------------------------------------------------------------

JobState = Literal["pending", "running", "paused", "completed", "failed", "cancelled", "rejected"]
"""`pending`: submitted, not yet accepted by env_svc. Terminal states never change again."""
JOB_STATES: tuple[JobState, ...] = get_args(JobState)
TERMINAL_STATES: frozenset[JobState] = frozenset({"completed", "failed", "cancelled", "rejected"})
STOPPED_STATES: frozenset[JobState] = frozenset({"failed", "cancelled", "rejected"})
"""Terminal states that end all of a job's work, its evaluations included (a completed job's
final version is still evaluated)."""
REASON_STATES: frozenset[JobState] = frozenset({"rejected", "failed"})
"""States whose event reason is kept: why the job did not run, or why it stopped."""

STATE_AFTER: Mapping[EventKind, JobState] = {
    "accepted": "running",
    "resumed": "running",
    "paused": "paused",
    "rejected": "rejected",
    "cancelled": "cancelled",
    "completed": "completed",
    "failed": "failed",
}
"""A job's state after each lifecycle event; other events (steps, drops) leave it."""

COMMAND_EVENT: Mapping[JobAction, EventKind] = {
    "pause": "paused",
    "resume": "resumed",
    "cancel": "cancelled",
}
"""The event env_svc announces when it applies a `JobCommand`."""

DROPPED_EVENTS: frozenset[EventKind] = frozenset({"dropped_stale", "dropped_invalid"})


@dataclass
class JobLifecycle:
    """A job's state and reason, folded from its events in the order they were sent."""

    state: JobState = "pending"
    reason: str = ""

    def apply(self, event: Event) -> None:
        if self.state in TERMINAL_STATES:
            # An ended job never runs again; an event after its end is another service's
            # clock running a little ahead (e.g. a pause sent as the job completed).
            return
        if (state := STATE_AFTER.get(event.event)) is not None:
            self.state = state
            self.reason = event.reason if state in REASON_STATES else ""
        elif event.event == "step" and self.state == "pending":
            self.state = "running"  # its `accepted` is missing from the events read

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES


# --- typed numbers ----------------------------------------------------------------------


class _Numbers(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Named numbers that travel as a `{name: float}` map (Event.metrics, a Redis hash).

    Every field is optional: readers meet numbers from older or newer writers.
    """

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return cls.__struct_fields__

    @classmethod
    def of(cls, values: Mapping[str, float]) -> Self:
        """The known numbers of `values` (unknown names are ignored)."""
        return cls(**{name: float(values[name]) for name in cls.names() if name in values})

    def as_map(self) -> dict[str, float]:
        return {name: value for name in self.names() if (value := getattr(self, name)) is not None}


TOOL_METRICS = "tools"
"""The weight-0 reward of a tool environment (env_svc/tools/): its components `tools.calls`,
`tools.errors` and `tools.<kind>` count an episode's calls; steps report their means."""


class StepMetrics(_Numbers):
    """trainer_svc -> console: what one training step of one job did (`step` events)."""

    mean_reward: float | None = None
    """Mean reward of the step's rewarded trajectories."""
    staleness_max: float | None = None
    """Most adapter versions any of the step's groups lagged behind the trained one."""
    staleness_mean: float | None = None
    loss: float | None = None
    clip_fraction: float | None = None
    is_capped_fraction: float | None = None
    mean_ratio: float | None = None
    mean_is_weight: float | None = None
    approx_kl: float | None = None
    """KL(sampling policy || trained policy), k3 estimate over the step's tokens."""
    fresh_kl: float | None = None
    """`approx_kl` over the rows sampled with exactly the version being trained: the sampler
    and the trainer ran the same weights, so only float rounding separates them (~1e-3 with
    bf16 on one side). Far above that, the sampler did not run the weights it named."""
    entropy: float | None = None
    """The sampling policy's per-token entropy (nats), estimated from its samples."""
    grad_norm: float | None = None
    learning_rate: float | None = None
    """The rate this step's optimizer used (`rl.lr_schedule` at this step)."""
    tokens: float | None = None
    """Trained (loss-masked) tokens."""
    samples: float | None = None
    """Trajectories trained."""
    step_s: float | None = None
    """Forward + backward + optimizer time: the job's share (by trained tokens) of a step
    shared with other jobs."""
    jobs_in_step: float | None = None
    """Jobs trained in the same forward/backward passes (1: alone)."""
    positions: float | None = None
    """Token positions the step's forward passes computed (all its jobs: shared prefixes,
    suffixes and the padding that evens a pack's suffixes out)."""
    padding_share: float | None = None
    """Of `positions`, the share that was padding."""
    wall_step_s: float | None = None
    """Whole step: training, saving and publishing."""
    threads: float | None = None
    """CPU threads per forward/backward pass, mean over the step's passes (above the
    trainer's own cores when it borrowed idle ones, trainer_svc/compute.py)."""
    zero_advantage_share: float | None = None
    """Share of the step's trajectories whose advantage was 0 (their group's rewards all
    equal): no learning signal, left out of the passes."""
    resampled_groups: float | None = None
    """Groups with all rewards equal dropped and replaced before this step (dynamic sampling,
    `rl.resample_uniform_groups`)."""
    tool_calls: float | None = None
    """Tool calls per trained episode, mean (environments on the tool layer: `TOOL_METRICS`)."""
    tool_errors: float | None = None
    """Of those, calls answered with an error (malformed, unknown tool, bad arguments, the
    tool's own error or time limit), per trained episode."""

    @property
    def trainer_tokens_per_s(self) -> float | None:
        if self.tokens is None or not self.step_s:
            return None
        return self.tokens / self.step_s


class RolloutReplicaStats(_Numbers):
    """rollout_svc -> console: one replica's engine numbers, reported every few seconds."""

    busy_s: float | None = None
    """Seconds the engine had at least one request, since the replica started."""
    compute_s: float | None = None
    """CPU seconds the engine computed since the replica started (rollout_svc/compute.py;
    None on a GPU)."""
    compute_slots: float | None = None
    """Cores the engine may compute on: `compute_s` over uptime x this is its compute share."""
    request_s: float | None = None
    """Requests in the engine integrated over time: over `busy_s`, its mean batch."""
    uptime_s: float | None = None
    generated_tokens: float | None = None
    """Tokens generated since the replica started."""
    prompt_tokens: float | None = None
    """Context tokens of the requests finished since the replica started."""
    cached_prompt_tokens: float | None = None
    """Of `prompt_tokens`, those found in the prefix cache (not prefilled)."""
    preemptions: float | None = None
    """Times finished requests were preempted (KV cache full: freed, recomputed later)."""
    utilisation: float | None = None
    """busy_s / uptime_s: the share of time with a request in the engine."""
    recent_utilisation: float | None = None
    """Busy share over the last report interval."""
    compute_utilisation: float | None = None
    """compute_s / (uptime_s x compute_slots): the share of its cores' time the engine
    computed, since the replica started."""
    recent_compute_utilisation: float | None = None
    """The compute share over the last report interval."""
    mean_batch: float | None = None
    """Requests the engine held on average while busy, over the last report interval."""
    tokens_per_s: float | None = None
    """Generated tokens per second over the last report interval."""
    in_flight: float | None = None
    """Requests in the engine when reported."""
    max_model_len: float | None = None
    """The engine's longest context (prompt + completion) in tokens."""
    at: float | None = None
    """When reported (unix s); set on samples read from the history."""


REPLICA_COUNTERS = (
    "busy_s",
    "compute_s",
    "request_s",
    "uptime_s",
    "generated_tokens",
    "prompt_tokens",
    "cached_prompt_tokens",
    "preemptions",
)
"""Cumulative since the replica process started: one going down means it restarted."""
