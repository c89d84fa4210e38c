"""Checks on a `JobSpec` beyond its types, with located messages ("rl.group_size: must be >= 2"),
and the one door a spec comes through: `admit` stamps its tenant, fills its defaults (a fresh
job id, the deployment's base model), runs every rule and returns the `AdmittedJob` that every
later reader takes as it is.

The CLI and the tenant API admit a spec before anything is sent; env_svc admits it again where
it registers the job (operators may produce to Kafka directly), and what it admits is stored.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from msgspec import inspect

from common.state.tenants import TenantLimits, job_limit_problems, samples_in_flight
from common.wire.messages import (
    MAX_PARAMS_BYTES,
    MAX_PARAMS_DEPTH,
    NAME_MAX_LEN,
    JobSpec,
    clipped,
    new_id,
)

# Job ids name directories, Redis keys, metric labels and vLLM adapters (`<job>@v<n>`):
# keep them to characters that are safe in all of those. Starting with a letter or digit
# also rules out `.`, `..` and hidden directories.
NAME_CHARS = "A-Za-z0-9._-"
"""The characters of a job id or tenant (a regex character class body)."""
_NAME = re.compile(f"[A-Za-z0-9][{NAME_CHARS}]{{0,{NAME_MAX_LEN - 1}}}")
NAME_RULE = (
    f"must be 1-{NAME_MAX_LEN} letters, digits, '.', '_' or '-', starting with a letter or digit"
)


def is_name(text: str) -> bool:
    """True for a usable job id or tenant name."""
    return _NAME.fullmatch(text) is not None


class JobSpecError(ValueError):
    """A job that cannot run as specified; the text names the field."""


def validate_job(
    spec: JobSpec,
    *,
    base_model: str | None = None,
    max_lora_rank: int | None = None,
    lora_target_modules: Sequence[str] | None = None,
    max_model_len: int | None = None,
    limits: TenantLimits | None = None,
) -> None:
    """Raise JobSpecError for the first problem found (all of them, joined by '; ').

    `base_model`, `max_lora_rank`, `lora_target_modules` and `max_model_len` (the rollout
    engine's longest context) are what the deployment serves, `limits` the tenant's per-job
    quotas (None: not checked)."""
    problems = list(_problems(spec, base_model, max_lora_rank, lora_target_modules, max_model_len))
    if limits is not None:
        problems += job_limit_problems(spec, limits)
    if problems:
        raise JobSpecError("; ".join(problems))


@dataclass(frozen=True)
class Deployment:
    """What the deployment serves, which a job must fit; each None: not checked (a door that
    does not know it)."""

    base_model: str | None = None
    """The base model it serves (a spec's empty `base_model` means this one)."""
    max_lora_rank: int | None = None
    """The rollout engine's LoRA slots' rank."""
    lora_target_modules: tuple[str, ...] | None = None
    """The modules the rollout engine has LoRA slots on."""
    max_model_len: int | None = None
    """The rollout engine's longest context (its live replicas' shortest)."""


@dataclass(frozen=True)
class AdmittedJob:
    """A job spec admitted (`admit`): its tenant stamped, its defaults filled and every rule
    passed; with what its readers derive from it, computed once. env_svc registers it, and
    every reader of the job record takes it as it is (common/state/admitted.py)."""

    spec: JobSpec
    created_at: float
    """When it was admitted; env_svc registers it with this `created_at`, which tells a
    reused id's new record from the old one's."""
    samples_in_flight: int = field(init=False)
    """G x B x (S + 1) + eval.tasks: what it counts against its tenant's quota."""
    max_groups: int = field(init=False)
    """`rl.max_steps` x `rl.groups_per_step`: the groups it is ever issued."""

    def __post_init__(self) -> None:
        rl = self.spec.rl
        object.__setattr__(self, "samples_in_flight", samples_in_flight(self.spec))
        object.__setattr__(self, "max_groups", rl.max_steps * rl.groups_per_step)

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def tenant(self) -> str:
        return self.spec.tenant


def admit(
    spec: JobSpec,
    *,
    deployment: Deployment | None = None,
    limits: TenantLimits | None = None,
    tenant: str | None = None,
    label: str = "",
) -> AdmittedJob:
    """The one door of a job spec: `tenant` (the submitter's, when known) stamped on it, an
    empty job id replaced by a fresh one (`fresh_job_id` with `label`), an empty base model
    by the deployment's, then every rule checked (`validate_job`). Raises JobSpecError naming
    every problem. No `deployment`: nothing of it checked."""
    deployment = deployment or Deployment()
    tenant = spec.tenant if tenant is None else tenant
    filled = msgspec.structs.replace(
        spec,
        tenant=tenant,
        job_id=spec.job_id or fresh_job_id(tenant, label),
        base_model=spec.base_model or deployment.base_model or "",
    )
    validate_job(
        filled,
        base_model=deployment.base_model,
        max_lora_rank=deployment.max_lora_rank,
        lora_target_modules=deployment.lora_target_modules,
        max_model_len=deployment.max_model_len,
        limits=limits,
    )
    return AdmittedJob(filled, created_at=time.time())


_NOT_IN_NAME = re.compile(f"[^{NAME_CHARS}]+")
JOB_ID_HEX_DIGITS = 12
"""Of a fresh job id's random part: a tenant's ids do not collide (a collision is a 409)."""


def fresh_job_id(tenant: str, label: str = "") -> str:
    """A new job id, `<tenant>-<label>-<hex>` (the CLI's label is the job file's stem) or
    `<tenant>-<hex>`: the label cut to the characters a job id may hold, the whole to the
    128 allowed."""
    suffix = f"-{new_id()[:JOB_ID_HEX_DIGITS]}"
    cut = _NOT_IN_NAME.sub("-", label).strip("-")
    prefix = f"{tenant}-{cut}" if cut else tenant
    return prefix[: NAME_MAX_LEN - len(suffix)] + suffix


_Check = tuple[str, bool, str]
"""A field, whether it passes, and what to say when it does not."""


def _problems(
    spec: JobSpec,
    base_model: str | None,
    max_lora_rank: int | None,
    lora_target_modules: Sequence[str] | None,
    max_model_len: int | None,
) -> list[str]:
    checks = [
        *_spec_checks(spec),
        *_deployment_checks(spec, base_model, max_lora_rank, lora_target_modules, max_model_len),
    ]
    return [f"{field}: {message}" for field, ok, message in checks if not ok]


def _spec_checks(spec: JobSpec) -> list[_Check]:
    """What a job must satisfy on its own: names, declared bounds, params, and settings that
    only make sense together."""
    rl, sampling = spec.rl, spec.rl.sampling
    return [
        ("job_id", is_name(spec.job_id), f"{NAME_RULE}, got {spec.job_id!r}"),
        ("tenant", is_name(spec.tenant), f"{NAME_RULE}, got {spec.tenant!r}"),
        ("env.name", bool(spec.env.name.strip()), "must be non-empty"),
        *((field, False, message) for field, message in bound_problems(spec)),
        *(("env.params", False, message) for message in params_problems(spec.env.params)),
        (
            "rl.sampling.temperature",
            sampling.temperature > 0,
            f"must be > 0 for RL exploration, got {sampling.temperature}",
        ),
        (
            "rl.max_context_tokens",
            rl.max_context_tokens > sampling.max_new_tokens,
            f"must exceed rl.sampling.max_new_tokens ({sampling.max_new_tokens}), "
            f"got {rl.max_context_tokens}",
        ),
    ]


def _deployment_checks(
    spec: JobSpec,
    base_model: str | None,
    max_lora_rank: int | None,
    lora_target_modules: Sequence[str] | None,
    max_model_len: int | None,
) -> list[_Check]:
    """What the deployment must be able to serve for the job (each limit None: not checked)."""
    rl, lora = spec.rl, spec.lora
    checks: list[_Check] = []
    if max_lora_rank is not None:
        checks.append(
            (
                "lora.rank",
                lora.rank <= max_lora_rank,
                f"{lora.rank} exceeds the rollout engine's max_lora_rank {max_lora_rank}",
            )
        )
    if lora_target_modules is not None:
        unserved = sorted(set(lora.target_modules) - set(lora_target_modules))
        checks.append(
            (
                "lora.target_modules",
                not unserved,
                f"{unserved} not served by the rollout engine, which has LoRA slots on "
                f"{sorted(lora_target_modules)} (MARLAAS_LORA_TARGET_MODULES)",
            )
        )
    if max_model_len is not None:
        checks.append(
            (
                "rl.max_context_tokens",
                rl.max_context_tokens <= max_model_len,
                f"{rl.max_context_tokens} exceeds the rollout engine's max_model_len "
                f"{max_model_len} (ROLLOUT_MAX_MODEL_LEN): no episode could finish",
            )
        )
    if base_model is not None:
        checks.append(
            (
                "base_model",
                # Empty: the one the deployment serves (env_svc fills it in).
                spec.base_model in ("", base_model),
                f"this deployment serves {base_model!r}, not {spec.base_model!r}",
            )
        )
    return checks


def params_problems(params: Mapping[str, Any]) -> list[str]:
    """What is wrong with an environment's `params` as a whole (its number of keys is a
    declared bound): nested too deep, or too large encoded."""
    if (depth := _depth(params)) > MAX_PARAMS_DEPTH:
        return [f"must nest at most {MAX_PARAMS_DEPTH} maps or lists deep, got {depth}"]
    try:
        size = len(msgspec.msgpack.encode(params))
    except (TypeError, OverflowError) as exc:
        return [f"cannot be encoded: {exc}"]
    if size > MAX_PARAMS_BYTES:
        return [f"must encode in at most {MAX_PARAMS_BYTES} bytes, got {size}"]
    return []


def _depth(value: Any) -> int:
    """How many maps and lists nest in `value` (0 for a scalar), level by level (no
    recursion: JSON that decodes may nest deeper than Python's stack), counted to one past
    the bound."""
    depth, level = 0, [value]
    while depth <= MAX_PARAMS_DEPTH:
        inside = [item for item in level if isinstance(item, dict | list)]
        if not inside:
            break
        depth += 1
        level = [v for c in inside for v in (c.values() if isinstance(c, dict) else c)]
    return depth


def bound_problems(
    value: msgspec.Struct | Mapping[str, Any],
    kind: type[msgspec.Struct] | None = None,
    at: str = "",
) -> list[tuple[str, str]]:
    """(dotted field, what is wrong) for every number or list in `value` outside the bounds
    its field declares (`msgspec.Meta` in common/wire/messages.py). Decoding enforces the same
    bounds but stops at the first; this names all of them, for a struct built in Python or
    for the plain mapping (a job file's table) that is to become a `kind`. Values of the
    wrong type are left to decoding."""
    return _bounds(value, inspect.type_info(kind or type(value)), at)


def _bounds(value: Any, info: inspect.Type, at: str, or_unset: str = "") -> list[tuple[str, str]]:
    if isinstance(info, inspect.Metadata):  # a description for the schema around the type
        return _bounds(value, info.type, at, or_unset)
    if isinstance(info, inspect.StructType):
        found: list[tuple[str, str]] = []
        for field in info.fields:
            path = f"{at}.{field.encode_name}" if at else field.encode_name
            if isinstance(value, Mapping):
                if field.encode_name in value:
                    found += _bounds(value[field.encode_name], field.type, path)
            elif isinstance(value, info.cls):
                found += _bounds(getattr(value, field.name), field.type, path)
        return found
    if isinstance(info, inspect.UnionType):
        kinds = [t for t in info.types if not isinstance(t, inspect.NoneType)]
        return _bounds(value, kinds[0], at, " or unset") if len(kinds) == 1 else []
    if isinstance(info, (inspect.IntType, inspect.FloatType)):
        if isinstance(value, bool) or not isinstance(value, int | float) or _within(value, info):
            return []
        return [(at, f"must be {_range(info)}{or_unset}, got {value}")]
    if isinstance(info, inspect.StrType) and isinstance(value, str):
        if (problem := _length(len(value), info, "characters")) is None:
            return []
        return [(at, f"{problem}{or_unset}")]
    if isinstance(info, inspect.DictType) and isinstance(value, Mapping):
        found = [(at, problem)] if (problem := _length(len(value), info, "keys")) else []
        for key in value:
            if isinstance(key, str) and (problem := _length(len(key), info.key_type, "characters")):
                return [*found, (f"{at} key {clipped(key, 40)!r}", problem)]
        return found
    if isinstance(info, inspect.ListType | inspect.VarTupleType) and isinstance(
        value, list | tuple
    ):
        if (problem := _length(len(value), info, "items")) is not None:
            return [(at, problem)]
        items = enumerate(value)
        return [p for i, item in items for p in _bounds(item, info.item_type, f"{at}[{i}]")]
    return []


def _length(n: int, info: Any, unit: str) -> str | None:
    """What is wrong with a length of `n` under `info`'s declared bounds (None: nothing)."""
    low, high = getattr(info, "min_length", None) or 0, getattr(info, "max_length", None)
    if n >= low and (high is None or n <= high):
        return None
    span = f"{low}-{high}" if high is not None else f"at least {low}"
    return f"must have {span} {unit}, got {n}"


def _within(value: float, info: inspect.IntType | inspect.FloatType) -> bool:
    return (
        (info.ge is None or value >= info.ge)
        and (info.gt is None or value > info.gt)
        and (info.le is None or value <= info.le)
        and (info.lt is None or value < info.lt)
    )


def _range(info: inspect.IntType | inspect.FloatType) -> str:
    """ "in [2, 256]", "in (0, 1)", ">= 1" from a field's bounds."""
    low = ("[", info.ge) if info.ge is not None else ("(", info.gt) if info.gt is not None else None
    high = (
        ("]", info.le) if info.le is not None else (")", info.lt) if info.lt is not None else None
    )
    if low and high:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]}"
    assert high is not None
    return f"{'<=' if high[0] == ']' else '<'} {high[1]}"
