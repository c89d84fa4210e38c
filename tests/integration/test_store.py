"""common.state.store against a real Valkey: forward-only pointers, jobs, flow control, de-dup."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from common.runtime.backoff import ServerUnreachable
from common.state.flow import DroppedGroup, FlowState, issue_limit
from common.state.registry import UnknownJobError
from common.state.store import RedisStore
from common.wire.lifecycle import RolloutReplicaStats
from common.wire.messages import EnvSettings, JobSpec, RLSettings, new_id
from console.stack.children import free_port

pytestmark = pytest.mark.kafka


@pytest.fixture
async def registry(redis_url: str) -> AsyncIterator[RedisStore]:
    reg = await RedisStore.connect(redis_url, timeout_s=10)
    yield reg
    await reg.close()


def spec(job_id: str, tenant: str = "acme") -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant=tenant,
        base_model="smollm2-135m-instruct",
        env=EnvSettings(name="arithmetic", params={"max_operand": 9}),
        rl=RLSettings(group_size=4, groups_per_step=2, max_staleness=1),
    )


async def test_adapter_pointer_never_moves_back_under_concurrent_writers(redis_url: str) -> None:
    job_id = f"cas-{new_id()}"
    writers = [await RedisStore.connect(redis_url) for _ in range(8)]
    observed: list[int] = []
    done = asyncio.Event()

    async def watch(reader: RedisStore) -> None:
        while not done.is_set():
            if pointer := await reader.adapters.get(job_id):
                observed.append(pointer.version)
            await asyncio.sleep(0)

    async def write(writer: RedisStore, versions: list[int]) -> list[tuple[int, bool]]:
        results = []
        for version in versions:
            moved = await writer.adapters.publish(job_id, version, f"file:///a/v{version}", version)
            results.append((version, moved))
        return results

    versions = list(range(1, 201))
    chunks = [random.Random(i).sample(versions, len(versions)) for i in range(len(writers))]
    watcher = asyncio.create_task(watch(writers[0]))
    try:
        results = await asyncio.gather(*(write(w, c) for w, c in zip(writers, chunks, strict=True)))
    finally:
        done.set()
        await watcher
        for writer in writers:
            await writer.close()

    pointer = await RedisStore.connect(redis_url)
    final = await pointer.adapters.get(job_id)
    await pointer.close()
    assert final is not None and final.version == 200 and final.uri == "file:///a/v200"
    assert observed == sorted(observed), "a reader saw the pointer move backwards"
    moves = [version for writer_results in results for version, moved in writer_results if moved]
    # Each version moved the pointer at most once, and the successful moves form a chain to 200.
    assert len(moves) == len(set(moves)) and max(moves) == 200


async def test_an_older_writer_cannot_overwrite_a_newer_version(registry: RedisStore) -> None:
    job_id = f"older-{new_id()}"
    assert await registry.adapters.publish(job_id, 5, "file:///v5", 5)
    assert not await registry.adapters.publish(job_id, 4, "file:///v4", 4)
    assert not await registry.adapters.publish(job_id, 5, "file:///other", 5)  # replay
    pointer = await registry.adapters.get(job_id)
    assert pointer is not None and (pointer.version, pointer.uri, pointer.step) == (
        5,
        "file:///v5",
        5,
    )
    assert (await registry.adapters.all())[job_id] == pointer
    assert await registry.adapters.get(f"none-{new_id()}") is None


async def test_job_registry_registers_once_and_terminal_status_sticks(registry: RedisStore) -> None:
    job_id = f"job-{new_id()}"
    assert await registry.jobs.register(spec(job_id))
    assert not await registry.jobs.register(spec(job_id, tenant="someone-else"))  # redelivery
    record = await registry.jobs.get(job_id)
    assert record is not None and record.spec == spec(job_id) and record.status == "pending"
    assert job_id in await registry.jobs.ids()

    assert await registry.jobs.set_status(job_id, "running")
    assert await registry.jobs.set_status(job_id, "paused", "tenant asked")
    record = await registry.jobs.get(job_id)
    assert record is not None and (record.status, record.reason) == ("paused", "tenant asked")
    assert await registry.jobs.set_status(job_id, "completed")
    assert not await registry.jobs.set_status(job_id, "running")  # a late message cannot revive it
    record = await registry.jobs.get(job_id)
    assert record is not None and record.status == "completed"

    with pytest.raises(UnknownJobError, match="unknown job"):
        await registry.jobs.set_status(f"missing-{new_id()}", "running")
    assert await registry.jobs.get(f"missing-{new_id()}") is None


async def test_flow_control_issues_exactly_the_bound_under_concurrency(redis_url: str) -> None:
    job_id = f"flow-{new_id()}"
    replicas = [await RedisStore.connect(redis_url) for _ in range(4)]
    try:

        async def claim(replica: RedisStore) -> tuple[int, int] | None:
            group = await replica.flow.try_issue_group(
                job_id, max_staleness=1, groups_per_step=4, max_groups=100
            )
            return None if group is None else (group.index, group.trained_version)

        claims = await asyncio.gather(*(claim(replicas[i % 4]) for i in range(50)))
        issued = sorted(c for c in claims if c is not None)
        # 8 groups, each index once, each knowing the trained version it was issued at
        assert issued == [(i, 0) for i in range(issue_limit(0, 1, 4))]

        assert await trained(replicas[0], job_id, 1)
        assert not await trained(replicas[1], job_id, 0)  # the pointer never moves back
        claims = await asyncio.gather(*(claim(replicas[i % 4]) for i in range(20)))
        assert sorted(c for c in claims if c is not None) == [(i, 1) for i in range(8, 12)]
        assert await replicas[2].flow.state(job_id) == FlowState(
            issued_groups=12, dropped_groups=0, trained_version=1
        )
    finally:
        for replica in replicas:
            await replica.close()


async def trained(store: RedisStore, job_id: str, version: int) -> bool:
    """What the trainer does once `version` is durable: move the adapter pointer."""
    return await store.adapters.publish(job_id, version, f"/artifacts/{job_id}/v{version}", version)


async def claim_index(
    store: RedisStore, job_id: str, *, max_staleness: int, groups_per_step: int, max_groups: int
) -> int | None:
    group = await store.flow.try_issue_group(
        job_id,
        max_staleness=max_staleness,
        groups_per_step=groups_per_step,
        max_groups=max_groups,
    )
    return None if group is None else group.index


async def test_on_policy_bound_waits_for_every_step(registry: RedisStore) -> None:
    job_id = f"onpolicy-{new_id()}"
    for version in range(3):
        got = [
            await claim_index(registry, job_id, max_staleness=0, groups_per_step=2, max_groups=100)
            for _ in range(3)
        ]
        assert got == [2 * version, 2 * version + 1, None]
        await trained(registry, job_id, version + 1)


async def test_dropped_groups_are_replaced_and_the_job_total_is_capped(
    registry: RedisStore,
) -> None:
    job_id = f"dropped-{new_id()}"

    async def claim() -> int | None:
        return await claim_index(registry, job_id, max_staleness=0, groups_per_step=2, max_groups=4)

    assert [await claim(), await claim(), await claim()] == [0, 1, None]
    dropped = await registry.flow.record_dropped_group(job_id, f"{job_id}/g0", invalid=True)
    assert dropped == DroppedGroup(counted=True, dropped_groups=1, failed_in_a_row=1)
    # Replayed after a crash: counted once, so the window is not widened twice.
    replayed = await registry.flow.record_dropped_group(job_id, f"{job_id}/g0", invalid=True)
    assert replayed == DroppedGroup(counted=False, dropped_groups=1, failed_in_a_row=1)
    assert [await claim(), await claim()] == [2, None]  # one replacement, no more
    await trained(registry, job_id, 1)
    assert [await claim(), await claim(), await claim()] == [3, 4, None]  # 4 live groups: cap
    await trained(registry, job_id, 5)
    assert await claim() is None
    # A trained step ended the run of failed groups.
    assert await registry.flow.state(job_id) == FlowState(
        issued_groups=5, dropped_groups=1, trained_version=5, failed_in_a_row=0
    )


async def test_dedup_sets(registry: RedisStore) -> None:
    job_id = f"dedup-{new_id()}"
    assert await registry.dedup.mark_seen("trained", job_id, "group-1")
    assert not await registry.dedup.mark_seen("trained", job_id, "group-1")
    assert await registry.dedup.seen("trained", job_id, "group-1")
    assert not await registry.dedup.seen("issued", job_id, "group-1")  # scopes are separate
    await registry.dedup.forget_seen("trained", job_id, "group-1")
    assert not await registry.dedup.seen("trained", job_id, "group-1")


async def test_unreachable_redis_fails_with_its_address() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ServerUnreachable, match=f"Redis at {url} unreachable"):
        await RedisStore.connect(url, timeout_s=1.0)


async def test_stats_keep_latest_values_and_a_time_ordered_history(registry: RedisStore) -> None:
    replica = f"test-{new_id()[:8]}"
    for busy_s in (1.0, 2.5, 4.0):
        stats = RolloutReplicaStats(busy_s=busy_s, uptime_s=5.0)
        await registry.replicas.put_stats(replica, stats, ttl_s=60)
    assert (await registry.replicas.stats())[replica] == RolloutReplicaStats(
        busy_s=4.0, uptime_s=5.0
    )
    history = (await registry.replicas.stats_history())[replica]
    assert [sample.busy_s for sample in history] == [1.0, 2.5, 4.0]
    assert all(sample.uptime_s == 5.0 for sample in history)
    times = [sample.at or 0.0 for sample in history]
    assert times == sorted(times) and times[-1] - times[0] < 5
