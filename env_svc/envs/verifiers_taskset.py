"""`verifiers`: a taskset of the `verifiers` library (0.4, `verifiers.v1`) as a job's environment.

The operator installs `marlaas[verifiers]` and the taskset's package where env_svc runs, and
registers its id (`MARLAAS_VERIFIERS_TASKSETS=mini-arith,...`); a job names one:

    env = {name = "verifiers", params = {taskset = "mini-arith"}}

A tenant never names a module to import: verifiers loads a taskset by importing the module its
id names, so only registered ids are loaded.

What maps, turn by turn on our episode driver:
- **tasks**: the taskset's `TaskData` (its `prompt`, a string or messages, after its
  `system_prompt`) as our tasks, drawn from our seeded streams; `eval_fraction` of them, chosen
  by a hash of each task's id (or prompt), held out for evaluation. An infinite taskset is read
  to its first `MAX_TASKS`.
- **rewards**: each `@vf.reward` of the task is a component with its weight, each `@vf.metric`
  one at weight 0 (recorded, not summed; our convention too). They are awaited on env_svc's
  loop, called as verifiers calls them (by parameter name: `task`, the task's data, and
  `trace`), on a trace built from the episode's messages; a reward that raises or returns
  nothing ends the episode with that error.

What does not map, and is refused with the reason when a job names it:
- **toolsets** (`Task.toolsets` / `Taskset.toolsets`): verifiers runs them as MCP servers per
  rollout, with their state, in its own runtime; a MARLaaS episode's turns may be served by
  different env_svc replicas. Stateless tools belong in our tool layer (env_svc/tools/).
- **rewards that need a runtime** (a `runtime` parameter without a default: a sandbox, a
  browser): verifiers skips them offline; here there is no runtime to give, and skipping them
  silently would change the task's reward.
- **harness-driven multi-turn** (an `Env` or `Harness` that drives whole rollouts with its own
  model client, and plugged judges with their own client): the episode here is single-turn and
  our rollout service samples every turn. Judged rewards have their own component
  (env_svc/judge.py).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

from msgspec import Meta

from env_svc.protocol import (
    ChatMessage,
    Environment,
    EnvParams,
    EnvParamsError,
    Reward,
    RewardFn,
    Task,
    UnregisteredHereError,
    awaited,
)

TASKSETS_VAR = "MARLAAS_VERIFIERS_TASKSETS"
"""Comma-separated taskset ids env_svc may load (the operator's)."""
MAX_TASKS = 100_000
ROLES = ("system", "user", "assistant", "tool")


class VerifiersParams(EnvParams, frozen=True):
    taskset: Annotated[str, Meta(min_length=1, max_length=128)]
    """The taskset's id, one of those the operator registered (`MARLAAS_VERIFIERS_TASKSETS`)."""
    eval_fraction: Annotated[float, Meta(gt=0, le=0.5)] = 0.1
    """Share of the taskset's tasks held out for evaluation (by a hash of each task's id)."""


class VerifiersTask(Task, frozen=True):
    index: int
    """The task's position in the taskset."""


def registered_tasksets() -> list[str]:
    return sorted(filter(None, (t.strip() for t in os.environ.get(TASKSETS_VAR, "").split(","))))


@functools.cache
def load_tasks(taskset_id: str) -> tuple[Any, tuple[Any, ...]]:
    """The taskset and its tasks (`verifiers.v1.Task`s, `idx` set), loaded once per process."""
    import verifiers.v1 as vf

    taskset = vf.load_taskset(vf.TasksetConfig(id=taskset_id))
    return taskset, tuple(itertools.islice(taskset, MAX_TASKS))


class VerifiersEnv(Environment[VerifiersTask]):
    name = "verifiers"
    params_type = VerifiersParams
    task_type = VerifiersTask
    params: VerifiersParams

    def check_params(self) -> None:
        taskset = self.params.taskset
        if taskset not in (registered := registered_tasksets()):
            known = ", ".join(registered) or "none"
            reason = f"unknown taskset {taskset!r}; registered: {known}"
            raise (UnregisteredHereError if not registered else EnvParamsError)(
                self.name, "taskset", reason
            )
        try:
            loaded, self.tasks = load_tasks(taskset)
        except ImportError as exc:
            reason = f"cannot be imported ({exc}): env_svc needs marlaas[verifiers] and its package"
            raise self.bad_param("taskset", reason) from None
        except Exception as exc:
            raise self.bad_param(
                "taskset", f"failed to load: {type(exc).__name__}: {exc}"
            ) from None
        if not self.tasks:
            raise self.bad_param("taskset", "has no tasks")
        if problem := _unmapped(loaded, self.tasks[0]):
            raise self.bad_param("taskset", problem)
        held_out = [_held_out(task, self.params.eval_fraction) for task in self.tasks]
        self.train = [i for i, out in enumerate(held_out) if not out]
        self.held_out = [i for i, out in enumerate(held_out) if out] or self.train
        if not self.train:
            raise self.bad_param("eval_fraction", "leaves no task to train on")
        for index, task in enumerate(self.tasks):
            if not _prompt(task):
                raise self.bad_param("taskset", f"task {index} has no prompt (the user opens)")

    def make_rewards(self) -> list[Reward[VerifiersTask]]:
        first = self.tasks[0]
        rewards = [
            Reward(fn.__name__, self._component("reward", fn.__name__), _weight(fn))
            for fn in first.hooks("reward")
        ]
        rewards += [
            Reward(fn.__name__, self._component("metric", fn.__name__), 0.0)
            for fn in first.hooks("metric")
        ]
        return rewards

    def sample_task(self, rng: random.Random) -> VerifiersTask:
        return self._task(rng.choice(self.train))

    def eval_task_for(self, seed: int, index: int) -> VerifiersTask:
        rng = random.Random(f"{self.name}:eval:{seed}:{index}")
        return self._task(rng.choice(self.held_out))

    def initial_messages(self, task: VerifiersTask) -> list[ChatMessage]:
        return _prompt(self.tasks[task.index])

    def _task(self, index: int) -> VerifiersTask:
        prompt = _prompt(self.tasks[index])
        question = next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")
        return VerifiersTask(question=question, index=index)

    def _component(self, kind: str, name: str) -> RewardFn[VerifiersTask]:
        """A reward function running the task's `@vf.<kind>` named `name` on the episode."""

        async def component(
            task: VerifiersTask, completion: Sequence[ChatMessage]
        ) -> float | Mapping[str, float]:
            from verifiers.v1.utils.decorators import invoke

            found = self.tasks[task.index]
            hook = next(fn for fn in found.hooks(kind) if fn.__name__ == name)
            trace = _trace(found, [*self.initial_messages(task), *completion])
            value = await awaited(invoke(hook, {"task": found.data, "trace": trace}))
            if value is None:
                raise ValueError(f"verifiers {kind} {name!r} returned None")
            return value  # type: ignore[no-any-return]

        component.__name__ = name
        return component


def _weight(fn: Callable[..., Any]) -> float:
    return float(getattr(fn, "_vf_weight", 1.0))


def _unmapped(taskset: Any, task: Any) -> str:
    """Why this taskset cannot run here ("" when it can). Toolsets are judged by whether the
    classes declare any (calling `toolsets` would build the servers)."""
    import verifiers.v1 as vf

    for declared, base in ((type(task), vf.Task), (type(taskset), vf.Taskset)):
        if declared.toolsets.__func__ is not base.toolsets.__func__:
            return "it has toolsets, which do not map (env_svc/envs/verifiers_taskset.py)"
    for kind in ("reward", "metric"):
        for fn in task.hooks(kind):
            runtime = inspect.signature(fn).parameters.get("runtime")
            if runtime is not None and runtime.default is inspect.Parameter.empty:
                return f"its {kind} {fn.__name__!r} needs a runtime, which does not map"
    return ""


def _held_out(task: Any, fraction: float) -> bool:
    key = task.data.id or task.data.prompt_text or str(task.data.idx)
    digest = hashlib.sha256(f"held-out:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def _prompt(task: Any) -> list[ChatMessage]:
    """The task's opening messages: its system prompt, then its prompt ([] when it has none)."""
    data = task.data
    if data.prompt is None:
        return []
    opening: list[ChatMessage] = []
    if data.system_prompt:
        opening.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        return [*opening, {"role": "user", "content": data.prompt}]
    for message in data.prompt:
        if message.role in ROLES:
            opening.append({"role": message.role, "content": _text(message.content)})
    return opening


def _text(content: Any) -> str:
    from verifiers.v1.types import content_text

    return str(content_text(content))


def _trace(task: Any, messages: Sequence[ChatMessage]) -> Any:
    """A verifiers trace of the episode: its messages in one branch, the model's turns marked
    as sampled (what `trace.last_reply` and `trace.assistant_messages` read)."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode

    def message_of(index: int, message: ChatMessage) -> Any:
        match message["role"]:
            case "system":
                return vf.SystemMessage(content=message["content"])
            case "user":
                return vf.UserMessage(content=message["content"])
            case "assistant":
                return vf.AssistantMessage(content=message["content"])
            case _:
                return vf.ToolMessage(tool_call_id=f"call-{index}", content=message["content"])

    nodes = [
        MessageNode(
            parent=index - 1 if index else None,
            message=message_of(index, message),
            sampled=message["role"] == "assistant",
        )
        for index, message in enumerate(messages)
    ]
    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name="marlaas", trainable=True),
        nodes=nodes,
    )
