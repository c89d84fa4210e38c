"""Every payload that crosses a Kafka topic, and the topic each one travels on.

This module owns the wire contract (docs/architecture.md, "Topics and messages"). Payloads
are `msgspec.Struct`s encoded as msgpack maps keyed by field name, with a `kind` tag; a
record may also be a JSON object of the same shape (jobs produced by any Kafka client).
Each carries the `schema` version of the build that wrote it and an id that consumers use
for de-duplication.

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
import uuid
from enum import StrEnum
from typing import Any, Literal

import msgspec

SCHEMA_VERSION = 3
"""The wire schema this build writes: 1 positional arrays; 2 maps keyed by field name; 3 adds
`JobSpec.eval` and `GenerationRequest.pinned_adapter_version`. Up by one with every field
added to any message."""


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


class MessageDecodeError(ValueError):
    """Bytes on a topic that are not a valid message of that topic."""

    def __init__(self, topic: str, reason: str) -> None:
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


class _Part(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Nested settings blocks (job files and messages share their field names). Unknown
    fields are ignored on the wire, where they come from newer writers, and refused in job
    files (`unknown_fields`)."""


# --- job settings (nested in JobSpec) -------------------------------------------------


class EnvSettings(_Part):
    name: str
    """Registered environment name, e.g. `arithmetic`, `calculator`, `countdown`."""
    params: dict[str, Any] = {}
    """Environment-specific parameters (operand ranges, max turns, ...); the environment
    checks them at submission, and a bad one rejects the job."""
    seed: int = 0
    """Seeds the task sampler (and the adapter's initial LoRA weights), so a job's task stream
    is reproducible."""


class LoraSettings(_Part):
    rank: int = 8
    """LoRA rank r, >= 1 and at most the deployment's `MARLAAS_MAX_LORA_RANK` (default 16);
    trainable parameters grow linearly with it."""
    alpha: int = 16
    """LoRA scaling numerator, > 0: the adapter's update is scaled by alpha / rank."""
    dropout: float = 0.0
    """LoRA dropout probability in [0, 1), passed to PEFT. The trainer keeps the model in eval
    mode, so it has no effect at present."""
    target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Names of the base model's linear modules that get an adapter (Llama-style names); at
    least one, and ones vLLM can serve LoRA on."""


class SamplingSettings(_Part):
    temperature: float = 1.0
    """Sampling temperature, > 0 (RL needs exploration); the recorded logprobs are the model's
    own, before temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]: sample only from the most likely tokens covering it;
    1 = off."""
    max_new_tokens: int = 32
    """Most tokens sampled per turn, >= 1; a turn that reaches it ends with finish reason
    `length`. Counts against `max_context_tokens`."""
    stop: list[str] = []
    """Strings that end a turn early, besides the end-of-turn token; empty = none (rollout_svc
    then skips detokenizing)."""


class RLSettings(_Part):
    group_size: int = 8
    """G, >= 2: samples per task; advantages are relative within a group."""
    groups_per_step: int = 4
    """B, >= 1: groups per optimizer step (each step trains G * B episodes)."""
    max_steps: int = 20
    """Optimizer steps (= adapter versions), >= 1, after which the job completes; also caps
    the groups ever issued at max_steps * B."""
    max_staleness: int = 1
    """S, >= 0: how many adapter versions generation may run ahead of training (0 = on-policy);
    a group sampled more than S versions behind is dropped and replaced."""
    learning_rate: float = 1e-4
    """AdamW learning rate of the job's adapter, in (0, 1); no weight decay."""
    clip_low: float = 0.2
    """PPO clip below, in [0, 1): the policy ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.28
    """PPO clip above, >= 0: the ratio is clipped at 1 + clip_high (DAPO's clip-higher when
    above clip_low: more room for unlikely tokens with a positive advantage to grow)."""
    is_cap: float = 2.0
    """Truncated importance-sampling cap, >= 1, on the weight correcting the sampler/trainer
    mismatch (staleness, kernel differences)."""
    std_normalize: bool = False
    """Divide advantages by the group's reward std (GRPO); off = Dr. GRPO."""
    max_turns: int | None = None
    """Cap on model turns per episode, >= 1; None leaves the environment's own limit."""
    max_context_tokens: int = 512
    """Longest episode context in tokens, > max_new_tokens: a prompt that leaves no room for a
    turn rejects the job, and an episode whose next turn would not fit is scored as it stands."""
    sampling: SamplingSettings = msgspec.field(default_factory=SamplingSettings)
    """How rollout_svc samples every turn of the job's episodes."""


