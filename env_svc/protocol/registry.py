"""The registry of environments by name: the built-ins, packages' entry points, and
`MARLAAS_ENVIRONMENTS`; a job's environment is built from it with its tenant's data folder."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.runtime.imports import load_object
from common.wire.messages import JobSpec
from env_svc import datafiles
from env_svc.protocol.environment import Environment
from env_svc.protocol.errors import EnvironmentLoadError, UnknownEnvironmentError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "marlaas.envs"
"""Third-party packages register `name = "module:EnvironmentClass"` in this group."""
ENVIRONMENTS_VAR = "MARLAAS_ENVIRONMENTS"
"""`name=module:EnvironmentClass[,name=...]`: environments importable by env_svc (on its
Python path) but not packaged with an entry point, e.g. a module beside the deployment."""

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
