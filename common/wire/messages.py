"""Every payload that crosses a Kafka topic, and the topic each one travels on.

This module owns the wire contract (docs/architecture.md, "Topics and messages"). Payloads
are `msgspec.Struct`s encoded as msgpack maps keyed by field name, with a `kind` tag; a
record may also be a JSON object of the same shape (jobs produced by any Kafka client).
Each carries the `schema` version of the build that wrote it and names the field consumers
de-duplicate on and the one that keys its record (`DEDUP_FIELD`, `KEY_FIELD`). This module
holds the types only: `common/wire/codec.py` turns them into bytes and back. It is the one
import point of the contract: what every message shares (the schema version, topics, base
structs) is `common/wire/envelope.py`, the settings blocks of a job and their bounds
`common/wire/job_settings.py`, and every name of both is re-exported here.

How messages evolve: a field is only ever added, with a default, and `SCHEMA_VERSION` goes
up by one; a field is never removed, renamed or given another meaning. A reader fills in
defaults for fields an older writer did not know and ignores fields of a newer writer, so
services of different builds read each other both ways (rolling upgrades). Unknown fields
in a job (`marlaas.jobs`) of this reader's schema or older are typos and refused. Schema 1
(positional msgpack arrays, before 2026-12) is still read, and written when
`MARLAAS_WIRE_SCHEMA=1`, while readers of that build remain.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from common.wire.adapters import AdapterRef
from common.wire.envelope import (
    MAX_REASON_CHARS,
    SCHEMA_VERSION,
    ContextTooLongError,
    MessageDecodeError,
    Topic,
    _Wire,
    clipped,
    new_id,
)
from common.wire.job_settings import (
    MAX_CONTEXT_TOKENS,
    MAX_EVAL_TASKS,
    MAX_GROUP_SIZE,
    MAX_GROUPS_PER_STEP,
    MAX_LORA_RANK,
    MAX_PARAMS,
    MAX_PARAMS_BYTES,
    MAX_PARAMS_DEPTH,
    MAX_PATH_LEN,
    MAX_SEED,
    MAX_STALENESS,
    MAX_STEPS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TARGET_MODULES,
    MAX_TURNS,
    NAME_MAX_LEN,
    EnvSettings,
    EvalSettings,
    LoraSettings,
    LrSchedule,
    Name,
    RLSettings,
    SamplingSettings,
)

__all__ = [
    "MAX_CONTEXT_TOKENS",
    "MAX_EVAL_TASKS",
    "MAX_GROUPS_PER_STEP",
    "MAX_GROUP_SIZE",
    "MAX_LORA_RANK",
    "MAX_PARAMS",
    "MAX_PARAMS_BYTES",
    "MAX_PARAMS_DEPTH",
    "MAX_PATH_LEN",
    "MAX_REASON_CHARS",
    "MAX_SEED",
    "MAX_STALENESS",
    "MAX_STEPS",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TARGET_MODULES",
    "MAX_TURNS",
    "NAME_MAX_LEN",
    "SCHEMA_VERSION",
    "TOPIC_MESSAGES",
    "AdapterUpdate",
    "ContextTooLongError",
    "DeadLetter",
    "DropKind",
    "EnvSettings",
    "EvalSettings",
    "Event",
    "EventKind",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "GroupDropped",
    "JobAction",
    "JobCommand",
    "JobSpec",
    "LoraSettings",
    "LrSchedule",
    "Message",
    "MessageDecodeError",
    "Name",
    "RLSettings",
    "SamplingSettings",
    "Topic",
    "Trajectory",
    "clipped",
    "job_event",
    "new_id",
    "result_for",
]


# --- marlaas.jobs ---------------------------------------------------------------------


class JobSpec(_Wire, tag="job_spec", kw_only=True):
    """CLI (or any Kafka client) -> env_svc: a tenant asks for an RL job. De-duplicated on
    `job_id`."""

    job_id: Name
    tenant: Name
    base_model: Annotated[str, Meta(max_length=MAX_PATH_LEN)] = ""
    """The deployment's base model (its name or directory); empty: whatever it serves
    (env_svc registers the job with that filled in)."""
    env: EnvSettings
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)
    rl: RLSettings = msgspec.field(default_factory=RLSettings)
    eval: EvalSettings = msgspec.field(default_factory=EvalSettings)
    submitted_at: float = 0.0

    DEDUP_FIELD = "job_id"
    KEY_FIELD = "job_id"


JobAction = Literal["pause", "resume", "cancel"]


class JobCommand(_Wire, tag="job_command"):
    """CLI -> env_svc: change a running job's state. De-duplicated on `command_id`."""

    command_id: Name
    job_id: Name
    action: JobAction
    issued_at: float = 0.0

    DEDUP_FIELD = "command_id"
    KEY_FIELD = "job_id"


