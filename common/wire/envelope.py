"""What every message carries and what every reader of the wire shares: the schema version
this build writes, the topics, ids, clipped reasons, decode errors, and the base structs of
messages (`_Wire`) and of their nested settings blocks (`_Part`).

The messages themselves and the rules of their evolution are common/wire/messages.py.
"""

from __future__ import annotations

import uuid
from enum import StrEnum
from typing import ClassVar

import msgspec

SCHEMA_VERSION = 8
"""The wire schema this build writes: 1 positional arrays; 2 maps keyed by field name; 3 adds
`JobSpec.eval` and `GenerationRequest.pinned_adapter_version`; 4 adds
`GenerationRequest.tenant`; 5 adds `RLSettings.score_cut_off`; 6 adds
`RLSettings.resample_uniform_groups` (and with it the drop kind and event
`dropped_uniform`); 7 adds `SamplingSettings.seed`; 8 adds `RLSettings.lr_schedule` and
`RLSettings.warmup_steps`. Up by one with every field added to any message."""


class Topic(StrEnum):
    JOBS = "marlaas.jobs"
    PROMPTS = "marlaas.prompts"
    ROLLOUTS = "marlaas.rollouts"
    TRAJECTORIES = "marlaas.trajectories"
    ADAPTERS = "marlaas.adapters"
    EVENTS = "marlaas.events"
    CONTROL = "marlaas.control"
    DLQ = "marlaas.dlq"


def new_id() -> str:
    """A random id, unique enough to de-duplicate on."""
    return uuid.uuid4().hex


MAX_REASON_CHARS = 1000
"""Longest reason kept or sent (a rejection, a dead letter): a reason may quote what came,
a field name of any length, and is stored for days."""


def clipped(reason: str, limit: int = MAX_REASON_CHARS) -> str:
    """`reason`, cut to `limit` characters with the cut said."""
    return reason if len(reason) <= limit else f"{reason[: limit - 20]}... ({len(reason)} chars)"


class MessageDecodeError(ValueError):
    """Bytes on a topic that are not a valid message of that topic."""

    def __init__(self, topic: str, reason: str) -> None:
        reason = clipped(reason)
        super().__init__(f"cannot decode message on {topic}: {reason}")
        self.topic = topic
        self.reason = reason


class ContextTooLongError(ValueError):
    """A generation context that leaves no room to sample within a length limit: the job's
    `max_context_tokens` (env_svc, at submission) or the engine's `max_model_len` (rollout_svc).
    """


class _Wire(msgspec.Struct, omit_defaults=True, kw_only=True, tag_field="kind"):
    """Base of every message; `kind` (the tag) tells apart messages sharing a topic. Fields
    left at their default are not written; `schema` always is (a record without one, e.g.
    a hand-written JSON job, is read as this build's)."""

    schema: int = msgspec.field(default_factory=lambda: SCHEMA_VERSION)

    DEDUP_FIELD: ClassVar[str]
    """The field consumers de-duplicate on (`dedup_id`); a class may compute it instead."""
    KEY_FIELD: ClassVar[str]
    """The field whose value is the record's Kafka key (`kafka_key`): its partition."""

    @property
    def dedup_id(self) -> str:
        return str(getattr(self, self.DEDUP_FIELD))

    @property
    def kafka_key(self) -> str | bytes | None:
        value: str | bytes | None = getattr(self, self.KEY_FIELD)
        return value


class _Part(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Nested settings blocks (job files and messages share their field names). Unknown
    fields are ignored on the wire, where they come from newer writers, and refused in job
    files (`unknown_fields`)."""
