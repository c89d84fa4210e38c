"""What the tenant API answers with: its JSON shapes (pydantic, so /openapi.json has them)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from common.state.evals import evaluated
from common.state.registry import JobRecord
from common.state.tenants import samples_in_flight
from common.wire.chat import MAX_PROMPT_CHARS, MAX_TOKENS


class TenantView(BaseModel):
    tenant: str
    limits: dict[str, int | list[str]]
    jobs: list[str]


class JobView(BaseModel):
    job_id: str
    tenant: str
    status: str
    """`submitted` until env_svc has accepted (or rejected) it, then its lifecycle state."""
    reason: str = ""
    version: int = 0
    """The newest trained adapter version (the job's step)."""
    env: str = ""
    max_steps: int = 0
    samples_in_flight: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    evals: dict[str, dict[str, float]] = {}
    """Held-out results of each version whose evaluation is done, by version (0: the base
    model): `eval_accuracy`, `eval_accuracy_stderr`, `eval_episodes`, `eval_reward`."""
    final_eval_due: bool = False
    """The job evaluates its final version: a completed job's result is in once `evals` has
    `max_steps`."""

    @classmethod
    def of(
        cls,
        record: JobRecord,
        version: int,
        evals: dict[str, dict[str, float]] | None = None,
    ) -> JobView:
        spec = record.spec
        return cls(
            job_id=spec.job_id,
            tenant=spec.tenant,
            status=record.status,
            reason=record.reason,
            version=version,
            env=spec.env.name,
            max_steps=spec.rl.max_steps,
            samples_in_flight=samples_in_flight(spec),
            created_at=record.created_at,
            updated_at=record.updated_at,
            evals=evals or {},
            final_eval_due=evaluated(spec, spec.rl.max_steps),
        )


class Submitted(BaseModel):
    job_id: str
    tenant: str


class CommandDone(BaseModel):
    job_id: str
    status: str


class SampleRequest(BaseModel):
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    version: int | None = None
    max_tokens: int = Field(default=64, ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=0.0, ge=0.0)


class SampleAnswer(BaseModel):
    model: str
    content: str


class UsageCounts(BaseModel):
    """What a job's or a tenant's work cost (common/state/usage.py `Usage`)."""

    tokens: int
    """Tokens generated for training episodes."""
    eval_tokens: int
    chat_tokens: int
    """Tokens of chat completions with the job's adapters (and a judge's answers for it)."""
    episodes: int
    eval_episodes: int
    trainer_s: float
    """Trainer compute seconds (its share of each pass it was in)."""
    stored_bytes: int
    """Bytes of its published adapter versions."""


class JobUsage(UsageCounts):
    job_id: str


class UsageView(BaseModel):
    tenant: str
    total: UsageCounts
    """The tenant's, its ended and expired jobs included."""
    jobs: list[JobUsage]