# --- marlaas.prompts / marlaas.rollouts -----------------------------------------------


class _Turn(_Wire):
    """What names one turn of one episode: a generation request's ids and context, which its
    result echoes. De-duplicated on `request_id`, keyed by episode."""

    request_id: str
    job_id: str
    episode_id: str
    group_id: str
    sample_index: int
    turn: int
    context_token_ids: list[int]
    """The whole context so far (prompt + earlier turns + tool results), never re-tokenized."""

    DEDUP_FIELD = "request_id"
    KEY_FIELD = "episode_id"


class GenerationRequest(_Turn, tag="generation_request"):
    """env_svc -> rollout_svc: sample one turn of one episode."""

    sampling: SamplingSettings
    env_state: bytes = b""
    """The episode's state, opaque to rollout_svc, echoed back in the result."""
    issued_at: float = 0.0
    min_adapter_version: int = 0
    """The job's trained version when the group was issued; sampling waits for it."""
    pinned_adapter_version: int = -1
    """Sample with exactly this adapter version (0: the base model), as evaluations do; -1:
    the job's latest, at least `min_adapter_version`."""
    tenant: str = ""
    """The job's tenant, carried from the spec env_svc holds, so rollout_svc's fair
    admission need not read the job record back; "" from writers before schema 4 (rollout_svc
    then looks it up)."""


FinishReason = Literal["stop", "length", "abort"]


class GenerationResult(_Turn, tag="generation_result"):
    """rollout_svc -> env_svc: one sampled turn."""

    completion_token_ids: list[int]
    logprobs: list[float]
    """Sampler logprob of each completion token (same length as completion_token_ids)."""
    adapter_version: int
    """Adapter version that produced this turn; 0 is the bare base model."""
    finish_reason: FinishReason
    env_state: bytes = b""
    queue_s: float = 0.0
    generate_s: float = 0.0


_ECHOED = (*(name for name in _Turn.__struct_fields__ if name != "schema"), "env_state")
"""What a result echoes of its request: the turn's ids and context (not `schema`), and the
episode's state."""


def result_for(
    request: GenerationRequest,
    *,
    completion_token_ids: list[int],
    logprobs: list[float],
    adapter_version: int,
    finish_reason: FinishReason,
    queue_s: float = 0.0,
    generate_s: float = 0.0,
) -> GenerationResult:
    """The answer to `request`: its ids and context echoed, with what was sampled."""
    echoed = {name: getattr(request, name) for name in _ECHOED}
    return GenerationResult(
        **echoed,
        completion_token_ids=completion_token_ids,
        logprobs=logprobs,
        adapter_version=adapter_version,
        finish_reason=finish_reason,
        queue_s=queue_s,
        generate_s=generate_s,
    )


# --- marlaas.trajectories -------------------------------------------------------------


class Trajectory(_Wire, tag="trajectory"):
    """env_svc -> trainer_svc: one finished episode. De-duplicated on `episode_id`."""

    episode_id: str
    job_id: str
    group_id: str
    sample_index: int
    group_size: int
    token_ids: list[int]
    loss_mask: list[int]
    """1 where the policy sampled the token; 0 for prompt, tool and observation tokens."""
    behaviour_logprobs: list[float]
    """Sampler logprob aligned with token_ids (0.0 where loss_mask is 0)."""
    reward: float
    reward_components: dict[str, float] = {}
    adapter_versions: list[int] = []
    """Adapter version of each sampled turn, in turn order."""
    error: str = ""
    """Why the reward could not be computed: recorded, never silently scored 0."""
    finished_at: float = 0.0

    DEDUP_FIELD = "episode_id"
    KEY_FIELD = "job_id"


# --- marlaas.adapters -----------------------------------------------------------------


