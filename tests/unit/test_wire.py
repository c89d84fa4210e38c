"""Wire compatibility: every message type read across builds, both ways.

- schema-1 bytes (positional arrays, committed under tests/golden/wire-v1 from the build
  before schema 2) are read by this build, and written byte for byte with `wire_schema=1`;
- schema-2 to schema-7 bytes (maps, tests/golden/wire-v2 to wire-v7) are read, the fields
  added since at their defaults;
- this build's bytes (tests/golden/wire-v8) do not drift;
- a message with a field appended (the next build) is read by this build, and this
  build's message by the next build, for every message type;
- JSON objects of the same shape are read; in a job of this schema unknown fields are
  typos and refused, in a newer writer's they are ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from common.wire.codec import decode, encode, json_schema, topic_of
from common.wire.messages import (
    SCHEMA_VERSION,
    JobCommand,
    JobSpec,
    LoraSettings,
    Message,
    MessageDecodeError,
    RLSettings,
    Topic,
)
from tests.wire_samples import SAMPLES, as_read_from, readme_json_job

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
KINDS = sorted(SAMPLES)


def golden(schema: int, kind: str) -> bytes:
    return (GOLDEN / f"wire-v{schema}" / f"{kind}.msgpack").read_bytes()


@pytest.mark.parametrize("schema", [1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("kind", KINDS)
def test_older_schemas_bytes_are_read_as_the_same_message(kind: str, schema: int) -> None:
    read = decode(topic_of(SAMPLES[kind]), golden(schema, kind))
    assert read == as_read_from(schema, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_schema_1_is_written_byte_for_byte_for_old_readers(kind: str) -> None:
    assert encode(SAMPLES[kind], schema=1) == golden(1, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_this_builds_bytes_do_not_drift(kind: str) -> None:
    """A change here breaks readers already deployed: add fields instead (module docs)."""
    sample = SAMPLES[kind]
    assert encode(sample) == golden(SCHEMA_VERSION, kind)
    assert decode(topic_of(sample), golden(SCHEMA_VERSION, kind)) == sample


def next_build(kind: type[Message]) -> type[msgspec.Struct]:
    """`kind` as a later build defines it: the same tag and fields, one appended with a
    default."""
    config = kind.__struct_config__
    return msgspec.defstruct(
        kind.__name__,
        [("added_later", list[str], msgspec.field(default_factory=list))],
        bases=(kind,),
        tag=config.tag,
        tag_field=config.tag_field,
        kw_only=True,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_this_build_reads_a_later_builds_message(kind: str) -> None:
    sample = SAMPLES[kind]
    newer = next_build(type(sample))
    fields = msgspec.structs.asdict(sample)
    message = newer(**fields | {"schema": SCHEMA_VERSION + 1, "added_later": ["x"]})
    read = decode(topic_of(sample), msgspec.msgpack.encode(message))
    assert type(read) is type(sample)
    assert read == msgspec.structs.replace(sample, schema=SCHEMA_VERSION + 1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_later_build_reads_this_builds_message(kind: str) -> None:
    sample = SAMPLES[kind]
    newer = next_build(type(sample))
    read: Any = msgspec.msgpack.decode(encode(sample), type=newer)
    assert read.added_later == []
    assert all(getattr(read, f) == getattr(sample, f) for f in sample.__struct_fields__)


@pytest.mark.parametrize("kind", KINDS)
def test_json_of_the_same_shape_is_read(kind: str) -> None:
    sample = SAMPLES[kind]
    assert decode(topic_of(sample), msgspec.json.encode(sample)) == sample


def test_a_hand_written_json_job_is_read_with_defaults() -> None:
    raw = b"""{"kind": "job_spec", "job_id": "acme-add-1", "tenant": "acme",
        "base_model": "smollm2-135m-instruct", "env": {"name": "arithmetic"},
        "rl": {"max_steps": 3}}"""
    spec = decode(Topic.JOBS, raw)
    assert isinstance(spec, JobSpec) and spec.schema == SCHEMA_VERSION
    assert spec.rl == RLSettings(max_steps=3) and spec.lora == LoraSettings()


@pytest.mark.parametrize(
    "raw, where",
    [
        (
            b'{"kind": "job_command", "command_id": "c", "job_id": "j", "action": "pause",'
            b' "colour": "red"}',
            "colour",
        ),
        (
            b'{"kind": "job_spec", "job_id": "j", "tenant": "t", "base_model": "m",'
            b' "env": {"name": "arithmetic"}, "rl": {"sampling": {"topk": 5}}}',
            "rl.sampling.topk",
        ),
    ],
    ids=["top-level", "nested"],
)
def test_an_unknown_field_in_a_job_of_this_schema_is_refused(raw: bytes, where: str) -> None:
    with pytest.raises(MessageDecodeError, match=f"{where}: unknown field"):
        decode(Topic.JOBS, raw)


def test_unknown_fields_of_a_newer_writer_are_ignored_in_a_job() -> None:
    command = msgspec.json.encode(
        {
            "kind": "job_command",
            "command_id": "c",
            "job_id": "j",
            "action": "pause",
            "priority": 3,
            "schema": SCHEMA_VERSION + 1,
        }
    )
    assert decode(Topic.JOBS, command) == JobCommand(
        command_id="c", job_id="j", action="pause", schema=SCHEMA_VERSION + 1
    )
    fields = msgspec.to_builtins(SAMPLES["job_spec"])
    fields["rl"]["sampling"]["min_p"] = 0.05  # a setting added by a later build
    fields["schema"] = SCHEMA_VERSION + 1
    spec = decode(Topic.JOBS, msgspec.msgpack.encode(fields))
    assert spec == msgspec.structs.replace(SAMPLES["job_spec"], schema=SCHEMA_VERSION + 1)


def test_the_committed_json_schema_is_this_builds_and_checks_the_readme_job() -> None:
    import json

    import jsonschema

    root = Path(__file__).resolve().parents[2]
    committed = json.loads((root / "schemas" / "marlaas.jobs.schema.json").read_text())
    assert committed == json_schema(Topic.JOBS), (
        "run: marlaas schema > schemas/marlaas.jobs.schema.json"
    )
    job = json.loads(readme_json_job()[0])
    validator = jsonschema.Draft202012Validator(committed)
    validator.validate(job)
    job["rl"]["max_step"] = 2
    assert not validator.is_valid(job)


@pytest.mark.parametrize("where", ["env.seed", "eval.seed", "env.params"])
def test_a_json_job_with_an_integer_msgpack_cannot_hold_is_refused(where: str) -> None:
    """Found by the API fuzz: a 2**70 in a JSON job decoded, then failed to encode (a 500)."""
    job: dict[str, Any] = {"kind": "job_spec", "job_id": "j", "tenant": "acme"}
    job["env"] = {"name": "arithmetic"}
    huge = 2**70
    if where == "env.seed":
        job["env"]["seed"] = huge
    elif where == "eval.seed":
        job["eval"] = {"seed": huge}
    else:
        job["env"]["params"] = {"min_operand": huge}
    with pytest.raises(MessageDecodeError, match="out of range"):
        decode(Topic.JOBS, msgspec.json.encode(job))
