"""Hugging Face datasets as jobs end to end on the real stack (issue 45): one job reads a
parquet file whose prompts are a chat `messages` column and checks answers with `math-verify`,
another a `save_to_disk` folder, training on its `train` split and evaluating on `test`.

The data is written by the test into the tenant's folder of env_svc's data directory, as a
tenant puts theirs there. The three services run as `marlaas up` starts them, on the session's
broker and Redis; the rollout engine is tests/agent_engine.py, which answers "What is a + b?"
with the sum as a model that has learnt it would (the tiny random model answers nothing right,
so a test could not tell a checked answer from an unchecked one), so both jobs' held-out
accuracy is 1.0 only if each prompt reached the engine as the mapping says and env_svc scored
the replies as the job's `match` says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pytest
from pydantic import SecretStr

from common.files.models import tiny_model
from common.runtime.config import SharedSettings
from common.wire.lifecycle import SERVICES
from common.wire.messages import EnvSettings, Event, new_id
from console.stack.children import free_port
from console.stack.local import LocalStack
from console.stack.services import start_services, stop_services
from marlaas.jobwatch import JobProgress, submit_jobs, watch_jobs
from tests.integration.test_agentic_jobs import STEPS, agentic_job, trajectories_of

pytestmark = pytest.mark.kafka

TENANT = "tenant-agent"


def sums(start: int, count: int) -> list[dict[str, Any]]:
    return [
        {"question": f"What is {i} + {i + 2}?", "answer": str(2 * i + 2)}
        for i in range(start, start + count)
    ]


def write_data(root: Path) -> None:
    folder = root / TENANT
    folder.mkdir(parents=True)
    chat = [
        {
            "messages": [
                {"role": "system", "content": "Put the final answer in \\boxed{}."},
                {"role": "user", "content": row["question"]},
            ],
            "answer": row["answer"],
        }
        for row in sums(0, 40)
    ]
    datasets.Dataset.from_list(chat).to_parquet(str(folder / "sums.parquet"))
    splits = {"train": sums(100, 30), "test": sums(200, 6)}
    datasets.DatasetDict(
        {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
    ).save_to_disk(str(folder / "sums-saved"))


async def test_a_parquet_messages_job_and_a_save_to_disk_job_run_end_to_end(
    local_stack: LocalStack, tmp_path: Path
) -> None:
    datasets.disable_progress_bars()
    write_data(tmp_path / "data")
    settings = SharedSettings(
        state_dir=tmp_path,
        artifact_dir=tmp_path / "artifacts",
        base_model=str(tiny_model()),
        bus_key=SecretStr(f"datasets-{new_id()}"),
    )
    redis_urls: dict[str, str] = {s: local_stack.redis_url_for(s) for s in SERVICES}
    bootstrap = local_stack.kafka_bootstrap
    chat = agentic_job(
        "parquet",
        EnvSettings(
            name="dataset",
            params={"path": "sums.parquet", "messages_field": "messages", "match": "math"},
        ),
    )
    saved = agentic_job(
        "saved", EnvSettings(name="dataset", params={"path": "sums-saved", "eval_split": "test"})
    )
    progress = {s.job_id: JobProgress.of(s) for s in (chat, saved)}
    events: list[Event] = []
    environ = {
        "ROLLOUT_ENGINE": "tests.agent_engine:AgentEngine",
        "MARLAAS_DATA_DIR": str(tmp_path / "data"),
    }
    children = start_services(
        SERVICES, settings, bootstrap, redis_urls, chat_port=free_port(), environ=environ
    )
    try:
        await submit_jobs(bootstrap, [chat, saved], signing=settings.signer)
        await watch_jobs(bootstrap, progress, timeout_s=300, on_event=events.append)
    finally:
        stop_services(children)
        for child in children:
            print(f"--- {child.name} (exit {child.process.returncode}) ---\n{child.log_tail(30)}")

    for job in progress.values():
        assert job.status == "completed" and job.steps == STEPS, events
        assert sorted(job.evals) == [0, STEPS], job.evals
        assert {e["eval_accuracy"] for e in job.evals.values()} == {1.0}, job.evals
    for spec in (chat, saved):
        trajectories = await trajectories_of(bootstrap, spec.job_id)
        assert trajectories and not [t.error for t in trajectories if t.error]
        assert all(t.reward_components == {"correct": 1.0} for t in trajectories)
