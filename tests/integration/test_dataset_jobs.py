"""Hugging Face datasets as jobs end to end on the real stack (issue 45): one job reads a
parquet file whose prompts are a chat `messages` column and checks answers with `math-verify`,
another a `save_to_disk` folder, training on its `train` split and evaluating on `test`.

The data is written by the test into the tenant's folder of env_svc's data directory, as a
tenant puts theirs there. The three services run as `marlaas up` starts them, on a stack of
the test's own; the rollout engine is tests/agent_engine.py, which answers "What is a + b?"
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

from common.files.models import tiny_model
from common.runtime.config import SharedSettings
from common.wire.lifecycle import SERVICES
from common.wire.messages import EnvSettings, Event
from console.stack.local import LocalStack
from marlaas import Client
from marlaas.jobwatch import JobProgress, watch_jobs
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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets.disable_progress_bars()
    write_data(tmp_path / "data")
    # A stack of its own: services of the session's stack (tests/conftest.py
    # `pipeline_services`), in the same consumer groups, would take some of these jobs'
    # records, without this data directory or this engine.
    monkeypatch.setenv("MARLAAS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("ROLLOUT_ENGINE", "tests.agent_engine:AgentEngine")
    settings = SharedSettings(
        state_dir=tmp_path / "stack", base_model=str(tiny_model()), connect_timeout_s=60
    )
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
    async with LocalStack(settings, use_existing_from_env=False, services=SERVICES) as stack:
        bootstrap = stack.kafka_bootstrap
        async with Client(stack.client_settings) as client:
            await client.submit([chat, saved])
        await watch_jobs(bootstrap, progress, timeout_s=300, on_event=events.append)
        trajectories = {s.job_id: await trajectories_of(bootstrap, s.job_id) for s in (chat, saved)}

    for job in progress.values():
        assert job.status == "completed" and job.steps == STEPS, events
        assert sorted(job.evals) == [0, STEPS], job.evals
        assert {e["eval_accuracy"] for e in job.evals.values()} == {1.0}, job.evals
    for found in trajectories.values():
        assert found and not [t.error for t in found if t.error]
        assert all(t.reward_components == {"correct": 1.0} for t in found)
