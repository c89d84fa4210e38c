"""`Environment`, the base class every environment subclasses: the task contract it declares
(env_svc/protocol/contract.py) and the episodes env_svc drives with it: reset, step, score,
and the episode state decoded on any replica."""

from __future__ import annotations

from collections.abc import Coroutine
from functools import cached_property
from typing import Any, TypeVar

import msgspec

from env_svc.protocol.awaiting import awaited, finish, is_async
from env_svc.protocol.contract import TaskContract
from env_svc.protocol.data import ChatMessage, EpisodeState, RewardResult, StepResult, T
from env_svc.protocol.errors import EpisodeStateError
from env_svc.protocol.rewards import CUT_OFF, ascore

R = TypeVar("R")


class Environment(TaskContract[T]):
    """One kind of task and its rewards. Subclasses set the class attributes, `sample_task`,
    `make_rewards`, and, for multi-turn environments, `respond` and `max_turns`
    (env_svc/protocol/contract.py); what is provided here drives its episodes."""

    def solved(self, reward: RewardResult) -> bool:
        """Whether a scored episode counts as solved (the accuracy of evaluations): its
        `correct` component is 1 when it has one, else every component of a weighted reward
        is at least 1; never when the token limit cut the answer off (`cut_off`)."""
        if reward.error or reward.components.get(CUT_OFF):
            return False
        if "correct" in reward.components:
            return reward.components["correct"] >= 1.0
        # A weight-0 reward is a metric (verifiers' convention), e.g. the tool layer's counts.
        metrics = {r.name for r in self.rewards if r.weight == 0}
        scores = [v for k, v in reward.components.items() if k.split(".")[0] not in metrics]
        return bool(scores) and all(v >= 1.0 for v in scores)

    @cached_property
    def awaits(self) -> bool:
        """Whether this environment's code awaits (an `async def` respond, initial_messages or
        reward): env_svc then runs its episodes on the event loop, else in worker threads."""
        return any(
            is_async(fn)
            for fn in (self.respond, self.initial_messages, *(r.fn for r in self.rewards))
        )

    def reset(self, task: T) -> tuple[EpisodeState[T], list[ChatMessage]]:
        return self._finish(self.areset(task))

    async def areset(self, task: T) -> tuple[EpisodeState[T], list[ChatMessage]]:
        return EpisodeState(env=self.name, task=task), await self.prompt(task)

    async def prompt(self, task: T) -> list[ChatMessage]:
        """`initial_messages(task)`, awaited when it is `async def`."""
        return await awaited(self.initial_messages(task))

    def step(self, state: EpisodeState[T], action_text: str) -> StepResult[T]:
        return self._finish(self.astep(state, action_text))

    async def astep(self, state: EpisodeState[T], action_text: str) -> StepResult[T]:
        """Apply the model's turn: the environment's replies, or the end with its reward."""
        if state.done:
            raise EpisodeStateError(f"{self.name}: step on a finished episode")
        turn = state.turn + 1
        action: ChatMessage = {"role": "assistant", "content": action_text}
        state = msgspec.structs.replace(state, turn=turn, completion=[*state.completion, action])
        replies = await awaited(self.respond(state, action_text))
        truncated = replies is not None and turn >= self.max_turns
        if replies is not None and not truncated:
            completion = [*state.completion, *replies]
            return StepResult(
                msgspec.structs.replace(state, completion=completion), replies, False, None
            )
        reward = await self.ascore(state)
        return StepResult(msgspec.structs.replace(state, done=True), [], True, reward, truncated)

    def score(self, state: EpisodeState[T]) -> RewardResult:
        """The reward of an episode as it stands (e.g. one cut short by the context limit)."""
        return self._finish(self.ascore(state))

    async def ascore(self, state: EpisodeState[T]) -> RewardResult:
        return await ascore(self.rewards, state.task, state.completion)

    def _finish(self, work: Coroutine[Any, Any, R]) -> R:
        return finish(work, awaits=self.awaits)

    def decode_state(self, raw: bytes) -> EpisodeState[T]:
        try:
            state: EpisodeState[T] = self._state_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EpisodeStateError(f"{self.name}: bad episode state: {exc}") from None
        if state.env != self.name:
            raise EpisodeStateError(f"{self.name}: episode state belongs to {state.env!r}")
        return state


def decode_state(raw: bytes, env: Environment[T]) -> EpisodeState[T]:
    return env.decode_state(raw)
