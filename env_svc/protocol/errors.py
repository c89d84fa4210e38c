"""What a job's environment can raise: bad settings (rejected with the text), a failed import,
an async environment driven without a loop, bytes that are not an episode's state."""

from __future__ import annotations

from collections.abc import Sequence


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
