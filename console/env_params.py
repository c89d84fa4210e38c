"""A job's environment params checked on the machine that submits it, when the environment is
installed there: the CLI's `check_env` for `marlaas.jobfile.load_job_file`."""

from __future__ import annotations

from common.wire.messages import JobSpec
from marlaas.jobfile import JobFileError


def check_env_params(spec: JobSpec) -> None:
    """Environment params checked here when the environment is installed on this machine.

    An environment only the deployment has (a plugin), or a param naming what only the
    deployment registers (an MCP server, a verifiers taskset), is left to env_svc, which
    rejects a bad one with the reason on `marlaas.events`.
    """
    from env_svc.protocol import (
        EnvSpecError,
        UnknownEnvironmentError,
        UnregisteredHereError,
        environment_for,
    )

    try:
        environment_for(spec)
    except (UnknownEnvironmentError, UnregisteredHereError):
        return
    except EnvSpecError as exc:
        raise JobFileError(f"env: {exc}") from None