class EvalSettings(_Part):
    tasks: int = 32
    """Held-out tasks per evaluation, 0..1024 (0 = no evaluation): one greedy episode each,
    from the environment's evaluation stream (`Environment.eval_task_for`), never trained."""
    every_steps: int = 0
    """Also evaluate every this many adapter versions, >= 0; 0 = only the base model
    (version 0) and the final adapter."""
    seed: int = 0
    """Seeds the evaluation task stream; the same seed evaluates every version on the same
    tasks."""


# --- marlaas.jobs ---------------------------------------------------------------------


class JobSpec(_Wire, tag="job_spec", kw_only=True):
    """CLI (or any Kafka client) -> env_svc: a tenant asks for an RL job. De-duplicated on
    `job_id`."""

    job_id: str
    tenant: str
    base_model: str = ""
    """The deployment's base model (its name or directory); empty: whatever it serves
    (env_svc registers the job with that filled in)."""
    env: EnvSettings
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)
    rl: RLSettings = msgspec.field(default_factory=RLSettings)
    eval: EvalSettings = msgspec.field(default_factory=EvalSettings)
    submitted_at: float = 0.0

    @property
    def dedup_id(self) -> str:
        return self.job_id

    @property
    def kafka_key(self) -> str:
        return self.job_id


JobAction = Literal["pause", "resume", "cancel"]


class JobCommand(_Wire, tag="job_command"):
    """CLI -> env_svc: change a running job's state. De-duplicated on `command_id`."""

    command_id: str
    job_id: str
    action: JobAction
    issued_at: float = 0.0

    @property
    def dedup_id(self) -> str:
        return self.command_id

    @property
    def kafka_key(self) -> str:
        return self.job_id


# --- marlaas.prompts / marlaas.rollouts -----------------------------------------------


class GenerationRequest(_Wire, tag="generation_request"):
    """env_svc -> rollout_svc: sample one turn of one episode. De-duplicated on `request_id`."""

    request_id: str
    job_id: str
    episode_id: str
    group_id: str
    sample_index: int
    turn: int
    context_token_ids: list[int]
    """The whole context so far (prompt + earlier turns + tool results), never re-tokenized."""
    sampling: SamplingSettings
    env_state: bytes = b""
    """The episode's state, opaque to rollout_svc, echoed back in the result."""
    issued_at: float = 0.0
    min_adapter_version: int = 0
    """The job's trained version when the group was issued; sampling waits for it."""
    pinned_adapter_version: int = -1
    """Sample with exactly this adapter version (0: the base model), as evaluations do; -1:
    the job's latest, at least `min_adapter_version`."""

    @property
    def dedup_id(self) -> str:
        return self.request_id

    @property
    def kafka_key(self) -> str:
        return self.episode_id


FinishReason = Literal["stop", "length", "abort"]


class GenerationResult(_Wire, tag="generation_result"):
    """rollout_svc -> env_svc: one sampled turn. De-duplicated on `request_id`."""

    request_id: str
    job_id: str
    episode_id: str
    group_id: str
    sample_index: int
    turn: int
    context_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    """Sampler logprob of each completion token (same length as completion_token_ids)."""
    adapter_version: int
    """Adapter version that produced this turn; 0 is the bare base model."""
    finish_reason: FinishReason
    env_state: bytes = b""
    queue_s: float = 0.0
    generate_s: float = 0.0

    @property
    def dedup_id(self) -> str:
        return self.request_id

    @property
    def kafka_key(self) -> str:
        return self.episode_id


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
    return GenerationResult(
        request_id=request.request_id, job_id=request.job_id, episode_id=request.episode_id,
        group_id=request.group_id, sample_index=request.sample_index, turn=request.turn,
        context_token_ids=request.context_token_ids, env_state=request.env_state,
        completion_token_ids=completion_token_ids, logprobs=logprobs,
        adapter_version=adapter_version, finish_reason=finish_reason, queue_s=queue_s,
        generate_s=generate_s,
    )  # fmt: skip


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

    @property
    def dedup_id(self) -> str:
        return self.episode_id

    @property
    def kafka_key(self) -> str:
        return self.job_id


