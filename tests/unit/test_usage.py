"""Usage per tenant and job (issue 45): counted where the work happens, kept in Redis, read
back per job and per tenant, as CSV; and counted by the engine's side exactly once per
generation, as training, evaluation or chat tokens of the job they were for."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from common.state.keyspace import tenant_usage_key, usage_key
from common.state.usage import JOB_USAGE_TTL_S, UsageCounters, UsageMeter, usage_csv
from common.wire.adapters import AdapterRef
from common.wire.messages import GenerationRequest, GenerationResult, result_for
from rollout_svc.adapters import JobAdapters
from rollout_svc.jobs import JobsSeen
from tests.fakes import memory_store
from tests.handler_kit import job_spec, request_for
from trainer_svc.step import directory_bytes


async def test_counts_add_up_per_job_and_per_tenant_and_outlive_the_jobs_records() -> None:
    store = memory_store()
    meter = UsageMeter()
    meter.add("j1", "acme", tokens=100, episodes=4)
    meter.add("j1", "acme", tokens=20, trainer_s=1.25)
    meter.add("j2", "acme", eval_tokens=7, stored_bytes=1000)
    meter.add("j3", "globex", chat_tokens=5)
    meter.add("", "", chat_tokens=3)  # a base-model chat of no job
    await meter.flush(store.usage)
    meter.add("j1", "acme", trainer_s=0.5)
    await meter.flush(store.usage)

    jobs = await store.usage.of_jobs(["j1", "j2", "never"])
    assert (jobs["j1"].tokens, jobs["j1"].episodes, jobs["j1"].trainer_s) == (120, 4, 1.75)
    assert jobs["j2"].eval_tokens == 7 and jobs["j2"].stored_bytes == 1000
    assert jobs["never"].generated_tokens == 0
    acme = await store.usage.of_tenant("acme")
    assert (acme.tokens, acme.eval_tokens, acme.trainer_s, acme.stored_bytes) == (
        120,
        7,
        1.75,
        1000,
    )
    assert sorted(await store.usage.tenants()) == ["acme", "globex"]
    assert (await store.usage.unattributed()).chat_tokens == 3
    # The job's own counts expire a billing period after its last; the tenant's never.
    assert 0 < await store.client.ttl(usage_key("j1")) <= JOB_USAGE_TTL_S
    assert await store.client.ttl(tenant_usage_key("acme")) == -1
    await store.client.delete(usage_key("j1"))
    assert (await store.usage.of_tenant("acme")).tokens == 120


async def test_counts_that_could_not_be_written_wait_for_the_next_flush() -> None:
    store = memory_store()
    meter = UsageMeter()
    meter.add("j1", "acme", tokens=10)

    class Away(UsageCounters):
        async def add(self, counts: Any) -> None:
            raise ConnectionError("Redis is away")

    with pytest.raises(ConnectionError):
        await meter.flush(Away(store.client))
    meter.add("j1", "acme", tokens=5)
    await meter.flush(store.usage)
    assert (await store.usage.of_jobs(["j1"]))["j1"].tokens == 15


def test_only_usage_fields_are_counted() -> None:
    with pytest.raises(ValueError, match="not usage fields"):
        UsageMeter().add("j1", "acme", token=1)


async def test_a_tenants_usage_as_csv() -> None:
    store = memory_store()
    meter = UsageMeter()
    meter.add("j1", "acme", tokens=3, trainer_s=0.25)
    await meter.flush(store.usage)
    jobs = await store.usage.of_jobs(["j1"])
    total = await store.usage.of_tenant("acme")
    lines = usage_csv([("acme", "j1", jobs["j1"]), ("acme", "*", total)]).splitlines()
    assert lines[0].split(",")[:4] == ["tenant", "job", "tokens", "eval_tokens"]
    assert lines[1].startswith("acme,j1,3,0,0,0,0,0.250,0")
    assert lines[2].startswith("acme,*,3,")


class CountingEngine:
    """Answers every request with as many tokens as its context has, and counts them as the
    engine does (`generated_tokens`)."""

    def __init__(self) -> None:
        self.generated_tokens = 0

    async def generate(
        self, request: GenerationRequest, adapter: AdapterRef | None = None
    ) -> GenerationResult:
        tokens = list(request.context_token_ids)
        self.generated_tokens += len(tokens)
        return result_for(
            request,
            completion_token_ids=tokens,
            logprobs=[0.0] * len(tokens),
            adapter_version=0,
            finish_reason="stop",
        )


async def test_every_generation_is_counted_once_as_the_job_it_was_for() -> None:
    store = memory_store()
    spec = job_spec("judged", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1)
    spec = msgspec.structs.replace(spec, tenant="acme")
    assert await store.jobs.register(spec)
    engine = CountingEngine()
    adapters = JobAdapters(
        engine,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        JobsSeen(lambda: store),
        artifacts=Path("/nonexistent"),
    )
    training = msgspec.structs.replace(request_for("judged", 0, 0), tenant="acme")
    evaluation = msgspec.structs.replace(training, request_id="e", pinned_adapter_version=2)
    chat = msgspec.structs.replace(training, request_id="chat-1", context_token_ids=[1] * 5)
    await adapters.generate_with(training, None)
    await adapters.generate_with(evaluation, None)
    await adapters.generate_with(chat, None, chat_for="judged")  # a judge's, for the job
    await adapters.generate_with(chat, None, chat_for="")  # the base model, no job
    await adapters.usage.flush(store.usage)
    counted = (await store.usage.of_jobs(["judged"]))["judged"]
    assert (counted.tokens, counted.eval_tokens, counted.chat_tokens) == (3, 3, 5)
    assert (await store.usage.of_tenant("acme")).generated_tokens == 11
    unattributed = await store.usage.unattributed()
    assert counted.generated_tokens + unattributed.generated_tokens == engine.generated_tokens


async def test_the_meter_flushes_while_running_and_once_more_when_stopping() -> None:
    store = memory_store()
    meter = UsageMeter()
    stopping = asyncio.Event()
    running = asyncio.create_task(meter.run(lambda: store.usage, stopping, every_s=0.05))
    meter.add("j1", "acme", episodes=1)
    await asyncio.sleep(0.2)
    assert (await store.usage.of_jobs(["j1"]))["j1"].episodes == 1
    meter.add("j1", "acme", episodes=1)
    stopping.set()
    await asyncio.wait_for(running, 5)
    assert (await store.usage.of_jobs(["j1"]))["j1"].episodes == 2


def test_stored_bytes_are_the_published_directorys_files(tmp_path: Path) -> None:
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "config.json").write_text("{}")
    assert directory_bytes(tmp_path) == 1002
    assert directory_bytes(tmp_path / "gone") == 0
