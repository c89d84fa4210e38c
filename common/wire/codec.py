"""How messages cross the wire: msgpack maps (schema >= 2), JSON objects, and the schema-1
positional layout; the JSON Schema of each topic; record keys and size limits.

The types themselves, and the rules by which they evolve, are in `common/wire/messages.py`; this
module is the only one that turns them into bytes and back (docs/architecture.md, "Topics
and messages").

Schema 1: messages as positional msgpack arrays (`[kind, field..., schema]`), the layout of
builds before schema 2. Read always, written only when `MARLAAS_WIRE_SCHEMA=1` (while readers
of such a build are still running during a rolling upgrade). Its layouts are frozen below as
they were: a field added to a message since is not part of them and takes its default when a
schema-1 record is read.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Mapping, Sequence
from functools import reduce
from typing import Any, Literal, TypeVar

import msgspec

from common.wire.jobspec import is_name
from common.wire.messages import (
    SCHEMA_VERSION,
    TOPIC_MESSAGES,
    DeadLetter,
    Message,
    MessageDecodeError,
    Topic,
)

MAX_RECORD_BYTES = 1_048_576
"""The largest record a producer sends: Kafka's default broker limit (`message.max.bytes`),
so an oversized message fails at once in the sender, as a non-retriable error."""
MAX_DEAD_LETTER_RAW_BYTES = 512 * 1024
"""A dead letter keeps at most this much of the record it reports, so the letter itself
always fits under MAX_RECORD_BYTES: a letter that could never be written would stop its
partition."""


class RecordTooLargeError(ValueError):
    """A record over `MAX_RECORD_BYTES`, which the broker would refuse: the sender's error
    (an episode's, a job's), never retried as a broker away would be."""


def fits_record(topic: str, value: bytes) -> bytes:
    """`value`, checked to fit in a record before it is sent."""
    if len(value) > MAX_RECORD_BYTES:
        raise RecordTooLargeError(
            f"a {topic} record of {len(value)} bytes is over the {MAX_RECORD_BYTES}-byte limit"
        )
    return value


TOO_DEEP = "nested too deeply (maps or lists inside each other past the decoder's stack)"


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
        source_topic=source_topic,
        source_partition=source_partition,
        source_offset=source_offset,
        source_key=source_key,
        raw_value=raw_value,
        error=error[-16_384:],
        service=service,
        at=time.time(),
    )


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
        return _encoder.encode(_to_v1(message))
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
            _fits_msgpack(topic, message)
        elif raw[:1] and raw[0] in _ARRAY_MARKERS:
            return _decode_v1(known, raw)
        else:
            message = _decoders[known].decode(raw)
            generic = msgspec.msgpack.decode(raw) if known is Topic.JOBS else None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageDecodeError(topic, str(exc)) from None
    except RecursionError:
        raise MessageDecodeError(topic, TOO_DEEP) from None
    if generic is not None and message.schema <= SCHEMA_VERSION:
        # A job of this schema or older with a field this build does not know: a typo in
        # hand-written JSON, never a newer writer's field.
        if unknown := unknown_fields(generic, type(message)):
            raise MessageDecodeError(topic, f"{unknown[0]}: unknown field")
    return message


def _fits_msgpack(topic: str, message: Message) -> None:
    """JSON numbers have no bound; msgpack's integers are 64-bit. A JSON record with a larger
    one (a seed, an environment param) is refused here, where it arrives, rather than failing
    when it is forwarded."""
    try:
        _encoder.encode(message)
    except OverflowError:
        raise MessageDecodeError(
            topic, "an integer is out of range: numbers must fit in 64 bits"
        ) from None


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
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("kind") != "job_spec":
        return None
    job_id, tenant = data.get("job_id"), data.get("tenant", "")
    if not isinstance(job_id, str) or not is_name(job_id):
        return None  # nothing to key a rejection by: the dead letter says what came
    return job_id, tenant if isinstance(tenant, str) and is_name(tenant) else ""


def unknown_fields(data: Any, kind: type[msgspec.Struct], at: str = "") -> list[str]:
    """Dotted paths of the keys in `data` (a decoded map) that `kind` and its nested
    structs do not have; the tag field counts as known."""
    if not isinstance(data, dict):
        return []
    fields, tag_field = _fields_of(kind)
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


@functools.cache
def _fields_of(kind: type[msgspec.Struct]) -> tuple[dict[str, Any], str | None]:
    """`kind`'s fields by wire name, and its tag field: read once per type (msgspec resolves
    the type annotations on every call, a cost that showed on every record env_svc handled)."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(kind)}
    return fields, kind.__struct_config__.tag_field


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


# --- schema 1 ------------------------------------------------------------------------------