class AdapterUpdate(_Wire, tag="adapter_update"):
    """trainer_svc -> rollout_svc, env_svc: a new adapter version is durable.

    De-duplicated on job@version. Its first four fields are an `AdapterRef`'s
    (common/wire/adapters.py), flat on the wire: `ref` and `of` convert.
    """

    job_id: str
    version: int
    uri: str
    """Where the PEFT adapter directory lies in the artifact store."""
    step: int
    metrics: dict[str, float] = {}
    published_at: float = 0.0

    KEY_FIELD = "job_id"

    @property
    def dedup_id(self) -> str:  # a version is published once per job
        return f"{self.job_id}@v{self.version}"

    @property
    def ref(self) -> AdapterRef:
        """The adapter version this update announces."""
        return AdapterRef(self.job_id, self.version, self.uri, self.step)

    @classmethod
    def of(
        cls,
        ref: AdapterRef,
        *,
        metrics: dict[str, float] | None = None,
        published_at: float = 0.0,
    ) -> AdapterUpdate:
        """The announcement of `ref`, with its step's metrics."""
        return cls(
            job_id=ref.job_id,
            version=ref.version,
            uri=ref.uri,
            step=ref.step,
            metrics=metrics or {},
            published_at=published_at,
        )


# --- marlaas.control -----------------------------------------------------------------

DropKind = Literal["dropped_stale", "dropped_invalid", "dropped_uniform"]


class GroupDropped(_Wire, tag="group_dropped"):
    """trainer_svc -> env_svc: a group will never be trained; issue a replacement.

    The flow-control window counts it out (`flow:{job}.dropped_groups`) before this is sent.
    De-duplicated on `group_id`: a group is dropped at most once.
    """

    job_id: str
    group_id: str
    verdict: DropKind
    """Why: too stale to train, too few rewarded trajectories to compare, or rewards all
    equal in a job that resamples such groups (`RLSettings.resample_uniform_groups`)."""
    reason: str = ""
    dropped_at: float = 0.0

    DEDUP_FIELD = "group_id"
    KEY_FIELD = "job_id"


# --- marlaas.events -------------------------------------------------------------------

EventKind = Literal[
    "accepted",
    "rejected",
    "step",
    "dropped_stale",
    "dropped_invalid",
    "dropped_uniform",
    "paused",
    "resumed",
    "cancelled",
    "completed",
    "failed",
    "eval",
]


class Event(_Wire, tag="event"):
    """every service -> CLI, dashboards: a job's lifecycle and metrics. De-dup on `event_id`."""

    event_id: str
    job_id: str
    event: EventKind
    service: str
    tenant: str = ""
    step: int = 0
    reason: str = ""
    metrics: dict[str, float] = {}
    at: float = 0.0
    groups: list[str] = []
    """`step`: the ids of the groups that version trained (the audit ledger has them too)."""

    DEDUP_FIELD = "event_id"
    KEY_FIELD = "job_id"


# --- marlaas.dlq ----------------------------------------------------------------------


class DeadLetter(_Wire, tag="dead_letter"):
    """every service -> operators: a record that could not be decoded or processed."""

    source_topic: str
    source_partition: int
    source_offset: int
    source_key: bytes | None
    raw_value: bytes
    error: str
    service: str
    at: float = 0.0

    KEY_FIELD = "source_key"

    @property
    def dedup_id(self) -> str:  # one letter per source record
        return f"{self.source_topic}/{self.source_partition}/{self.source_offset}"


Message = (
    JobSpec
    | JobCommand
    | GenerationRequest
    | GenerationResult
    | Trajectory
    | AdapterUpdate
    | Event
    | GroupDropped
    | DeadLetter
)

TOPIC_MESSAGES: dict[Topic, Any] = {
    Topic.JOBS: JobSpec | JobCommand,
    Topic.PROMPTS: GenerationRequest,
    Topic.ROLLOUTS: GenerationResult,
    Topic.TRAJECTORIES: Trajectory,
    Topic.ADAPTERS: AdapterUpdate,
    Topic.EVENTS: Event,
    Topic.CONTROL: GroupDropped,
    Topic.DLQ: DeadLetter,
}
"""Which message types a topic may carry; producing anything else is a bug."""


def job_event(
    job_id: str,
    event: EventKind,
    service: str,
    *,
    tenant: str = "",
    step: int = 0,
    reason: str = "",
    metrics: dict[str, float] | None = None,
    groups: list[str] | None = None,
) -> Event:
    """An `Event` stamped with a fresh id and the current time."""
    return Event(
        event_id=new_id(),
        job_id=job_id,
        event=event,
        service=service,
        tenant=tenant,
        step=step,
        reason=clipped(reason),
        metrics=metrics or {},
        at=time.time(),
        groups=groups or [],
    )
