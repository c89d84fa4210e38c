"""Usage adds up (issue 45): two tenants' jobs run on the real services (vLLM's CPU engine),
and every token the engine reports generating is counted to a job (or, for a base-model chat
of no job, as unattributed); each job's episodes, trainer seconds and stored bytes are counted
where the work happened; the API's and the CLI's readings say the same.

The services are the session's (`pipeline_services`), which other tests used before: the
test compares what changed while its jobs ran, the engine's counter (per replica) against
the usage counted (all tenants), once both have settled.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from common.files.artifacts import adapter_dir
from common.state.store import RedisStore
from common.wire.messages import EnvSettings, new_id
from console.demo import job_spec
from console.stack.local import LocalStack
from marlaas.jobwatch import JobProgress, submit_jobs, watch_jobs
from tests.conftest import RunningServices
from trainer_svc.step import directory_bytes

pytestmark = pytest.mark.kafka

G, B, STEPS, EVAL_TASKS = 2, 2, 2, 3


async def totals(store: RedisStore) -> tuple[int, dict[str, float]]:
    """(tokens counted to every tenant and to no job, each replica's generated tokens)."""
    counted = await store.usage.generated_tokens()
    engines = {r: s.generated_tokens or 0.0 for r, s in (await store.replicas.stats()).items()}
    return counted, engines


async def settled(store: RedisStore, quiet_s: float = 6.0) -> tuple[int, dict[str, float]]:
    """`totals` once neither changed for `quiet_s` (a replica reports every 5 s, usage is
    flushed every 2 s)."""
    last, since = await totals(store), time.monotonic()
    while time.monotonic() - since < quiet_s:
        await asyncio.sleep(1.0)
        now = await totals(store)
        if now != last:
            last, since = now, time.monotonic()
    return last


def generated_since(before: dict[str, float], after: dict[str, float]) -> int:
    """Tokens the replicas generated between the readings (a replica gone since stopped
    before: its key outlives it, unchanged, for 60 s)."""
    return int(sum(tokens - before.get(replica, 0.0) for replica, tokens in after.items()))


async def test_usage_counts_add_up_to_the_tokens_the_engine_generated(
    pipeline_services: RunningServices, local_stack: LocalStack
) -> None:
    settings = pipeline_services.settings
    assert settings.artifact_dir is not None
    artifacts = settings.artifact_dir
    specs = [
        job_spec(
            f"usage-{tenant}-{new_id()[:8]}",
            f"tenant-usage-{tenant}",
            EnvSettings(name="arithmetic", seed=index),
            base_model=settings.base_model,
            eval_tasks=EVAL_TASKS,
            eval_every_steps=STEPS,
            group_size=G,
            groups_per_step=B,
            max_steps=STEPS,
            max_staleness=1,
            max_context_tokens=128,
            max_new_tokens=8,
        )
        for index, tenant in enumerate(("a", "b"))
    ]
    store = await RedisStore.connect(local_stack.redis_url)
    try:
        counted_before, engines_before = await settled(store)
        progress = {spec.job_id: JobProgress.of(spec) for spec in specs}
        await submit_jobs(local_stack.kafka_bootstrap, specs, signing=settings.signer)
        await watch_jobs(local_stack.kafka_bootstrap, progress, timeout_s=300)
        for job in progress.values():  # the final evaluation's episodes too
            assert job.status == "completed" and sorted(job.evals) == [0, STEPS], job.evals
        counted_after, engines_after = await settled(store)
        jobs = await store.usage.of_jobs([spec.job_id for spec in specs])
        tenants = {spec.tenant: await store.usage.of_tenant(spec.tenant) for spec in specs}
    finally:
        await store.close()

    generated = generated_since(engines_before, engines_after)
    assert generated > 0
    assert counted_after - counted_before == generated
    assert sum(u.generated_tokens for u in jobs.values()) == generated
    for spec in specs:
        used = jobs[spec.job_id]
        assert used.tokens > 0 and used.eval_tokens > 0 and used.chat_tokens == 0, used
        assert used.episodes >= G * B * STEPS, used
        assert used.eval_episodes >= 2 * EVAL_TASKS, used  # the base model's and the final's
        assert used.trainer_s > 0, used
        assert used.stored_bytes == directory_bytes(adapter_dir(artifacts, spec.job_id))
        assert tenants[spec.tenant] == used  # the tenant's only job
