"""Wire schema 1: messages as positional msgpack arrays (`[kind, field..., schema]`), the
layout of builds before schema 2. Read always, written only when `MARLAAS_WIRE_SCHEMA=1`
(while readers of such a build are still running during a rolling upgrade).

The layouts are frozen here as they were: a field added to a message since is not part of
them and takes its default when a schema-1 record is read.
"""

from __future__ import annotations

import operator
from functools import reduce
from typing import Any

import msgspec

from common.messages import TOPIC_MESSAGES, Message, MessageDecodeError, Topic

FIELDS: dict[str, tuple[str, ...]] = {
    "job_spec": ("job_id", "tenant", "base_model", "env", "lora", "rl", "submitted_at"),
    "job_command": ("command_id", "job_id", "action", "issued_at"),
    "generation_request": (
        "request_id", "job_id", "episode_id", "group_id", "sample_index", "turn",
        "context_token_ids", "sampling", "env_state", "issued_at", "min_adapter_version",
    ),
    "generation_result": (
        "request_id", "job_id", "episode_id", "group_id", "sample_index", "turn",
        "context_token_ids", "completion_token_ids", "logprobs", "adapter_version",
        "finish_reason", "env_state", "queue_s", "generate_s",
    ),
    "trajectory": (
        "episode_id", "job_id", "group_id", "sample_index", "group_size", "token_ids",
        "loss_mask", "behaviour_logprobs", "reward", "reward_components", "adapter_versions",
        "error", "finished_at",
    ),
    "adapter_update": ("job_id", "version", "uri", "step", "metrics", "published_at"),
    "group_dropped": ("job_id", "group_id", "verdict", "reason", "dropped_at"),
    "event": (
        "event_id", "job_id", "event", "service", "tenant", "step", "reason", "metrics", "at",
        "groups",
    ),
    "dead_letter": (
        "source_topic", "source_partition", "source_offset", "source_key", "raw_value",
        "error", "service", "at",
    ),
}  # fmt: skip
"""Each message's fields in schema-1 order (the `schema` field followed them)."""


def _layout(kind: type[Message]) -> type[msgspec.Struct]:
    tag = kind.__struct_config__.tag
    infos = {info.name: info for info in msgspec.structs.fields(kind)}
    fields: list[Any] = []
    for name in FIELDS[str(tag)]:
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


_LAYOUTS: dict[type[Message], type[msgspec.Struct]] = {
    kind: _layout(kind) for union in TOPIC_MESSAGES.values() for kind in _kinds(union)
}
_CURRENT = {layout: kind for kind, layout in _LAYOUTS.items()}
_DECODERS = {
    topic: msgspec.msgpack.Decoder(reduce(operator.or_, (_LAYOUTS[k] for k in _kinds(union))))
    for topic, union in TOPIC_MESSAGES.items()
}


def decode(topic: Topic, raw: bytes) -> Message:
    """A schema-1 record of `topic` as today's message (schema 1, later fields defaulted)."""
    try:
        old = _DECODERS[topic].decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageDecodeError(topic.value, f"schema 1: {exc}") from None
    kind = _CURRENT[type(old)]
    values = {name: getattr(old, name) for name in FIELDS[str(kind.__struct_config__.tag)]}
    message: Message = kind(**values, schema=1)
    return message


def to_v1(message: Message) -> msgspec.Struct:
    """`message` in its schema-1 layout (fields added since are left out)."""
    layout = _LAYOUTS[type(message)]
    names = FIELDS[str(type(message).__struct_config__.tag)]
    return layout(**{name: getattr(message, name) for name in names}, schema=1)
