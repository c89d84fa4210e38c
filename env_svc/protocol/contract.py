"""The task contract: what an environment declares (its name, params, task type, rewards)
and implements (`sample_task`, `make_rewards`, and for multi-turn ones `respond`), and the
task streams drawn from it."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Generic

import msgspec

from env_svc import datafiles
from env_svc.protocol.data import ChatMessage, EnvParams, EpisodeState, T, Task
from env_svc.protocol.errors import EnvParamsError
from env_svc.protocol.params import checked_params
from env_svc.protocol.rewards import Reward


class TaskContract(ABC, Generic[T]):
    """One kind of task and its rewards, as a subclass declares them. Subclasses set the
    class attributes, `sample_task`, `make_rewards`, and, for multi-turn environments,
    `respond` and `max_turns`."""

    name: ClassVar[str]
    params_type: ClassVar[type[EnvParams]] = EnvParams
    task_type: ClassVar[type[Task]] = Task

    def __init__(
        self, params: Mapping[str, Any] | None = None, *, data_dir: Path | None = None
    ) -> None:
        """`data_dir`: the folder the job's files are found in (its tenant's folder of the
        data directory, env_svc/datafiles.py); None: the data directory itself."""
        self.data_dir = data_dir if data_dir is not None else datafiles.data_dir()
        self.params = checked_params(self.name, params, self.params_type)
        self.check_params()
        self.rewards: list[Reward[T]] = self.make_rewards()
        state_type = EpisodeState[self.task_type]  # type: ignore[name-defined]
        self._state_decoder = msgspec.msgpack.Decoder(state_type)

    # -- to implement --

    def check_params(self) -> None:
        """Checks across fields; raise `self.bad_param(name, reason)`."""

    @abstractmethod
    def make_rewards(self) -> list[Reward[T]]: ...

    @abstractmethod
    def sample_task(self, rng: random.Random) -> T: ...

    def initial_messages(self, task: T) -> list[ChatMessage] | Awaitable[list[ChatMessage]]:
        return [{"role": "user", "content": task.question}]

    def respond(
        self, state: EpisodeState[T], action_text: str
    ) -> list[ChatMessage] | Awaitable[list[ChatMessage] | None] | None:
        """The environment's replies to the model's latest turn (already in `state`), or None
        when that turn was the final answer. Single-turn environments keep this default. May
        be `async def` (awaited on env_svc's event loop, with the call's time limit)."""
        return None

    template_takes_tools: bool = False
    """Set by env_svc from the base model's chat template: it renders a `tools=` list in the
    Hermes/Qwen `<tool_call>` format (env_svc/chat_template.py `ChatTokenizer.takes_tools`)."""

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tool schemas for the chat template's `tools=` (None: the template gets none; a
        tool environment then lists its tools in its system prompt)."""
        return None

    @property
    def max_turns(self) -> int:
        return 1

    # -- provided --

    def bad_param(self, param: str, reason: str) -> EnvParamsError:
        return EnvParamsError(self.name, param, reason)

    def task_for(self, seed: int, index: int) -> T:
        """Task number `index` of the stream seeded by `seed` (EnvSettings.seed, group index).
        String seeds are hashed with SHA-512 by `random`, so streams agree across processes."""
        return self.sample_task(random.Random(f"{self.name}:{seed}:{index}"))

    def eval_task_for(self, seed: int, index: int) -> T:
        """Task number `index` of the evaluation stream seeded by `seed` (EvalSettings.seed):
        a stream apart from every training stream. Environments with a held-out split (a
        dataset's test set) return its tasks here; procedural ones with few distinct tasks
        may repeat training tasks, as any fresh sample would."""
        return self.sample_task(random.Random(f"{self.name}:eval:{seed}:{index}"))
