"""The whole pipeline: real Tansu, Valkey, vLLM CPU, three service processes, a tiny model.

Four jobs run at once to max_steps: one with S=1, one strictly on-policy (S=0), one
whose every trajectory is delivered twice, and one whose tool an MCP server serves. A job
with an unknown environment is rejected. Afterwards every service is ready and its metrics
count the work that was done.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from prometheus_client.parser import text_string_to_metric_families

from common.bus.kafka import Producer
from common.runtime.metrics import ENDED_JOB
from common.security.signing import RecordSigner
from common.state.store import RedisStore
from common.wire.codec import decode
from common.wire.messages import EnvSettings, Event, JobSpec, Topic, Trajectory, new_id
from console.demo import job_spec
from console.stack.local import LocalStack
from marlaas.jobwatch import JobProgress, submit_jobs, watch_jobs
from tests.conftest import RunningServices

pytestmark = pytest.mark.kafka

G, B = 4, 2
EVAL_TASKS = 4


def job(base_model: str, name: str, *, max_staleness: int, max_steps: int) -> JobSpec:
    return job_spec(
        f"{name}-{new_id()[:8]}",
        f"tenant-{name}",
        EnvSettings(name="arithmetic", seed=len(name)),
        base_model=base_model,
        eval_tasks=EVAL_TASKS,
        eval_every_steps=2,
        group_size=G,
        groups_per_step=B,
        max_steps=max_steps,
        max_staleness=max_staleness,
        learning_rate=1e-3,
        max_context_tokens=128,
        max_new_tokens=8,
    )


async def duplicate_trajectories(
    bootstrap: str, job_id: str, stop: asyncio.Event, signing: RecordSigner | None
) -> int:
    """Re-send every trajectory of `job_id` once more, as a redelivering producer (one
    holding the bus key: env_svc) would."""
    consumer = AIOKafkaConsumer(
        Topic.TRAJECTORIES.value, bootstrap_servers=bootstrap, auto_offset_reset="earliest"
    )
    producer = Producer(bootstrap, client_id="duplicator", signing=signing)
    await consumer.start()
    await producer.start()
    seen: set[str] = set()
    try:
        while not stop.is_set():
            for records in (await consumer.getmany(timeout_ms=300)).values():
                for record in records:
                    trajectory = decode(Topic.TRAJECTORIES, record.value)
                    assert isinstance(trajectory, Trajectory)
                    if trajectory.job_id == job_id and trajectory.episode_id not in seen:
                        seen.add(trajectory.episode_id)
                        await producer.send(trajectory)
    finally:
        await consumer.stop()
        await producer.stop()
    return len(seen)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric_samples(exposition: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def metric(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_concurrent_jobs_run_to_max_steps(
    pipeline_services: RunningServices, local_stack: LocalStack
) -> None:
    bootstrap = local_stack.kafka_bootstrap
    base = pipeline_services.settings.base_model
    lagging = job(base, "lagging", max_staleness=1, max_steps=3)
    on_policy = job(base, "onpolicy", max_staleness=0, max_steps=3)
    duplicated = job(base, "dup", max_staleness=1, max_steps=2)
    rejected = JobSpec(
        job_id=f"bad-{new_id()[:8]}",
        tenant="tenant-bad",
        base_model=base,
        env=EnvSettings(name="no-such-env"),
    )
    # A tool environment whose tool an MCP server serves (tests/agentic.py registers both):
    # the tiny model's calls, well-formed or not, are answered and counted; no judge (the
    # tiny model rarely writes a score: tests/integration/test_chat_api.py asks it once).
    agentic = job_spec(
        f"units-{new_id()[:8]}",
        "tenant-agent",
        EnvSettings(name="unit_conversion", params={"judge_weight": 0}),
        base_model=base,
        group_size=G,
        groups_per_step=1,
        max_steps=2,
        max_context_tokens=448,
        max_new_tokens=16,
    )
    too_long = job_spec(
        f"long-{new_id()[:8]}",
        "tenant-bad",
        EnvSettings(name="arithmetic"),
        base_model=base,
        max_context_tokens=24,
        max_new_tokens=8,
    )
    specs = [lagging, on_policy, duplicated, agentic, rejected, too_long]
    progress = {spec.job_id: JobProgress.of(spec) for spec in specs}
    events: list[Event] = []
    stop_duplicating = asyncio.Event()
    duplicator = asyncio.create_task(
        duplicate_trajectories(
            bootstrap, duplicated.job_id, stop_duplicating, pipeline_services.settings.signer
        )
    )
    await submit_jobs(bootstrap, specs, signing=pipeline_services.settings.signer)
    try:
        await watch_jobs(bootstrap, progress, timeout_s=900, on_event=events.append)
    finally:
        stop_duplicating.set()
        duplicated_count = await duplicator

    assert progress[rejected.job_id].status == "rejected"
    assert "unknown environment 'no-such-env'" in progress[rejected.job_id].reason
    assert progress[too_long.job_id].status == "rejected"
    assert "max_context_tokens" in progress[too_long.job_id].reason

    agentic_steps = [e for e in events if e.job_id == agentic.job_id and e.event == "step"]
    assert progress[agentic.job_id].status == "completed", agentic_steps
    assert [e.step for e in agentic_steps] == [1, 2]
    assert all("tool_calls" in e.metrics for e in agentic_steps)  # a tool environment

    registry = await RedisStore.connect(local_stack.redis_url)
    try:
        for spec in (lagging, on_policy, duplicated):
            job_events = [e for e in events if e.job_id == spec.job_id]
            steps = [e for e in job_events if e.event == "step"]
            assert progress[spec.job_id].status == "completed", job_events
            # Adapter versions advance one at a time, each exactly once.
            assert [e.step for e in steps] == list(range(1, spec.rl.max_steps + 1))
            for event in steps:
                assert event.metrics["staleness_max"] <= spec.rl.max_staleness
                assert event.metrics["samples"] == G * B  # no trajectory trained twice
            pointer = await registry.adapters.get(spec.job_id)
            assert pointer is not None and pointer.version == spec.rl.max_steps
            assert (Path(pointer.uri.removeprefix("file://")) / "adapter_config.json").is_file()
            record = await registry.jobs.get(spec.job_id)
            assert record is not None and record.status == "completed"
            # Evaluated greedily: the base model, every 2nd version and the final one, each
            # once, over every held-out task; none of it trained (samples above).
            evaluated = {e.step: e.metrics for e in job_events if e.event == "eval"}
            assert sorted(evaluated) == sorted(
                {0, *range(2, spec.rl.max_steps + 1, 2), spec.rl.max_steps}
            )
            assert {m["eval_episodes"] for m in evaluated.values()} == {EVAL_TASKS}
            assert all(0 <= m["eval_accuracy"] <= 1 for m in evaluated.values())
        registered = len(await registry.jobs.ids())
    finally:
        await registry.close()

    # S = 0: every trained group was sampled with exactly the version being trained.
    on_policy_steps = [e for e in events if e.job_id == on_policy.job_id and e.event == "step"]
    assert all(e.metrics["staleness_max"] == 0 for e in on_policy_steps)
    assert duplicated_count >= G * B * duplicated.rl.max_steps

    # Every service is ready, and its metrics count what it did.
    samples: dict[str, dict[tuple[str, frozenset[tuple[str, str]]], float]] = {}
    for child in pipeline_services.children:
        assert child.metrics_url is not None, child.name
        status, body = await asyncio.to_thread(http_get, f"{child.metrics_url}/readyz")
        assert status == 200, (child.name, body)
        status, body = await asyncio.to_thread(http_get, f"{child.metrics_url}/metrics")
        assert status == 200, child.name
        samples[child.name] = metric_samples(body)
    # Each registered spec is decoded once per service process, whatever the records and
    # sweeps that read the job (common/state/admitted.py): at most one per job ever
    # registered. env_svc knows the jobs it admitted without decoding them; the trainer
    # decodes each job it takes on.
    decodes = {
        name: metric(found, "marlaas_job_spec_decodes_total") for name, found in samples.items()
    }
    assert decodes["trainer_svc"] > 0, decodes
    assert all(count <= registered for count in decodes.values()), (decodes, registered)
    processed = "marlaas_messages_processed_total"
    assert metric(samples["env_svc"], processed, service="env_svc", topic="marlaas.jobs") >= 5
    assert (
        metric(samples["rollout_svc"], processed, service="rollout_svc", topic="marlaas.prompts")
        > 0
    )
    assert metric(samples["rollout_svc"], "marlaas_rollout_generated_tokens_total") > 0
    # A service exports the consumer metrics and its own, not another service's.
    assert not [name for name, _ in samples["env_svc"] if name.startswith("marlaas_rollout_")]
    # An ended job's series are gone; its steps are counted among its tenant's ended jobs'.
    counted = "marlaas_trainer_steps_total"
    for spec in (lagging, on_policy, duplicated):
        assert not metric(samples["trainer_svc"], counted, job_id=spec.job_id, tenant=spec.tenant)
        trained = metric(samples["trainer_svc"], counted, job_id=ENDED_JOB, tenant=spec.tenant)
        assert trained == spec.rl.max_steps, spec.job_id