# --- marlaas.adapters -----------------------------------------------------------------


class AdapterUpdate(_Wire, tag="adapter_update"):
    """trainer_svc -> rollout_svc, env_svc: a new adapter version is durable.

    De-duplicated on job@version.
    """

    job_id: str
    version: int
    uri: str
    """Where the PEFT adapter directory lies in the artifact store."""
    step: int
    metrics: dict[str, float] = {}
    published_at: float = 0.0

    @property
    def dedup_id(self) -> str:
        return f"{self.job_id}@v{self.version}"

    @property
    def kafka_key(self) -> str:
        return self.job_id


# --- marlaas.control -----------------------------------------------------------------

DropKind = Literal["dropped_stale", "dropped_invalid"]


class GroupDropped(_Wire, tag="group_dropped"):
    """trainer_svc -> env_svc: a group will never be trained; issue a replacement.

    The flow-control window counts it out (`flow:{job}.dropped_groups`) before this is sent.
    De-duplicated on `group_id`: a group is dropped at most once.
    """

    job_id: str
    group_id: str
    verdict: DropKind
    """Why: too stale to train, or too few rewarded trajectories to compare."""
    reason: str = ""
    dropped_at: float = 0.0

    @property
    def dedup_id(self) -> str:
        return self.group_id

    @property
    def kafka_key(self) -> str:
        return self.job_id


# --- marlaas.events -------------------------------------------------------------------

EventKind = Literal[
    "accepted",
    "rejected",
    "step",
    "dropped_stale",
    "dropped_invalid",
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

    @property
    def dedup_id(self) -> str:
        return self.event_id

    @property
    def kafka_key(self) -> str:
        return self.job_id


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

    @property
    def dedup_id(self) -> str:
        return f"{self.source_topic}/{self.source_partition}/{self.source_offset}"

    @property
    def kafka_key(self) -> bytes | None:
        return self.source_key


MAX_RECORD_BYTES = 1_048_576
"""The largest record a producer sends: Kafka's default broker limit (`message.max.bytes`),
so an oversized message fails at once in the sender, as a non-retriable error."""
MAX_DEAD_LETTER_RAW_BYTES = 512 * 1024
"""A dead letter keeps at most this much of the record it reports, so the letter itself
always fits under MAX_RECORD_BYTES: a letter that could never be written would stop its
partition."""


def dead_letter(
    *,
    source_topic: str,
    source_partition: int,
    source_offset: int,
    source_key: bytes | None,
    raw_value: bytes,
    error: str,
    service: str,
) -> DeadLetter:
    """A DeadLetter whose raw value (and error text) are cut to a size the broker takes;
    the error says when the value was cut, and from how many bytes."""
    if len(raw_value) > MAX_DEAD_LETTER_RAW_BYTES:
        error = (
            f"{error} [raw value cut from {len(raw_value)} to {MAX_DEAD_LETTER_RAW_BYTES} bytes]"
        )
        raw_value = raw_value[:MAX_DEAD_LETTER_RAW_BYTES]
    return DeadLetter(
        source_topic=source_topic, source_partition=source_partition,
        source_offset=source_offset, source_key=source_key, raw_value=raw_value,
        error=error[-16_384:], service=service, at=time.time(),
    )  # fmt: skip


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

_encoder = msgspec.msgpack.Encoder()
_decoders = {topic: msgspec.msgpack.Decoder(kind) for topic, kind in TOPIC_MESSAGES.items()}
_json_decoders = {topic: msgspec.json.Decoder(kind) for topic, kind in TOPIC_MESSAGES.items()}
_ARRAY_MARKERS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
"""First byte of a msgpack array: a schema-1 record."""

WireSchema = Literal[1, 2]


def encode(message: Message, schema: WireSchema = 2) -> bytes:
    """`message` as msgpack, in the layout of wire `schema` (1 only for readers of builds
    from before schema 2)."""
    if schema == 1:
        from common import wire_v1  # the legacy layout, built on the classes here

        return _encoder.encode(wire_v1.to_v1(message))
    return _encoder.encode(message)


def decode(topic: str, raw: bytes | None) -> Message:
    """Decode a record's value for `topic`: a msgpack map (schema >= 2), a JSON object, or a
    schema-1 msgpack array. Raises MessageDecodeError on anything invalid."""
    try:
        known = Topic(topic)
    except ValueError:
        raise MessageDecodeError(topic, "not a marlaas topic") from None
    if raw is None:
        raise MessageDecodeError(topic, "empty record (tombstone)")
    raw = bytes(raw)
    try:
        if _is_json(raw):
            message: Message = _json_decoders[known].decode(raw)
            generic = msgspec.json.decode(raw) if known is Topic.JOBS else None
        elif raw[:1] and raw[0] in _ARRAY_MARKERS:
            from common import wire_v1  # the legacy layout, built on the classes here

            return wire_v1.decode(known, raw)
        else:
            message = _decoders[known].decode(raw)
            generic = msgspec.msgpack.decode(raw) if known is Topic.JOBS else None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageDecodeError(topic, str(exc)) from None
    if generic is not None and message.schema <= SCHEMA_VERSION:
        # A job of this schema or older with a field this build does not know: a typo in
        # hand-written JSON, never a newer writer's field.
        if unknown := unknown_fields(generic, type(message)):
            raise MessageDecodeError(topic, f"{unknown[0]}: unknown field")
    return message


def _is_json(raw: bytes) -> bool:
    """A JSON object rather than msgpack (whose messages never start with `{` or a space)."""
    return raw[:1] == b"{" or (raw[:1].isspace() and raw.lstrip()[:1] == b"{")


def json_schema(topic: Topic) -> dict[str, Any]:
    """The JSON Schema of the records `topic` accepts (JSON objects; msgpack maps have the
    same shape), for producers outside MARLaaS (`marlaas schema`, schemas/)."""
    schema = msgspec.json.schema(TOPIC_MESSAGES[topic])
    for definition in schema.get("$defs", {}).values():
        if "properties" in definition:  # a field this build does not know is refused
            definition["additionalProperties"] = False
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://marlaas.dev/schemas/{topic.value}.schema.json",
        "title": f"{topic.value} record (wire schema {SCHEMA_VERSION})",
        "description": "One JSON object per Kafka record, keyed by job_id; `kind` tells the "
        "message types apart. Fields left out take their defaults. A job with a field this "
        "schema does not have is rejected.",
        **schema,
    }


