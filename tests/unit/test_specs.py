"""A registered spec is decoded once per process (common/state/specs.py), whoever reads it."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from common.state.specs import DecodedSpecs
from common.wire.codec import encode
from common.wire.messages import EnvSettings, JobSpec
from tests.fakes import memory_store


def spec(job_id: str, env: str = "arithmetic") -> JobSpec:
    return JobSpec(job_id=job_id, tenant="acme", base_model="tiny", env=EnvSettings(name=env))


def decodes() -> float:
    return REGISTRY.get_sample_value("marlaas_job_spec_decodes_total") or 0.0


def test_the_same_bytes_are_decoded_once_and_other_bytes_anew() -> None:
    specs, before = DecodedSpecs(), decodes()
    first = specs.spec("j", encode(spec("j")))
    assert specs.spec("j", encode(spec("j"))) is first
    assert decodes() - before == 1
    reused = specs.spec("j", encode(spec("j", "countdown")))  # the id came back, another spec
    assert reused.env.name == "countdown" and decodes() - before == 2


def test_the_least_recently_read_specs_leave_past_the_capacity() -> None:
    specs, before = DecodedSpecs(capacity=2), decodes()
    for job_id in ("a", "b", "a", "c"):  # "b" is the least recently read when "c" comes
        specs.spec(job_id, encode(spec(job_id)))
    assert decodes() - before == 3
    specs.spec("a", encode(spec("a")))
    assert decodes() - before == 3
    specs.spec("b", encode(spec("b")))
    assert decodes() - before == 4


def test_a_record_not_holding_a_spec_is_refused() -> None:
    from common.wire.messages import JobCommand

    with pytest.raises(TypeError, match="not a JobSpec"):
        DecodedSpecs().spec("j", encode(JobCommand(command_id="c", job_id="j", action="pause")))


async def test_a_store_reads_a_job_many_times_and_decodes_its_spec_once() -> None:
    store = memory_store()
    try:
        await store.jobs.register(spec("j"), "running")
        before = decodes()
        records = [await store.jobs.get("j") for _ in range(50)]
        assert {r.status for r in records if r is not None} == {"running"}
        assert decodes() - before == 1
    finally:
        await store.close()
