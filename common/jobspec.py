"""Checks on a `JobSpec` beyond its types, with located messages ("rl.group_size: must be >= 2").

Used by the CLI before anything is sent and by env_svc before a job is accepted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from common.messages import JobSpec

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


class JobSpecError(ValueError):
    """A job that cannot run as specified; the text names the field."""


def validate_job(
    spec: JobSpec,
    *,
    base_model: str | None = None,
    max_lora_rank: int | None = None,
    lora_target_modules: Sequence[str] | None = None,
    max_model_len: int | None = None,
) -> None:
    """Raise JobSpecError for the first problem found (all of them, joined by '; ').

    `base_model`, `max_lora_rank`, `lora_target_modules` and `max_model_len` (the rollout
    engine's longest context) are what the deployment serves (None: not checked)."""
    problems = list(_problems(spec, base_model, max_lora_rank, lora_target_modules, max_model_len))
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
        ("rl.group_size", rl.group_size >= 2, f"must be >= 2, got {rl.group_size}"),
        ("rl.groups_per_step", rl.groups_per_step >= 1, f"must be >= 1, got {rl.groups_per_step}"),
        ("rl.max_steps", rl.max_steps >= 1, f"must be >= 1, got {rl.max_steps}"),
        ("rl.max_staleness", rl.max_staleness >= 0, f"must be >= 0, got {rl.max_staleness}"),
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
            rl.max_turns is None or rl.max_turns >= 1,
            f"must be >= 1 or unset, got {rl.max_turns}",
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
        ("lora.rank", lora.rank >= 1, f"must be >= 1, got {lora.rank}"),
        ("lora.alpha", lora.alpha > 0, f"must be > 0, got {lora.alpha}"),
        ("lora.dropout", 0 <= lora.dropout < 1, f"must be in [0, 1), got {lora.dropout}"),
        ("lora.target_modules", bool(lora.target_modules), "must name at least one module"),
        ("eval.tasks", 0 <= evals.tasks <= MAX_EVAL_TASKS,
         f"must be in [0, {MAX_EVAL_TASKS}], got {evals.tasks}"),
        ("eval.every_steps", evals.every_steps >= 0, f"must be >= 0, got {evals.every_steps}"),
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
