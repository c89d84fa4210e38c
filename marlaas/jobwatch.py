"""Submitting jobs and following them through `marlaas.events`: `JobProgress`, what one job's
events say so far, and `watch_jobs`, which folds them in until the jobs are done."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from common.bus.kafka import Producer
from common.security.signing import RecordSigner
from common.state.evals import evaluated
from common.wire.lifecycle import DROPPED_EVENTS, TERMINAL_STATES, JobLifecycle, StepMetrics
from common.wire.messages import Event, JobSpec, Message
from marlaas.eventfeed import EventFeed

ETA_WINDOW = 5
"""Steps whose pace predicts the rest, once a job has trained more than that many."""


LEARNING_SIGNALS = (
    "entropy",
    "approx_kl",
    "fresh_kl",
    "clip_fraction",
    "zero_advantage_share",
    "tool_calls",
    "tool_errors",
)
"""Step metrics that say why a run goes wrong: a collapsing entropy, a policy drifting from
the one that sampled (KL), updates the clip cuts off, groups with no learning signal, tool
calls and how many of them failed (tool environments)."""


def reported(status: str, final_eval_due: bool, max_steps: int, evaluated: Collection[int]) -> bool:
    """Whether a job in `status` has ended and, completed, has its final evaluation in when
    it has one (`evaluated`: the versions whose evaluation is in): what `--wait` waits for,
    here and through the tenant API."""
    if status not in TERMINAL_STATES:
        return False
    return status != "completed" or not final_eval_due or max_steps in evaluated


@dataclass
class JobProgress:
    """What the events of one job say so far."""

    job_id: str
    tenant: str
    env: str
    max_steps: int
    lifecycle: JobLifecycle = field(default_factory=JobLifecycle)
    steps: int = 0
    rewards: list[float] = field(default_factory=list)
    """Mean reward of each trained step, in step order."""
    step_at: list[float] = field(default_factory=list)
    """When each step's event was sent (unix s), aligned with `rewards`."""
    last_staleness: int = 0
    max_staleness_seen: int = 0
    dropped_groups: int = 0
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None
    """When env_svc accepted the job."""
    finished_at: float | None = None
    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    """Metrics of each evaluated adapter version (`eval` events), by version."""
    final_eval_due: bool = False
    """The job evaluates its final adapter: a completed job reports once that is in."""
    learning: dict[str, float] = field(default_factory=dict)
    """The last step's learning signals (`LEARNING_SIGNALS`): why a run goes wrong, visible."""
    below_base: str = ""
    """Why the latest evaluation is worse than the base model's ("" when it is not)."""

    @classmethod
    def of(cls, spec: JobSpec) -> JobProgress:
        return cls(
            spec.job_id,
            spec.tenant,
            spec.env.name,
            spec.rl.max_steps,
            submitted_at=spec.submitted_at or time.time(),
            final_eval_due=evaluated(spec, spec.rl.max_steps),
        )

    @property
    def status(self) -> str:
        return self.lifecycle.state

    @property
    def reason(self) -> str:
        return self.lifecycle.reason

    @property
    def done(self) -> bool:
        return self.lifecycle.done

    @property
    def reported(self) -> bool:
        """Ended, and a completed job's final evaluation is in when it has one."""
        return reported(self.status, self.final_eval_due, self.max_steps, self.evals)

    def eval_accuracy(self, version: int) -> float | None:
        metrics = self.evals.get(version)
        return None if metrics is None else metrics.get("eval_accuracy")

    @property
    def wall_s(self) -> float:
        return (self.finished_at or time.time()) - self.submitted_at

    @property
    def latest_reward(self) -> float | None:
        return self.rewards[-1] if self.rewards else None

    @property
    def best_reward(self) -> float | None:
        return max(self.rewards) if self.rewards else None

    def eta_s(self, now: float) -> float | None:
        """Seconds to max_steps at the job's pace; None before a pace is known.

        The pace is that of the last `ETA_WINDOW` steps once there are that many; before,
        the average since the job was accepted. The first steps come in a burst (step 2's
        rollouts were generated while step 1 trained), so their own gaps would promise far
        too early an end.
        """
        if self.done or self.status == "paused" or not self.step_at or self.max_steps <= 0:
            return None
        if len(self.step_at) > ETA_WINDOW:
            recent = self.step_at[-ETA_WINDOW - 1 :]
            per_step = (recent[-1] - recent[0]) / ETA_WINDOW
        elif self.started_at is not None:
            per_step = (self.step_at[-1] - self.started_at) / len(self.step_at)
        else:
            return None
        remaining = max(self.max_steps - self.steps, 0)
        return max(per_step * remaining - (now - self.step_at[-1]), 0.0)

    def apply(self, event: Event) -> None:
        if self.tenant in ("", "-") and event.tenant:
            self.tenant = event.tenant
        self.lifecycle.apply(event)
        if event.event == "step":
            metrics = StepMetrics.of(event.metrics)
            self.steps = max(self.steps, event.step)
            self.rewards.append(
                float("nan") if metrics.mean_reward is None else metrics.mean_reward
            )
            self.step_at.append(event.at)
            self.last_staleness = int(metrics.staleness_max or 0)
            self.max_staleness_seen = max(self.max_staleness_seen, self.last_staleness)
            self.learning = {k: v for k, v in metrics.as_map().items() if k in LEARNING_SIGNALS}
        elif event.event in DROPPED_EVENTS:
            self.dropped_groups += 1
        elif event.event == "eval":
            self.evals[event.step] = dict(event.metrics)
            if event.step == max(self.evals):
                self.below_base = event.reason
        elif event.event in ("accepted", "resumed"):
            self.started_at = self.started_at or event.at
        if self.done and self.finished_at is None:
            self.finished_at = event.at or time.time()

    def reward_window(self, first: bool, window: int) -> float | None:
        values = self.rewards[:window] if first else self.rewards[-window:]
        return sum(values) / len(values) if values else None

    def summary(self, window: int) -> dict[str, object]:
        """The job in numbers; evaluation: the base model's and the last evaluated version's
        accuracy and the larger of their standard errors."""
        versions = sorted(self.evals)
        final = versions[-1] if versions and versions[-1] > 0 else None
        stderrs = [
            self.evals[v].get("eval_accuracy_stderr", 0.0) for v in {0, final} if v in self.evals
        ]
        return {
            "job_id": self.job_id,
            "tenant": self.tenant,
            "env": self.env,
            "status": self.status,
            "steps": self.steps,
            "reward_start": self.reward_window(True, window),
            "reward_end": self.reward_window(False, window),
            "max_staleness_seen": self.max_staleness_seen,
            "dropped_groups": self.dropped_groups,
            "wall_s": round(self.wall_s, 1),
            "rewards": self.rewards,
            "learning": self.learning,
            "below_base": self.below_base,
            "eval_accuracy_base": self.eval_accuracy(0),
            "eval_accuracy_final": None if final is None else self.eval_accuracy(final),
            "eval_stderr": max(stderrs) if stderrs else None,
            "evals": {str(v): self.evals[v] for v in versions},
        }


async def submit_jobs(
    bootstrap: str,
    messages: Iterable[Message],
    *,
    timeout_s: float = 60,
    signing: RecordSigner | None = None,
) -> None:
    """Produce job specs or commands to marlaas.jobs; `Client.submit` checks ids first."""
    producer = Producer(bootstrap, client_id="marlaas-cli", signing=signing)
    await producer.start(timeout_s=timeout_s)
    try:
        for message in messages:
            await producer.send(message)
    finally:
        await producer.stop()


async def watch_jobs(
    bootstrap: str,
    jobs: dict[str, JobProgress],
    *,
    timeout_s: float,
    on_event: Callable[[Event], None] | None = None,
) -> None:
    """Apply every event of `jobs` (from the topic's start) until all are done (and the
    completed ones' final evaluations are in).

    Raises TimeoutError when they are not done within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    async with EventFeed(bootstrap, jobs) as feed:
        while not all(job.reported for job in jobs.values()):
            if time.monotonic() > deadline:
                pending = [j for j, p in jobs.items() if not p.reported]
                raise TimeoutError(f"jobs not finished after {timeout_s:.0f}s: {pending}")
            for event in await feed.poll(0.5):
                jobs[event.job_id].apply(event)
                if on_event is not None:
                    on_event(event)
