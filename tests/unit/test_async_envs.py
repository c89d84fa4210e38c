"""Environments whose code awaits (issue 41, item 2): awaited on env_svc's loop with their time
limit, hundreds at once without a thread each; synchronous ones keep the worker threads."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest

from common.runtime.backoff import is_transient
from env_svc.calls import EnvCalls, EnvCallTimeout, EnvCodeError
from env_svc.protocol import (
    AsyncEnvironmentError,
    ChatMessage,
    Environment,
    EpisodeState,
    Reward,
    Task,
    ascore,
    last_assistant_text,
    run_sync,
    score,
)


class EchoTask(Task, frozen=True):
    word: str


class AsyncVerifierEnv(Environment[EchoTask]):
    """Says a word back; a tool turn first when asked; the verifier is remote (it awaits)."""

    name = "async_verifier"
    task_type = EchoTask
    wait_s = 0.0

    def sample_task(self, rng: random.Random) -> EchoTask:
        word = rng.choice(["apple", "pear"])
        return EchoTask(question=f"Say {word}.", word=word)

    async def respond(
        self, state: EpisodeState[EchoTask], action_text: str
    ) -> list[ChatMessage] | None:
        if action_text == "lookup":
            await asyncio.sleep(self.wait_s)  # a tool that answers over the network
            return [{"role": "tool", "content": state.task.word}]
        return None

    @property
    def max_turns(self) -> int:
        return 2

    def make_rewards(self) -> list[Reward[EchoTask]]:
        return [Reward("correct", self.verified), Reward("format", short, 0.5)]

    async def verified(self, task: EchoTask, completion: Sequence[ChatMessage]) -> float:
        await asyncio.sleep(self.wait_s)
        return float(last_assistant_text(completion) == task.word)


def short(task: EchoTask, completion: Sequence[ChatMessage]) -> float:
    return float(len(last_assistant_text(completion)) < 10)


def test_an_environment_that_awaits_says_so_and_one_that_does_not_too() -> None:
    from env_svc.envs.arithmetic import ArithmeticEnv

    assert AsyncVerifierEnv().awaits
    assert not ArithmeticEnv().awaits


async def test_async_respond_and_rewards_are_awaited_in_an_episode() -> None:
    env = AsyncVerifierEnv()
    state, messages = await env.areset(env.task_for(0, 0))
    assert messages == [{"role": "user", "content": state.task.question}]
    looked_up = await env.astep(state, "lookup")
    assert not looked_up.done and looked_up.messages[0]["role"] == "tool"
    ended = await env.astep(looked_up.state, state.task.word)
    assert ended.done and ended.reward is not None
    assert ended.reward.components == {"correct": 1.0, "format": 1.0}
    assert ended.reward.total == 1.5


def test_from_synchronous_code_an_awaiting_environment_runs_on_a_loop_of_its_own() -> None:
    """Tests and `marlaas envs check` call `step`; it works for both kinds."""
    env = AsyncVerifierEnv()
    state, _ = env.reset(env.task_for(0, 0))
    ended = env.step(state, "wrong")
    assert ended.done and ended.reward is not None and ended.reward.components["correct"] == 0.0


def test_driving_an_awaiting_environment_without_a_loop_is_a_clear_error() -> None:
    env = AsyncVerifierEnv()
    state, _ = env.reset(env.task_for(0, 0))
    with pytest.raises(AsyncEnvironmentError, match="awaits"):
        run_sync(env.astep(state, "lookup"))


async def test_an_async_reward_that_raises_is_recorded_like_a_sync_one() -> None:
    async def broken(task: Task, completion: Sequence[ChatMessage]) -> float:
        raise ValueError("verifier said 500")

    rewards = [Reward("ok", lambda t, c: 1.0), Reward("remote", broken)]
    result = await ascore(rewards, Task(question="q"), [])
    assert result.error == "reward 'remote' failed: ValueError: verifier said 500"
    assert result.components == {"ok": 1.0}
    assert score(rewards[:1], Task(question="q"), []).total == 1.0


async def test_two_hundred_awaiting_calls_wait_at_once_beside_four_workers() -> None:
    """An async tool that waits holds no thread: 200 episodes' calls are in hand together."""
    env = AsyncVerifierEnv()
    env.wait_s = 2.0  # every call starts long before the first one ends, even on a busy host
    calls = EnvCalls(timeout_s=30.0, workers=4)
    state, _ = await env.areset(env.task_for(0, 0))
    try:
        steps = await asyncio.gather(
            *(
                calls.drive(f"episode {n}", lambda: env.astep(state, "lookup"), awaits=True)
                for n in range(200)
            )
        )
    finally:
        calls.close()
    assert all(step.messages[0]["content"] == state.task.word for step in steps)
    assert calls.peak == 200 and calls.in_flight == 0


async def test_an_awaiting_call_past_its_limit_is_cancelled_and_ends_its_episode() -> None:
    cancelled = asyncio.Event()

    async def hangs() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    calls = EnvCalls(timeout_s=0.1, workers=1)
    with pytest.raises(EnvCallTimeout, match=r"no answer after 0\.1s"):
        await calls.drive("tool", hangs, awaits=True)
    assert cancelled.is_set() and calls.in_flight == 0


async def test_what_awaiting_code_raises_of_its_own_is_never_retried() -> None:
    """A tool's own ConnectionError or deadline is its episode's error, not env_svc's Redis
    briefly away (a record retried forever stops its partition)."""

    async def down() -> None:
        raise ConnectionError("the tool's API is down")

    async def own_deadline() -> None:
        async with asyncio.timeout(0.01):
            await asyncio.sleep(1)

    calls = EnvCalls(timeout_s=5.0, workers=1)
    for code, name in ((down, "ConnectionError"), (own_deadline, "TimeoutError")):
        with pytest.raises(EnvCodeError) as raised:
            await calls.drive("tool", code, awaits=True)
        assert not is_transient(raised.value) and f"tool: {name}" in str(raised.value)
