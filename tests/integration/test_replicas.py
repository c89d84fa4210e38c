"""Two replicas of every service on the embedded stack (`marlaas up --replicas`): the
consumer groups split the partitions, each trainer owns its own jobs, every rollout replica
loads every adapter update, and when a trainer replica dies (kill -9) its jobs move to the
replica that takes them (the other one, or the killed one once restarted) from their
checkpoints and every job completes.

The rollout replicas run the chaos run's deterministic engine (two vLLM engines do not fit
this machine's two cores beside the trainers); broker, Redis, env_svc, the trainers on the
tiny model and every hand-off between them are the real ones.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from common.files.models import tiny_model
from common.runtime.config import SharedSettings
from common.wire.lifecycle import SERVICES, TERMINAL_STATES
from common.wire.messages import EnvSettings, JobSpec, new_id
from console.demo import job_spec
from console.stack.local import LocalStack
from console.stack.services import replicated
from marlaas import Client

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def jobs(n: int) -> list[JobSpec]:
    return [
        job_spec(
            f"replica-{i}-{new_id()[:6]}",
            f"tenant-{i % 2}",
            EnvSettings(name="arithmetic", seed=i),
            lora_rank=4,
            group_size=2,
            groups_per_step=1,
            max_steps=STEPS,
            max_staleness=1,
            max_context_tokens=128,
            max_new_tokens=8,
        )
        for i in range(n)
    ]


def log_of(state_dir: Path, name: str) -> str:
    return (state_dir / "logs" / f"{name}.log").read_text(errors="replace")


async def test_two_replicas_of_each_service_split_the_work_and_survive_a_trainer_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUT_ENGINE", "tests.chaos.scripted_engine:ScriptedEngine")
    monkeypatch.setenv("MARLAAS_CONSUMER_SESSION_TIMEOUT_S", "6")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    settings = SharedSettings(
        state_dir=tmp_path, base_model=str(tiny_model()), connect_timeout_s=60
    )
    services = replicated(SERVICES, {"env": 2, "rollout": 2, "trainer": 2})
    specs = jobs(8)
    async with LocalStack(settings, use_existing_from_env=False, services=services) as stack:
        connected = stack.client_settings  # its broker, Redis and bus key
        async with Client(connected, connect_timeout_s=60) as client:
            await client.submit(specs)
            trainers = [c for c in stack.children if c.name == "trainer_svc"]
            killed: int | None = None
            sizes_at_kill = [0, 0]
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                records = [await client.store.jobs.get(s.job_id) for s in specs]
                if all(r is not None and r.status in TERMINAL_STATES for r in records):
                    break
                for index, trainer in enumerate(trainers):
                    if killed is None and "step 2/" in log_of(tmp_path, f"trainer_svc-{index}"):
                        trainer.process.kill()  # its jobs go on from their checkpoints
                        killed = index
                        sizes_at_kill = [len(log_of(tmp_path, f"trainer_svc-{i}")) for i in (0, 1)]
                await asyncio.sleep(1)
            records = [await client.store.jobs.get(s.job_id) for s in specs]
            statuses = {
                s.job_id: r.status if r else "missing" for s, r in zip(specs, records, strict=True)
            }
            audits = await client.audits([s.job_id for s in specs])
    assert killed is not None and set(statuses.values()) == {"completed"}, statuses
    assert all(not a.problems for a in audits.values()), {j: a.problems for j, a in audits.items()}

    trainer_logs = [log_of(tmp_path, f"trainer_svc-{i}") for i in range(2)]
    rollout_logs = [log_of(tmp_path, f"rollout_svc-{i}") for i in range(2)]
    env_logs = [log_of(tmp_path, f"env_svc-{i}") for i in range(2)]
    for logs, topic in (
        (env_logs, "marlaas.rollouts"),
        (rollout_logs, "marlaas.prompts"),
        (trainer_logs, "marlaas.trajectories"),
    ):
        # Both replicas of each group held partitions of its topic at some point.
        assert all(
            re.search(rf"partitions assigned: [^\n]*{re.escape(topic)}\[\d", log) for log in logs
        )
    stepped_by = {
        s.job_id: {
            i
            for i, log in enumerate(trainer_logs)
            if re.search(rf"step \d+/{STEPS} .*job={s.job_id}", log)
        }
        for s in specs
    }
    assert all(stepped_by.values()), stepped_by
    assert killed is not None

    def last_step(job_id: str, log: str) -> int:
        steps = re.findall(rf"step (\d+)/{STEPS} .*job={job_id}", log)
        return max(map(int, steps), default=0)

    # The killed replica's jobs: its step log was the latest for them, and they were not done.
    before = [log[:size] for log, size in zip(trainer_logs, sizes_at_kill, strict=True)]
    after = "".join(log[size:] for log, size in zip(trainer_logs, sizes_at_kill, strict=True))
    victims = [
        s.job_id
        for s in specs
        if STEPS > last_step(s.job_id, before[killed]) > last_step(s.job_id, before[1 - killed])
    ]
    resumed = [j for j in victims if re.search(rf"resumed from \S+ at v[1-9]\d* .*job={j}", after)]
    assert victims and resumed == victims, (victims, resumed)  # went on from checkpoints
