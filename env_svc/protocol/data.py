"""The plain data of the contract: chat messages, tasks, params, episode states and results.
An episode's state travels between replicas as bytes (`encode_state`), so it is data only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypedDict, TypeVar

import msgspec

Role = Literal["system", "user", "assistant", "tool"]


class ChatMessage(TypedDict):
    """One chat turn, as the model's chat template takes it."""

    role: Role
    content: str


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """One problem. Environments subclass it with their own plain fields (operands, target)."""

    question: str


class EnvParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every environment's params; subclasses add fields with defaults."""


Weight = Annotated[float, msgspec.Meta(ge=0, le=100)]
"""A reward component's weight: 0 turns it off."""
Operand = Annotated[int, msgspec.Meta(ge=-(10**6), le=10**6)]
"""A number a procedural task draws: within +-1e6, so every question stays short."""


T = TypeVar("T", bound=Task)


class EpisodeState(msgspec.Struct, Generic[T], frozen=True, kw_only=True):
    """Everything an environment needs to continue an episode; travels as bytes."""

    env: str
    """Name of the environment that made it, checked when decoding."""
    task: T
    completion: list[ChatMessage] = []
    """Messages after the prompt: the model's turns and the environment's replies."""
    turn: int = 0
    """Model turns taken so far."""
    done: bool = False


class RewardResult(msgspec.Struct, frozen=True, kw_only=True):
    total: float
    """Weighted sum of the components; NaN when `error` is set, so it cannot pass as a score."""
    components: dict[str, float] = {}
    """Unweighted value of each component computed, by name."""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True, slots=True)
class StepResult(Generic[T]):
    state: EpisodeState[T]
    messages: list[ChatMessage]
    """The environment's replies to append to the context (tool results); empty when done."""
    done: bool
    reward: RewardResult | None
    """Set exactly when `done`."""
    truncated: bool = False
    """The episode ended because it reached `max_turns`, not with a final answer."""


def encode_state(state: EpisodeState[Any]) -> bytes:
    return msgspec.msgpack.encode(state)