# A generation request's ids and context, which its result echoes first.
_V1_TURN = (
    "request_id",
    "job_id",
    "episode_id",
    "group_id",
    "sample_index",
    "turn",
    "context_token_ids",
)
_V1_FIELDS: dict[str, tuple[str, ...]] = {
    "job_spec": ("job_id", "tenant", "base_model", "env", "lora", "rl", "submitted_at"),
    "job_command": ("command_id", "job_id", "action", "issued_at"),
    "generation_request": (
        *_V1_TURN,
        "sampling",
        "env_state",
        "issued_at",
        "min_adapter_version",
    ),
    "generation_result": (
        *_V1_TURN,
        "completion_token_ids",
        "logprobs",
        "adapter_version",
        "finish_reason",
        "env_state",
        "queue_s",
        "generate_s",
    ),
    "trajectory": (
        "episode_id",
        "job_id",
        "group_id",
        "sample_index",
        "group_size",
        "token_ids",
        "loss_mask",
        "behaviour_logprobs",
        "reward",
        "reward_components",
        "adapter_versions",
        "error",
        "finished_at",
    ),
    "adapter_update": ("job_id", "version", "uri", "step", "metrics", "published_at"),
    "group_dropped": ("job_id", "group_id", "verdict", "reason", "dropped_at"),
    "event": (
        "event_id",
        "job_id",
        "event",
        "service",
        "tenant",
        "step",
        "reason",
        "metrics",
        "at",
        "groups",
    ),
    "dead_letter": (
        "source_topic",
        "source_partition",
        "source_offset",
        "source_key",
        "raw_value",
        "error",
        "service",
        "at",
    ),
}
"""Each message's fields in schema-1 order (the `schema` field followed them)."""
_V1_NESTED_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("job_spec", "rl"): {
        "score_cut_off": False,
        "resample_uniform_groups": 0,
        "lr_schedule": "constant",
        "warmup_steps": 0,
    },
    ("job_spec", "rl.sampling"): {"seed": None},
    ("generation_request", "sampling"): {"seed": None},
}
"""Fields added since schema 1 inside a message's settings blocks (a dotted path reaches into
a nested one), at their defaults (which are not written): how a schema-1 record leaves them
out."""


def _v1_layout(kind: type[Message]) -> type[msgspec.Struct]:
    tag = kind.__struct_config__.tag
    infos = {info.name: info for info in msgspec.structs.fields(kind)}
    fields: list[Any] = []
    for name in _V1_FIELDS[str(tag)]:
        info = infos[name]
        if info.default is not msgspec.NODEFAULT:
            fields.append((name, info.type, info.default))
        elif info.default_factory is not msgspec.NODEFAULT:
            fields.append((name, info.type, msgspec.field(default_factory=info.default_factory)))
        else:
            fields.append((name, info.type))
    fields.append(("schema", int, 1))
    return msgspec.defstruct(
        f"{kind.__name__}V1", fields, array_like=True, kw_only=True, tag_field="kind", tag=tag
    )


def _kinds(union: Any) -> tuple[type[Message], ...]:
    return tuple(getattr(union, "__args__", (union,)))


_V1_LAYOUTS: dict[type[Message], type[msgspec.Struct]] = {
    kind: _v1_layout(kind) for union in TOPIC_MESSAGES.values() for kind in _kinds(union)
}
_V1_CURRENT = {layout: kind for kind, layout in _V1_LAYOUTS.items()}
_V1_DECODERS = {
    topic: msgspec.msgpack.Decoder(reduce(operator.or_, (_V1_LAYOUTS[k] for k in _kinds(union))))
    for topic, union in TOPIC_MESSAGES.items()
}


def _decode_v1(topic: Topic, raw: bytes) -> Message:
    """A schema-1 record of `topic` as today's message (schema 1, later fields defaulted)."""
    try:
        old = _V1_DECODERS[topic].decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageDecodeError(topic.value, f"schema 1: {exc}") from None
    kind = _V1_CURRENT[type(old)]
    values = {name: getattr(old, name) for name in _V1_FIELDS[str(kind.__struct_config__.tag)]}
    message: Message = kind(**values, schema=1)
    return message


def _to_v1(message: Message) -> msgspec.Struct:
    """`message` in its schema-1 layout (fields added since are left out)."""
    layout = _V1_LAYOUTS[type(message)]
    tag = str(type(message).__struct_config__.tag)
    values = {name: getattr(message, name) for name in _V1_FIELDS[tag]}
    blocks = set()
    for (kind, path), defaults in _V1_NESTED_DEFAULTS.items():
        if kind == tag:
            head, *rest = path.split(".")
            values[head] = replaced_at(values[head], rest, defaults)
            blocks.add(head)
    # As plain maps of the fields not at their defaults: msgspec sizes a struct's map header
    # by its field count (a map16 header from 16 fields on, however many are written), and
    # schema 1 wrote the fewer fields of its day.
    values |= {head: msgspec.to_builtins(values[head]) for head in blocks}
    return layout(**values, schema=1)


S = TypeVar("S", bound=msgspec.Struct)


def replaced_at(block: S, path: Sequence[str], fields: Mapping[str, Any]) -> S:
    """`block` with `fields` set in its nested block at `path` ([]: in itself)."""
    if not path:
        return msgspec.structs.replace(block, **fields)
    head, *rest = path
    return msgspec.structs.replace(block, **{head: replaced_at(getattr(block, head), rest, fields)})
