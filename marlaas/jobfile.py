"""Job spec files (TOML) -> `JobSpec`, with errors that name the file and the field.

A file holds the fields of `JobSpec` (common/wire/messages.py) as TOML tables:

    tenant = "acme"
    [env]
    name = "arithmetic"
    [rl]
    group_size = 8

`job_id` may be omitted: each submission then gets a fresh id `<tenant>-<file stem>-<hex>`.
`base_model` defaults to the deployment's. The spec comes through the one door every spec
does, `common.wire.jobspec.admit` (defaults and every rule), then `check_env` when given (the
CLI's: the environment's own for its params when the environment is installed on the machine
that submits); env_svc admits it again where it accepts a job.
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from common.wire.codec import unknown_fields
from common.wire.jobspec import Deployment, JobSpecError, admit, bound_problems
from common.wire.messages import (
    EnvSettings,
    EvalSettings,
    JobSpec,
    LoraSettings,
    RLSettings,
)


class JobFileError(ValueError):
    """A job file that cannot be read or does not describe a valid job."""


_TOP_LEVEL: dict[str, type] = {"job_id": str, "tenant": str, "base_model": str}
_TABLES: dict[str, type[msgspec.Struct]] = {
    "env": EnvSettings,
    "lora": LoraSettings,
    "rl": RLSettings,
    "eval": EvalSettings,
}
_REQUIRED = ("tenant", "env")


def load_job_file(
    path: Path,
    *,
    base_model: str,
    max_lora_rank: int | None = None,
    lora_target_modules: Sequence[str] | None = None,
    check_env: Callable[[JobSpec], None] | None = None,
) -> JobSpec:
    """Read, type-check and validate one job file; raises JobFileError('<file>: <field>: ...').
    `check_env` raises JobFileError for environment params it refuses."""
    deployment = Deployment(
        base_model=base_model,
        max_lora_rank=max_lora_rank,
        lora_target_modules=None if lora_target_modules is None else tuple(lora_target_modules),
    )
    try:
        spec = admit(_spec_of(_read_toml(path)), deployment=deployment, label=path.stem).spec
        if check_env is not None:
            check_env(spec)
    except (JobFileError, JobSpecError) as exc:
        raise JobFileError(f"{path}: {exc}") from None
    return spec


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise JobFileError("no such file") from None
    except IsADirectoryError:
        raise JobFileError("is a directory, not a job file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JobFileError(f"cannot read: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise JobFileError(f"invalid TOML: {exc}") from None


def _spec_of(data: dict[str, Any]) -> JobSpec:
    """The file's spec as written (no job id or base model: empty, for `admit` to fill)."""
    unknown = sorted(set(data) - set(_TOP_LEVEL) - set(_TABLES))
    if unknown:
        allowed = ", ".join([*_TOP_LEVEL, *_TABLES])
        raise JobFileError(f"{unknown[0]}: unknown field (a job file has {allowed})")
    for name in _REQUIRED:
        if name not in data:
            raise JobFileError(f"{name}: missing (required)")
    for name, kind in _TOP_LEVEL.items():
        if name in data and not isinstance(data[name], kind):
            raise JobFileError(f"{name}: expected {kind.__name__}, got {type(data[name]).__name__}")
    # Every bound a table breaks at once (converting stops at the first).
    if problems := [
        f"{path}: {problem}"
        for name, kind in _TABLES.items()
        if isinstance(data.get(name), dict)
        for path, problem in bound_problems(data[name], kind, name)
    ]:
        raise JobFileError("; ".join(problems))
    parts = {name: _table(name, data[name], kind) for name, kind in _TABLES.items() if name in data}
    return msgspec.structs.replace(
        JobSpec(
            job_id=data.get("job_id", ""),
            tenant=data["tenant"],
            base_model=data.get("base_model", ""),
            env=parts.pop("env"),  # type: ignore[arg-type]
            submitted_at=time.time(),
        ),
        **parts,
    )


def _table(name: str, value: Any, kind: type[msgspec.Struct]) -> msgspec.Struct:
    if not isinstance(value, dict):
        raise JobFileError(f"{name}: expected a table, got {type(value).__name__}")
    if unknown := unknown_fields(value, kind, f"{name}."):
        raise JobFileError(f"{unknown[0]}: unknown field")
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise JobFileError(_located(name, str(exc))) from None


def _located(table: str, message: str) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.sampling.x`" -> "rl.sampling.x: expected..."."""
    text, _, where = message.partition(" - at `$")
    path = table + where.rstrip("`")
    if text.startswith("Object missing required field `"):
        field = text.removeprefix("Object missing required field `").rstrip("`")
        return f"{path}.{field}: missing (required)"
    return f"{path}: {text[:1].lower()}{text[1:].replace('`', '')}"
