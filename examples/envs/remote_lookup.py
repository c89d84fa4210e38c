"""`remote_lookup`: a tool environment whose tool waits on a remote service (`async def`).

The model looks a key up with the `lookup` tool, which answers after `wait_s` (an API's round
trip, here an `asyncio.sleep`), and replies with the value. Register it with env_svc, this
folder on its Python path:

    MARLAAS_ENVIRONMENTS=remote_lookup=remote_lookup:RemoteLookupEnv

bench/async_tools.py runs hundreds of its episodes at once on one env_svc replica.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Annotated, Any

from msgspec import Meta

from env_svc.protocol import ChatMessage, EnvParams, Reward, Task, last_assistant_text
from env_svc.tools import Tool, ToolEnvironment, strip_tool_calls


class RemoteLookupParams(EnvParams, frozen=True):
    wait_s: Annotated[float, Meta(ge=0, le=30)] = 1.0
    """How long the remote service takes to answer a lookup."""


class LookupTask(Task, frozen=True):
    key: str


def value_of(key: str) -> str:
    return f"v-{sum(map(ord, key)) % 997}"


class RemoteLookupEnv(ToolEnvironment[LookupTask]):
    name = "remote_lookup"
    params_type = RemoteLookupParams
    task_type = LookupTask
    params: RemoteLookupParams

    @property
    def max_turns(self) -> int:
        return 2

    def make_tools(self) -> list[Tool | Callable[..., Any]]:
        wait_s = self.params.wait_s

        async def lookup(key: str) -> str:
            """Look a key up in the remote store."""
            await asyncio.sleep(wait_s)
            return value_of(key)

        return [lookup]

    def sample_task(self, rng: random.Random) -> LookupTask:
        key = f"k{rng.randint(0, 10**6)}"
        return LookupTask(question=f"What is the value of {key}?", key=key)

    def make_rewards(self) -> list[Reward[LookupTask]]:
        return [Reward("correct", found)]


def found(task: LookupTask, completion: Sequence[ChatMessage]) -> float:
    return float(value_of(task.key) in strip_tool_calls(last_assistant_text(completion)))
