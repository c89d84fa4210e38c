"""common.wire.messages: every payload round-trips, and bad bytes fail with one typed error."""

from __future__ import annotations

from typing import Any

import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.wire.codec import decode, encode, key_bytes, topic_of
from common.wire.messages import (
    SCHEMA_VERSION,
    TOPIC_MESSAGES,
    AdapterUpdate,
    DeadLetter,
    EnvSettings,
    Event,
    GenerationRequest,
    GenerationResult,
    GroupDropped,
    JobCommand,
    JobSpec,
    MessageDecodeError,
    SamplingSettings,
    Topic,
    Trajectory,
)

ALL_MESSAGES = [
    JobSpec,
    JobCommand,
    GenerationRequest,
    GenerationResult,
    Trajectory,
    AdapterUpdate,
    Event,
    GroupDropped,
    DeadLetter,
]

_text = st.text(max_size=12)
_float = st.floats(allow_nan=False, allow_infinity=False, width=64)


def strategy_for(info: mi.Type) -> st.SearchStrategy[Any]:
    """A hypothesis strategy for any msgspec type, derived from its schema."""
    match info:
        case mi.IntType(ge=ge, gt=gt, le=le, lt=lt):  # within the field's declared bounds
            first = ge if ge is not None else gt + 1 if gt is not None else -(2**40)
            last = le if le is not None else lt - 1 if lt is not None else 2**40
            return st.integers(first, last)
        case mi.FloatType(ge=ge, gt=gt, le=le, lt=lt):
            low, high = ge if ge is not None else gt, le if le is not None else lt
            if low is None and high is None:
                return _float
            return st.floats(
                min_value=low,
                max_value=high,
                exclude_min=gt is not None,
                exclude_max=lt is not None,
                allow_nan=False,
                allow_infinity=False,
            )
        case mi.StrType(min_length=low, max_length=high):  # within its declared length
            return st.text(min_size=low or 0, max_size=min(high or 12, 12))
        case mi.Metadata(type=inner):  # a description around a type
            return strategy_for(inner)
        case mi.BoolType():
            return st.booleans()
        case mi.BytesType():
            return st.binary(max_size=32)
        case mi.NoneType():
            return st.none()
        case mi.AnyType():
            return st.one_of(st.integers(-1000, 1000), _text, st.booleans())
        case mi.LiteralType(values=values):
            return st.sampled_from(values)
        case mi.ListType(item_type=item, min_length=low, max_length=high):
            return st.lists(strategy_for(item), min_size=low or 0, max_size=min(high or 8, 8))
        case mi.DictType(key_type=key, value_type=value):
            return st.dictionaries(strategy_for(key), strategy_for(value), max_size=4)
        case mi.UnionType(types=types):
            return st.one_of(*(strategy_for(t) for t in types))
        case mi.StructType(cls=cls, fields=fields):
            # Every message this build writes carries its own schema version.
            strategies = {
                f.name: st.just(SCHEMA_VERSION) if f.name == "schema" else strategy_for(f.type)
                for f in fields
            }
            return st.builds(cls, **strategies)
    raise TypeError(f"no strategy for {info!r}")


def message_strategy(cls: type) -> st.SearchStrategy[Any]:
    return strategy_for(mi.type_info(cls))


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_message_round_trips_on_its_topic(cls: type, data: st.DataObject) -> None:
    message = data.draw(message_strategy(cls))
    topic = topic_of(message)
    assert decode(topic, encode(message)) == message
    assert message.schema == SCHEMA_VERSION


def test_every_topic_has_a_message_and_every_message_a_topic() -> None:
    assert set(TOPIC_MESSAGES) == set(Topic)
    covered = {t for kind in TOPIC_MESSAGES.values() for t in getattr(kind, "__args__", (kind,))}
    assert covered == set(ALL_MESSAGES)


