"""The environment contract: tasks, episodes, rewards, and the registry of environments.

Modelled on tinker-cookbook's `Env` (`reset` / `step -> StepResult`) and verifiers' rubrics
(typed reward functions with weights, recorded by name). Environments speak chat messages,
`{"role": ..., "content": ...}`, and receive the model's completion text as the action; the
orchestrator owns tokenization. env_svc replicas keep no episode state: an episode's state is
plain data that travels, encoded by `encode_state`, inside the prompt and rollout messages.
An environment object is therefore stateless after construction and serves every episode of
a job, in any order, on any replica.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import importlib.metadata
import inspect
import logging
import math
import os
import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, ClassVar, Generic, Literal, TypedDict, TypeVar, cast

import msgspec

from common.runtime.imports import load_object
from common.wire.jobspec import bound_problems
from common.wire.messages import JobSpec
from env_svc import datafiles

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "marlaas.envs"
"""Third-party packages register `name = "module:EnvironmentClass"` in this group."""
EPISODE_JOB: contextvars.ContextVar[str] = contextvars.ContextVar("episode_job", default="")
"""The job whose episode env_svc is driving ("" outside one): what a reward that asks a shared
service names, so the service charges the request to the job's tenant (env_svc/judge.py)."""
ENVIRONMENTS_VAR = "MARLAAS_ENVIRONMENTS"
"""`name=module:EnvironmentClass[,name=...]`: environments importable by env_svc (on its
Python path) but not packaged with an entry point, e.g. a module beside the deployment."""

Role = Literal["system", "user", "assistant", "tool"]


class ChatMessage(TypedDict):
    """One chat turn, as the model's chat template takes it."""

    role: Role
    content: str


# --- errors ---------------------------------------------------------------------------


class EnvSpecError(ValueError):
    """A job's environment settings cannot be used; env_svc rejects the job with this text."""


class UnknownEnvironmentError(EnvSpecError):
    def __init__(self, name: str, available: Sequence[str]) -> None:
        super().__init__(f"unknown environment {name!r}; available: {', '.join(available)}")
        self.name = name
        self.available = list(available)


class EnvParamsError(EnvSpecError):
    def __init__(self, env: str, param: str, reason: str) -> None:
        super().__init__(f"environment {env!r}: bad param {param!r}: {reason}")
        self.env = env
        self.param = param
        self.reason = reason


class UnregisteredHereError(EnvParamsError):
    """A param names what the operator registers with env_svc (an MCP server, a verifiers
    taskset) in a process where nothing of the kind is registered: env_svc rejects the job with
    this text; a machine other than env_svc's (`marlaas submit` checking a job file) leaves
    the param to env_svc."""


class EnvironmentLoadError(ImportError):
    """A registered environment could not be imported, or is not an `Environment`."""


class AsyncEnvironmentError(RuntimeError):
    """An environment that awaits was driven from synchronous code without an event loop."""


class EpisodeStateError(ValueError):
    """Bytes that are not this environment's episode state, or a step on a finished episode."""


# --- data -----------------------------------------------------------------------------


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
R = TypeVar("R")


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


async def awaited(value: R | Awaitable[R]) -> R:
    """`value`, awaited when environment code returned an awaitable (it was `async def`)."""
    return await value if inspect.isawaitable(value) else value


def run_sync(work: Coroutine[Any, Any, R]) -> R:
    """The result of a coroutine that never suspends (an environment whose code is all
    synchronous), driven without an event loop. One that does suspend awaits something only
    a loop can give: `AsyncEnvironmentError`."""
    try:
        work.send(None)
    except StopIteration as done:
        return cast(R, done.value)
    work.close()
    raise AsyncEnvironmentError(
        "this environment awaits (an async respond, reset or reward): drive it with "
        "astep/areset/ascore on an event loop"
    )


def finish(work: Coroutine[Any, Any, R], *, awaits: bool) -> R:
    """An environment's coroutine from synchronous code (tests, `marlaas envs check`): driven
    without a loop, or on a loop of its own when the environment awaits."""
    return asyncio.run(work) if awaits else run_sync(work)


