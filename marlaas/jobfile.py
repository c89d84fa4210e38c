"""Job spec files (TOML) -> `JobSpec`, with errors that name the file and the field.

A file holds the fields of `JobSpec` (common/wire/messages.py) as TOML tables:

    tenant = "acme"
    [env]
    name = "arithmetic"
    [rl]
    group_size = 8

`job_id` may be omitted: each submission then gets a fresh id `<tenant>-<file stem>-<hex>`.
`base_model` defaults to the deployment's. Checks beyond types are `common.wire.jobspec`'s, and
`check_env`'s when given (the CLI's: the environment's own for its params when the environment
is installed on the machine that submits); env_svc checks them all again where it accepts a job.
"""

from __future__ import annotations

import re
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from common.wire.codec import unknown_fields
from common.wire.jobspec import NAME_CHARS, NAME_MAX_LEN, JobSpecError, bound_problems, validate_job
from common.wire.messages import (
    EnvSettings,
    EvalSettings,
    JobSpec,
    LoraSettings,
    RLSettings,
    new_id,
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
_NOT_IN_NAME = re.compile(f"[^{NAME_CHARS}]+")


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
    try:
        spec = _spec_of(_read_toml(path), path.stem, base_model, max_lora_rank, lora_target_modules)
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


def _fresh_job_id(tenant: str, stem: str) -> str:
    """`<tenant>-<file stem>-<hex>`, the stem cut to the characters a job id may hold and the
    whole to the 128 allowed."""
    suffix = f"-{new_id()[:6]}"
    prefix = f"{tenant}-{_NOT_IN_NAME.sub('-', stem).strip('-')}"
    return prefix[: NAME_MAX_LEN - len(suffix)] + suffix


def _spec_of(
    data: dict[str, Any],
    stem: str,
    base_model: str,
    max_lora_rank: int | None,
    lora_target_modules: Sequence[str] | None,
) -> JobSpec:
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
    tenant = data["tenant"]
    spec = msgspec.structs.replace(
        JobSpec(
            job_id=data.get("job_id") or _fresh_job_id(tenant, stem),
            tenant=tenant,
            base_model=data.get("base_model", base_model),
            env=parts.pop("env"),  # type: ignore[arg-type]
            submitted_at=time.time(),
        ),
        **parts,
    )
    validate_job(
        spec,
        base_model=base_model,
        max_lora_rank=max_lora_rank,
        lora_target_modules=lora_target_modules,
    )
    return spec


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
