"""`chaos`: an environment that fails the way user code does, on purpose.

Params choose the failure: `reject` (its constructor raises), `start` (the task of each group
in `bad_groups` raises), `overflow` (those groups' tasks hold an integer msgpack cannot carry),
`respond` (its tool reply raises), `recursion` (its tool reply parses deeply nested JSON),
`hang` (its tool reply sleeps `hang_s`). Otherwise it is a one-turn "say 1" task.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
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

Failure = Literal["", "reject", "start", "overflow", "respond", "recursion", "hang"]


class ChaosParams(EnvParams, frozen=True):
    fail: Failure = ""
    bad_groups: tuple[int, ...] = ()
    hang_s: float = 5.0


class ChaosTask(Task, frozen=True):
    answer: int


def said_it(task: ChaosTask, completion: Sequence[ChatMessage]) -> float:
    return float(str(task.answer) in last_assistant_text(completion))


class ChaosEnv(Environment[ChaosTask]):
    name = "chaos"
    params_type = ChaosParams
    task_type = ChaosTask
    params: ChaosParams

    def check_params(self) -> None:
        if self.params.fail == "reject":
            raise RuntimeError("chaos: a bug in the environment's constructor")

    def make_rewards(self) -> list[Reward[ChaosTask]]:
        return [Reward("said_it", said_it)]

    def task_for(self, seed: int, index: int) -> ChaosTask:
        if index in self.params.bad_groups and self.params.fail == "start":
            raise RuntimeError(f"chaos: no task {index}")
        if index in self.params.bad_groups and self.params.fail == "overflow":
            return ChaosTask(question="Say a big number.", answer=2**70)
        return super().task_for(seed, index)

    def sample_task(self, rng: random.Random) -> ChaosTask:
        return ChaosTask(question="Say 1.", answer=1)

    def respond(self, state: EpisodeState[ChaosTask], action_text: str) -> list[ChatMessage] | None:
        match self.params.fail:
            case "respond":
                raise RuntimeError("chaos: the tool crashed")
            case "recursion":
                json.loads("[" * 100_000 + "]" * 100_000)
            case "hang":
                time.sleep(self.params.hang_s)
        return None
