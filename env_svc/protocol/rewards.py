"""Rewards: typed functions with weights, recorded by name (verifiers' rubrics). A failing
reward is recorded with its error and scores NaN, never a silent 0.0."""

from __future__ import annotations

import contextvars
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic

from env_svc.protocol.awaiting import awaited, run_sync
from env_svc.protocol.data import ChatMessage, RewardResult, T

log = logging.getLogger(__name__)

EPISODE_JOB: contextvars.ContextVar[str] = contextvars.ContextVar("episode_job", default="")
"""The job whose episode env_svc is driving ("" outside one): what a reward that asks a shared
service names, so the service charges the request to the job's tenant (env_svc/judge.py)."""


RewardFn = Callable[
    [T, Sequence[ChatMessage]],
    float | Mapping[str, float] | Awaitable[float | Mapping[str, float]],
]
"""Scores a finished episode: a float, or named sub-scores (each weighted by the Reward). An
`async def` one is awaited on env_svc's event loop (a remote verifier, a judge)."""


@dataclass(frozen=True, slots=True)
class Reward(Generic[T]):
    name: str
    fn: RewardFn[T]
    weight: float = 1.0


def score(rewards: Sequence[Reward[T]], task: T, completion: Sequence[ChatMessage]) -> RewardResult:
    """`ascore` of rewards that are all synchronous, from synchronous code."""
    return run_sync(ascore(rewards, task, completion))


async def ascore(
    rewards: Sequence[Reward[T]], task: T, completion: Sequence[ChatMessage]
) -> RewardResult:
    """Weighted sum of `rewards` (an `async def` one awaited). A reward function that raises
    or returns a non-finite or non-numeric value stops scoring: the result carries the error
    and the components so far."""
    components: dict[str, float] = {}
    total = 0.0
    for reward in rewards:
        try:
            raw = await awaited(reward.fn(task, completion))
            parts = raw.items() if isinstance(raw, Mapping) else [("", raw)]
            for key, value in parts:
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise TypeError(f"returned {value!r}, not a number")
                if not math.isfinite(value):
                    raise ValueError(f"returned {value!r}")
                name = f"{reward.name}.{key}" if key else reward.name
                components[name] = float(value)
                total += reward.weight * float(value)
        except Exception as exc:
            error = f"reward {reward.name!r} failed: {type(exc).__name__}: {exc}"
            log.warning("%s", error)
            return RewardResult(total=math.nan, components=components, error=error)
    return RewardResult(total=total, components=components)


CUT_OFF = "cut_off"
"""The reward component that marks a final answer cut off by the token limit (1.0)."""


def unanswered(reward: RewardResult) -> RewardResult:
    """The reward of a final answer that the token limit cut off, counted as no answer: total
    0, every component 0 and `cut_off` 1 (`RLSettings.score_cut_off`). A reward that could
    not be computed keeps its error."""
    if reward.error:
        return reward
    return RewardResult(
        total=0.0, components=dict.fromkeys(reward.components, 0.0) | {CUT_OFF: 1.0}
    )


def last_assistant_text(completion: Sequence[ChatMessage]) -> str:
    """The model's last turn, or "" if it has none."""
    for message in reversed(completion):
        if message["role"] == "assistant":
            return message["content"]
    return ""
