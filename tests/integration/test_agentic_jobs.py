"""Agentic jobs end to end on the real stack, at once: a job whose tool is served by an MCP
server and whose answers a model judges, and a job whose environment is a `verifiers` taskset.

The three services run as `marlaas up` starts them, on the session's broker and Redis; the
operator registered the example MCP server (examples/mcp/units_server.py), the example
environment (examples/envs/unit_conversion.py) and a verifiers taskset installed as a package
(tests/tasksets/mini_arith). env_svc starts the server itself when the job arrives, keeps one
session for every episode, and asks rollout_svc's chat endpoint to judge; it scores the
taskset's episodes with its own async reward and metric.
The rollout engine is tests/agent_engine.py, which plays a model that has learnt the task (the
tiny random model never writes a call); the pipeline test runs the same job on vLLM's engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from pydantic import SecretStr

from common.files.models import tiny_model
from common.runtime.config import SharedSettings
from common.wire.codec import decode
from common.wire.lifecycle import SERVICES
from common.wire.messages import EnvSettings, Event, JobSpec, Topic, Trajectory, new_id
from console.demo import job_spec
from console.stack.children import free_port
from console.stack.local import LocalStack
from console.stack.services import start_services, stop_services
from marlaas.jobwatch import JobProgress, submit_jobs, watch_jobs
from tests.agent_engine import JUDGE_SCORE
from tests.agentic import UNITS_SERVER, operator_registrations
from tests.processes import alive, cmdline, descendants_of

pytestmark = pytest.mark.kafka

G, B, STEPS = 2, 2, 2
JUDGE_WEIGHT = 0.5
EVAL_TASKS = 2


def agentic_job(name: str, env: EnvSettings) -> JobSpec:
    return job_spec(
        f"{name}-{new_id()[:8]}",
        "tenant-agent",
        env,
        lora_rank=4,
        eval_tasks=EVAL_TASKS,
        eval_every_steps=STEPS,
        group_size=G,
        groups_per_step=B,
        max_steps=STEPS,
        max_staleness=1,
        max_context_tokens=512,
        max_new_tokens=48,
    )


async def trajectories_of(bootstrap: str, job_id: str) -> list[Trajectory]:
    consumer = AIOKafkaConsumer(
        Topic.TRAJECTORIES.value, bootstrap_servers=bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    found: list[Trajectory] = []
    try:
        while batch := await consumer.getmany(timeout_ms=2000):
            for records in batch.values():
                for record in records:
                    trajectory = decode(Topic.TRAJECTORIES, record.value)
                    if isinstance(trajectory, Trajectory) and trajectory.job_id == job_id:
                        found.append(trajectory)
    finally:
        await consumer.stop()
    return found


def mcp_servers_under(pid: int) -> list[int]:
    return [p for p in descendants_of(pid) if str(UNITS_SERVER).encode() in cmdline(p)]


async def test_an_mcp_tool_a_judged_reward_and_a_verifiers_taskset_run_as_jobs(
    local_stack: LocalStack, tmp_path: Path
) -> None:
    settings = SharedSettings(
        state_dir=tmp_path,
        artifact_dir=tmp_path / "artifacts",
        base_model=str(tiny_model()),
        bus_key=SecretStr(f"agentic-{new_id()}"),
    )
    redis_urls: dict[str, str] = {s: local_stack.redis_url_for(s) for s in SERVICES}
    bootstrap = local_stack.kafka_bootstrap
    spec = agentic_job(
        "units", EnvSettings(name="unit_conversion", params={"judge_weight": JUDGE_WEIGHT})
    )
    taskset = agentic_job("vf", EnvSettings(name="verifiers", params={"taskset": "mini-arith"}))
    progress = {s.job_id: JobProgress.of(s) for s in (spec, taskset)}
    events: list[Event] = []
    environ = operator_registrations() | {"ROLLOUT_ENGINE": "tests.agent_engine:AgentEngine"}
    children = start_services(
        SERVICES, settings, bootstrap, redis_urls, chat_port=free_port(), environ=environ
    )
    env_svc = next(c for c in children if c.name == "env_svc")
    try:
        await submit_jobs(bootstrap, [spec, taskset], signing=settings.signer)
        await watch_jobs(bootstrap, progress, timeout_s=300, on_event=events.append)
        servers_running = mcp_servers_under(env_svc.process.pid)
    finally:
        stop_services(children)
        for child in children:
            print(f"--- {child.name} (exit {child.process.returncode}) ---\n{child.log_tail(30)}")

    for job in progress.values():
        assert job.status == "completed" and job.steps == STEPS, events
        # Evaluated on held-out tasks, the base model and the final adapter, all solved.
        assert sorted(job.evals) == [0, STEPS], job.evals
        assert {e["eval_accuracy"] for e in job.evals.values()} == {1.0}, job.evals
    # One MCP server process served every episode of the job, and left with env_svc.
    assert len(servers_running) == 1
    assert not any(map(alive, servers_running))

    trajectories = await trajectories_of(bootstrap, spec.job_id)
    assert not [t.error for t in trajectories if t.error]
    assert len({t.episode_id for t in trajectories}) >= G * B * STEPS
    judged = int(JUDGE_SCORE) / 10
    for trajectory in trajectories:
        components = trajectory.reward_components
        # The call went to the server and came back as a value; the answer was right.
        assert components["tools.calls"] == 1 and components["tools.errors"] == 0, components
        assert components["correct"] == 1.0, components
        assert components["judged"] == judged, components  # the judge's score, asked
        assert trajectory.reward == pytest.approx(1.0 + JUDGE_WEIGHT * judged)
    steps = [e for e in events if e.job_id == spec.job_id and e.event == "step"]
    assert [e.metrics["tool_calls"] for e in steps] == [1.0] * STEPS
    assert [e.metrics["tool_errors"] for e in steps] == [0.0] * STEPS

    # The taskset's reward (weight 1) and metric (weight 0), scored on each episode's trace.
    scored = await trajectories_of(bootstrap, taskset.job_id)
    assert len({t.episode_id for t in scored}) >= G * B * STEPS
    assert all(t.reward_components == {"correct": 1.0, "reply_words": 1.0} for t in scored)
    assert all(t.reward == 1.0 and not t.error for t in scored)