def is_async(fn: object) -> bool:
    """Whether calling `fn` gives a coroutine (an `async def` function or method, or an
    object whose `__call__` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's method
    )


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


# --- environments ---------------------------------------------------------------------


class Environment(ABC, Generic[T]):
    """One kind of task and its rewards. Subclasses set the class attributes, `sample_task`,
    `make_rewards`, and, for multi-turn environments, `respond` and `max_turns`."""

    name: ClassVar[str]
    params_type: ClassVar[type[EnvParams]] = EnvParams
    task_type: ClassVar[type[Task]] = Task

    def __init__(
        self, params: Mapping[str, Any] | None = None, *, data_dir: Path | None = None
    ) -> None:
        """`data_dir`: the folder the job's files are found in (its tenant's folder of the
        data directory, env_svc/datafiles.py); None: the data directory itself."""
        self.data_dir = data_dir if data_dir is not None else datafiles.data_dir()
        for param, reason in bound_problems(dict(params or {}), self.params_type):
            raise EnvParamsError(self.name, param, reason)  # the first, in words
        try:
            self.params = msgspec.convert(dict(params or {}), self.params_type)
        except msgspec.ValidationError as exc:
            raise EnvParamsError(self.name, *_param_and_reason(str(exc))) from None
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


def encode_state(state: EpisodeState[Any]) -> bytes:
    return msgspec.msgpack.encode(state)


def decode_state(raw: bytes, env: Environment[T]) -> EpisodeState[T]:
    return env.decode_state(raw)


def _param_and_reason(message: str) -> tuple[str, str]:
    """Pull the param name out of msgspec's "Expected `int`, got `str` - at `$.max_turns`"."""
    if " - at `$." in message:
        reason, _, where = message.rpartition(" - at `$.")
        return where.rstrip("`").split(".")[0].split("[")[0], reason
    if message.startswith("Object contains unknown field `"):
        return message.split("`")[1], "unknown param"
    if message.startswith("Object missing required field `"):
        return message.split("`")[1], "required"
    return "params", message


# --- registry -------------------------------------------------------------------------

BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "arithmetic": "env_svc.envs.arithmetic:ArithmeticEnv",
    "calculator": "env_svc.envs.calculator:CalculatorEnv",
    "code_tasks": "env_svc.envs.code_tasks:CodeTasksEnv",
    "countdown": "env_svc.envs.countdown:CountdownEnv",
    "dataset": "env_svc.envs.dataset:DatasetEnv",
    "verifiers": "env_svc.envs.verifiers_taskset:VerifiersEnv",
}
"""Built-ins, imported on first use; they win over an entry point of the same name."""


def _from_variable() -> dict[str, str]:
    found: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in os.environ.get(ENVIRONMENTS_VAR, "").split(","))):
        name, equals, target = part.partition("=")
        if not equals or ":" not in target or not name.strip():
            raise EnvironmentLoadError(
                f"{ENVIRONMENTS_VAR}: {part!r} is not name=module:EnvironmentClass"
            )
        found[name.strip()] = target.strip()
    return found


def _registered() -> dict[str, str]:
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    found |= _from_variable()
    for name in found.keys() & BUILTIN_ENVIRONMENTS.keys():
        log.warning("entry point %r=%r shadows a built-in environment; ignored", name, found[name])
    return {**found, **BUILTIN_ENVIRONMENTS}


def available_environments() -> list[str]:
    return sorted(_registered())


def environment_class(name: str) -> type[Environment[Any]]:
    registered = _registered()
    if name not in registered:
        raise UnknownEnvironmentError(name, sorted(registered))
    target = registered[name]
    try:
        found = load_object(target)
    except Exception as exc:
        raise EnvironmentLoadError(
            f"environment {name!r} ({target}) failed to load: {exc}"
        ) from exc
    if not (isinstance(found, type) and issubclass(found, Environment)):
        raise EnvironmentLoadError(f"environment {name!r} ({target}) is not an Environment class")
    return found


def get_environment(
    name: str, params: Mapping[str, Any] | None = None, *, data_dir: Path | None = None
) -> Environment[Any]:
    return environment_class(name)(params, data_dir=data_dir)


def environment_for(spec: JobSpec) -> Environment[Any]:
    """The environment a job asked for, reading files from its tenant's data folder only;
    raises `EnvSpecError` subclasses for bad settings."""
    settings = spec.env
    return get_environment(
        settings.name, settings.params, data_dir=datafiles.tenant_data_dir(spec.tenant)
    )