def job_named_in(raw: bytes | None) -> tuple[str, str] | None:
    """(job_id, tenant) of a record that reads as a job spec map or JSON object but may not
    decode as one (a typo, a wrong type): so its sender can be told why it was refused."""
    raw = raw or b""
    try:
        data = msgspec.json.decode(raw) if _is_json(raw) else msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    if not isinstance(data, dict) or data.get("kind") != "job_spec":
        return None
    job_id, tenant = data.get("job_id"), data.get("tenant", "")
    if not isinstance(job_id, str) or not job_id:
        return None
    return job_id, tenant if isinstance(tenant, str) else ""


def unknown_fields(data: Any, kind: type[msgspec.Struct], at: str = "") -> list[str]:
    """Dotted paths of the keys in `data` (a decoded map) that `kind` and its nested
    structs do not have; the tag field counts as known."""
    if not isinstance(data, dict):
        return []
    fields = {f.encode_name: f for f in msgspec.structs.fields(kind)}
    tag_field = kind.__struct_config__.tag_field
    found = []
    for key, value in data.items():
        path = f"{at}{key}"
        if key == tag_field:
            continue
        if (info := fields.get(key)) is None:
            found.append(path)
        elif isinstance(info.type, type) and issubclass(info.type, msgspec.Struct):
            found += unknown_fields(value, info.type, f"{path}.")
    return found


def topic_of(message: Message) -> Topic:
    """The one topic a message type travels on."""
    for topic, kind in TOPIC_MESSAGES.items():
        if isinstance(message, _types_of(kind)):
            return topic
    raise TypeError(f"{type(message).__name__} belongs to no topic")


def _types_of(kind: Any) -> tuple[type, ...]:
    return tuple(getattr(kind, "__args__", (kind,)))


def key_bytes(message: Message) -> bytes | None:
    key = message.kafka_key
    return key.encode() if isinstance(key, str) else key


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
        event_id=new_id(), job_id=job_id, event=event, service=service, tenant=tenant,
        step=step, reason=reason, metrics=metrics or {}, at=time.time(), groups=groups or [],
    )  # fmt: skip