def test_messages_carry_their_dedup_id_and_key() -> None:
    spec = JobSpec(job_id="j1", tenant="acme", base_model="m", env=EnvSettings(name="arithmetic"))
    request = GenerationRequest(
        request_id="r1",
        job_id="j1",
        episode_id="e1",
        group_id="g1",
        sample_index=0,
        turn=0,
        context_token_ids=[1, 2],
        sampling=SamplingSettings(),
    )
    update = AdapterUpdate(job_id="j1", version=3, uri="file:///a", step=3)
    assert (spec.dedup_id, key_bytes(spec)) == ("j1", b"j1")
    assert (request.dedup_id, key_bytes(request)) == ("r1", b"e1")  # keyed by episode
    assert (update.dedup_id, key_bytes(update)) == ("j1@v3", b"j1")
    assert topic_of(request) is Topic.PROMPTS


def test_jobs_topic_tells_specs_from_commands() -> None:
    command = JobCommand(command_id="c1", job_id="j1", action="pause")
    decoded = decode(Topic.JOBS, encode(command))
    assert isinstance(decoded, JobCommand) and decoded.action == "pause"


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x00\xff garbage",
        b"\x93\x01\x02\x03",
        encode(Event(event_id="e", job_id="j", event="step", service="trainer")),
    ],
    ids=["empty", "garbage", "wrong-array", "message-of-another-topic"],
)
def test_bad_bytes_raise_one_typed_error(raw: bytes) -> None:
    with pytest.raises(MessageDecodeError) as info:
        decode(Topic.TRAJECTORIES, raw)
    assert info.value.topic == Topic.TRAJECTORIES
    assert "marlaas.trajectories" in str(info.value)


def test_tombstone_and_unknown_topic_are_decode_errors() -> None:
    with pytest.raises(MessageDecodeError, match="tombstone"):
        decode(Topic.JOBS, None)
    with pytest.raises(MessageDecodeError, match="not a marlaas topic"):
        decode("other.topic", b"\x90")


def test_invalid_field_values_are_rejected() -> None:
    good = JobCommand(command_id="c1", job_id="j1", action="cancel")
    raw = encode(good).replace(b"cancel", b"cancul")
    with pytest.raises(MessageDecodeError, match="cancul"):
        decode(Topic.JOBS, raw)


def test_defaults_are_omitted_on_the_wire() -> None:
    bare = AdapterUpdate(job_id="j1", version=1, uri="u", step=1)
    with_metrics = AdapterUpdate(job_id="j1", version=1, uri="u", step=1, metrics={"loss": 0.5})
    assert len(encode(bare)) < len(encode(with_metrics))


def test_a_dead_letter_always_fits_under_the_record_limit() -> None:
    from common.wire.codec import MAX_RECORD_BYTES, dead_letter, encode

    huge = b"x" * (2 * MAX_RECORD_BYTES)
    letter = dead_letter(
        source_topic="marlaas.jobs",
        source_partition=3,
        source_offset=7,
        source_key=b"k",
        raw_value=huge,
        error="boom " * 10_000,
        service="env_svc",
    )
    assert len(encode(letter)) < MAX_RECORD_BYTES
    assert letter.raw_value == huge[: len(letter.raw_value)]
    assert f"raw value cut from {len(huge)} to" in letter.error
    small = dead_letter(
        source_topic="marlaas.jobs",
        source_partition=0,
        source_offset=0,
        source_key=None,
        raw_value=b"abc",
        error="bad",
        service="env_svc",
    )
    assert (small.raw_value, small.error) == (b"abc", "bad")


def test_every_message_names_its_key_and_dedup_fields() -> None:
    """Declared once per class: the key field is a field, and the de-dup id is a field unless
    the class computes it."""
    import msgspec

    from common.wire.messages import TOPIC_MESSAGES

    kinds = {k for union in TOPIC_MESSAGES.values() for k in getattr(union, "__args__", (union,))}
    assert len(kinds) == 9
    for kind in kinds:
        names = {field.name for field in msgspec.structs.fields(kind)}
        assert kind.KEY_FIELD in names, kind
        computed = "dedup_id" in vars(kind)
        assert computed or kind.DEDUP_FIELD in names, kind
