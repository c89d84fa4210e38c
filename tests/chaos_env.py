"""`chaos`: an environment that fails the way user code does, on purpose.

Params choose the failure: `reject` (its constructor raises), `start` (the task of each group
in `bad_groups` raises), `overflow` (those groups' tasks hold an integer msgpack cannot carry),
`respond` (its tool reply raises), `recursion` (its tool reply parses deeply nested JSON),
`hang` (its tool reply sleeps `hang_s`), `flaky` (the reward raises for ~10% of episodes,
returns NaN for ~5%, and sleeps `hang_s` for ~5%, decided by a hash of the reply, so a
replayed episode fails the same way). Otherwise it is a one-turn "say 1" task.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Literal

from env_svc.protocol import (
    ChatMessage,
    Environment,
    EnvParams,
    EpisodeState,
    Reward,
    Task,
    last_assistant_text,
)

Failure = Literal["", "reject", "start", "overflow", "respond", "recursion", "hang", "flaky"]


class ChaosParams(EnvParams, frozen=True):
    fail: Failure = ""
    bad_groups: tuple[int, ...] = ()
    hang_s: float = 5.0


class ChaosTask(Task, frozen=True):
    answer: int


def said_it(task: ChaosTask, completion: Sequence[ChatMessage]) -> float:
    return float(str(task.answer) in last_assistant_text(completion))


def flaky_said_it(hang_s: float) -> Callable[[ChaosTask, Sequence[ChatMessage]], float]:
    def reward(task: ChaosTask, completion: Sequence[ChatMessage]) -> float:
        roll = hashlib.sha256(f"{task.question}{completion!r}".encode()).digest()[0] / 256
        if roll < 0.10:
            raise RuntimeError("chaos: the reward server is down")
        if roll < 0.15:
            return math.nan
        if roll < 0.20:
            time.sleep(hang_s)
        return said_it(task, completion)

    return reward


class ChaosEnv(Environment[ChaosTask]):
    name = "chaos"
    params_type = ChaosParams
    task_type = ChaosTask
    params: ChaosParams

    def check_params(self) -> None:
        if self.params.fail == "reject":
            raise RuntimeError("chaos: a bug in the environment's constructor")

    def make_rewards(self) -> list[Reward[ChaosTask]]:
        if self.params.fail == "flaky":
            return [Reward("said_it", flaky_said_it(self.params.hang_s))]
        return [Reward("said_it", said_it)]

    def task_for(self, seed: int, index: int) -> ChaosTask:
        if index in self.params.bad_groups and self.params.fail == "start":
            raise RuntimeError(f"chaos: no task {index}")
        if index in self.params.bad_groups and self.params.fail == "overflow":
            return ChaosTask(question="Say a big number.", answer=2**70)
        return super().task_for(seed, index)

    def sample_task(self, rng: random.Random) -> ChaosTask:
        # The number only makes each group's prompt (and a flaky reward's fate) its own.
        return ChaosTask(question=f"Say 1. (task {rng.randrange(10**6)})", answer=1)

    def respond(self, state: EpisodeState[ChaosTask], action_text: str) -> list[ChatMessage] | None:
        match self.params.fail:
            case "respond":
                raise RuntimeError("chaos: the tool crashed")
            case "recursion":
                json.loads("[" * 100_000 + "]" * 100_000)
            case "hang":
                time.sleep(self.params.hang_s)
        return None
