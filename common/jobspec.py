"""Checks on a `JobSpec` beyond its types, with located messages ("rl.group_size: must be >= 2").

Used by the CLI before anything is sent and by env_svc before a job is accepted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from common.messages import JobSpec
from common.tenants import TenantLimits, job_limit_problems

# Job ids name directories, Redis keys, metric labels and vLLM adapters (`<job>@v<n>`):
# keep them to characters that are safe in all of those. Starting with a letter or digit
# also rules out `.`, `..` and hidden directories.
NAME_CHARS = "A-Za-z0-9._-"
"""The characters of a job id or tenant (a regex character class body)."""
NAME_MAX_LEN = 128
_NAME = re.compile(f"[A-Za-z0-9][{NAME_CHARS}]{{0,{NAME_MAX_LEN - 1}}}")
NAME_RULE = (
    f"must be 1-{NAME_MAX_LEN} letters, digits, '.', '_' or '-', starting with a letter or digit"
)


def is_name(text: str) -> bool:
    """True for a usable job id or tenant name."""
    return _NAME.fullmatch(text) is not None


MAX_EVAL_TASKS = 1024

# Upper bounds on every number of a job, whatever its tenant's limits: beyond them a job is a
# mistake or an attack (a window of 10^6 groups, a rank no engine slot has).
MAX_GROUP_SIZE = 256
MAX_GROUPS_PER_STEP = 256
MAX_STEPS = 1_000_000
MAX_STALENESS = 64
MAX_TURNS = 64
MAX_CONTEXT_TOKENS = 131_072
MAX_LORA_RANK = 512
MAX_TARGET_MODULES = 32
MAX_EVAL_EVERY_STEPS = MAX_STEPS


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


def _problems(
    spec: JobSpec,
    base_model: str | None,
    max_lora_rank: int | None,
    lora_target_modules: Sequence[str] | None,
    max_model_len: int | None,
) -> list[str]:
    rl, lora, sampling, evals = spec.rl, spec.lora, spec.rl.sampling, spec.eval
    checks: list[tuple[str, bool, str]] = [
        ("job_id", is_name(spec.job_id), f"{NAME_RULE}, got {spec.job_id!r}"),
        ("tenant", is_name(spec.tenant), f"{NAME_RULE}, got {spec.tenant!r}"),
        ("env.name", bool(spec.env.name.strip()), "must be non-empty"),
        _within("rl.group_size", rl.group_size, 2, MAX_GROUP_SIZE),
        _within("rl.groups_per_step", rl.groups_per_step, 1, MAX_GROUPS_PER_STEP),
        _within("rl.max_steps", rl.max_steps, 1, MAX_STEPS),
        _within("rl.max_staleness", rl.max_staleness, 0, MAX_STALENESS),
        (
            "rl.learning_rate",
            0 < rl.learning_rate < 1,
            f"must be in (0, 1), got {rl.learning_rate}",
        ),
        ("rl.clip_low", 0 <= rl.clip_low < 1, f"must be in [0, 1), got {rl.clip_low}"),
        ("rl.clip_high", rl.clip_high >= 0, f"must be >= 0, got {rl.clip_high}"),
        ("rl.is_cap", rl.is_cap >= 1, f"must be >= 1, got {rl.is_cap}"),
        (
            "rl.max_turns",
            rl.max_turns is None or 1 <= rl.max_turns <= MAX_TURNS,
            f"must be in [1, {MAX_TURNS}] or unset, got {rl.max_turns}",
        ),
        (
            "rl.max_context_tokens",
            rl.max_context_tokens > sampling.max_new_tokens,
            f"must exceed rl.sampling.max_new_tokens ({sampling.max_new_tokens}), "
            f"got {rl.max_context_tokens}",
        ),
        (
            "rl.sampling.temperature",
            sampling.temperature > 0,
            f"must be > 0 for RL exploration, got {sampling.temperature}",
        ),
        ("rl.sampling.top_p", 0 < sampling.top_p <= 1, f"must be in (0, 1], got {sampling.top_p}"),
        (
            "rl.sampling.max_new_tokens",
            sampling.max_new_tokens >= 1,
            f"must be >= 1, got {sampling.max_new_tokens}",
        ),
        _within("rl.max_context_tokens", rl.max_context_tokens, 2, MAX_CONTEXT_TOKENS),
        _within("lora.rank", lora.rank, 1, MAX_LORA_RANK),
        ("lora.alpha", 0 < lora.alpha <= 16 * MAX_LORA_RANK,
         f"must be in (0, {16 * MAX_LORA_RANK}], got {lora.alpha}"),
        ("lora.dropout", 0 <= lora.dropout < 1, f"must be in [0, 1), got {lora.dropout}"),
        ("lora.target_modules", 1 <= len(lora.target_modules) <= MAX_TARGET_MODULES,
         f"must name 1-{MAX_TARGET_MODULES} modules, got {len(lora.target_modules)}"),
        ("eval.tasks", 0 <= evals.tasks <= MAX_EVAL_TASKS,
         f"must be in [0, {MAX_EVAL_TASKS}], got {evals.tasks}"),
        _within("eval.every_steps", evals.every_steps, 0, MAX_EVAL_EVERY_STEPS),
    ]  # fmt: skip
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
                spec.base_model == base_model,
                f"this deployment serves {base_model!r}, not {spec.base_model!r}",
            )
        )
    return [f"{field}: {message}" for field, ok, message in checks if not ok]


def _within(field: str, value: int, low: int, high: int) -> tuple[str, bool, str]:
    return field, low <= value <= high, f"must be in [{low}, {high}], got {value}"
