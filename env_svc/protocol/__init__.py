"""The environment contract: tasks, episodes, rewards, and the registry of environments.

Modelled on tinker-cookbook's `Env` (`reset` / `step -> StepResult`) and verifiers' rubrics
(typed reward functions with weights, recorded by name). Environments speak chat messages,
`{"role": ..., "content": ...}`, and receive the model's completion text as the action; the
orchestrator owns tokenization. env_svc replicas keep no episode state: an episode's state is
plain data that travels, encoded by `encode_state`, inside the prompt and rollout messages.
An environment object is therefore stateless after construction and serves every episode of
a job, in any order, on any replica.

Its rooms: `data` (messages, tasks, params, states, results), `errors`, `params` (parameter
declaration), `rewards` (weighted reward functions and scoring), `awaiting` (sync or async
environment code), `contract` (what an environment declares and implements), `environment`
(the `Environment` base class, which drives episodes), `registry` (environments by name).
Environments import every name from here.
"""

from env_svc.protocol.awaiting import awaited, finish, is_async, run_sync
from env_svc.protocol.contract import TaskContract
from env_svc.protocol.data import (
    ChatMessage,
    EnvParams,
    EpisodeState,
    Operand,
    RewardResult,
    Role,
    StepResult,
    T,
    Task,
    Weight,
    encode_state,
)
from env_svc.protocol.environment import Environment, decode_state
from env_svc.protocol.errors import (
    AsyncEnvironmentError,
    EnvironmentLoadError,
    EnvParamsError,
    EnvSpecError,
    EpisodeStateError,
    UnknownEnvironmentError,
    UnregisteredHereError,
)
from env_svc.protocol.registry import (
    BUILTIN_ENVIRONMENTS,
    ENTRY_POINT_GROUP,
    ENVIRONMENTS_VAR,
    available_environments,
    environment_class,
    environment_for,
    get_environment,
)
from env_svc.protocol.rewards import (
    CUT_OFF,
    EPISODE_JOB,
    Reward,
    RewardFn,
    ascore,
    last_assistant_text,
    score,
    unanswered,
)

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "CUT_OFF",
    "ENTRY_POINT_GROUP",
    "ENVIRONMENTS_VAR",
    "EPISODE_JOB",
    "AsyncEnvironmentError",
    "ChatMessage",
    "EnvParams",
    "EnvParamsError",
    "EnvSpecError",
    "Environment",
    "EnvironmentLoadError",
    "EpisodeState",
    "EpisodeStateError",
    "Operand",
    "Reward",
    "RewardFn",
    "RewardResult",
    "Role",
    "StepResult",
    "T",
    "Task",
    "TaskContract",
    "UnknownEnvironmentError",
    "UnregisteredHereError",
    "Weight",
    "ascore",
    "available_environments",
    "awaited",
    "decode_state",
    "encode_state",
    "environment_class",
    "environment_for",
    "finish",
    "get_environment",
    "is_async",
    "last_assistant_text",
    "run_sync",
    "score",
    "unanswered",
]
