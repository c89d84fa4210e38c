"""A job's environment params checked on the machine that submits it, when the environment is
installed there: the CLI's `check_env` for `marlaas.jobfile.load_job_file`."""

from __future__ import annotations

import os

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
        raise JobFileError(f"env: {exc}{_data_dir_hint(spec, str(exc))}") from None


def _data_dir_hint(spec: JobSpec, problem: str) -> str:
    """Where this machine looked for a job's data file: env_svc's messages name no path (a
    tenant reads them), but here the user runs the check on their own machine."""
    from env_svc.datafiles import DATA_DIR_VAR, data_dir, tenant_data_dir

    if "data folder" not in problem:
        return ""
    source = (
        f"{DATA_DIR_VAR}={data_dir()}"
        if os.environ.get(DATA_DIR_VAR)
        else (f"{DATA_DIR_VAR} is not set: the working directory")
    )
    return (
        f"; looked in {tenant_data_dir(spec.tenant).resolve()} ({source}); set "
        f"{DATA_DIR_VAR} to the folder holding {spec.tenant}/ before `marlaas up` and "
        "`marlaas submit`"
    )
