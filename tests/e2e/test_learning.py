"""SmolLM2 really learns: one arithmetic job's mean reward rises by a clear margin.

Slow (tens of minutes on 2 cores): excluded from `make test`, run with `make test-all`.
"""

from __future__ import annotations

import pytest

from common.runtime.config import SharedSettings
from common.wire.lifecycle import SERVICES
from console.demo import demo_jobs
from console.stack.local import LocalStack
from console.stack.services import start_services, stop_services
from marlaas.jobwatch import JobProgress, submit_jobs, watch_jobs

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

WINDOW = 3
MIN_GAIN = 0.15
"""Reward rises by at least this much between the first and the last WINDOW steps."""


async def test_smollm2_arithmetic_reward_rises(
    local_stack: LocalStack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    state_dir = tmp_path_factory.mktemp("learning")
    settings = SharedSettings(state_dir=state_dir, artifact_dir=state_dir / "artifacts")
    arithmetic = next(
        spec for spec in demo_jobs(settings.base_model, "e2e") if spec.env.name == "arithmetic"
    )
    progress = {arithmetic.job_id: JobProgress.of(arithmetic)}
    children = start_services(
        SERVICES, settings, local_stack.kafka_bootstrap, local_stack.redis_url
    )
    try:
        await submit_jobs(local_stack.kafka_bootstrap, [arithmetic])
        await watch_jobs(local_stack.kafka_bootstrap, progress, timeout_s=3000)
    finally:
        stop_services(children)
    job = progress[arithmetic.job_id]
    assert job.status == "completed" and job.steps == arithmetic.rl.max_steps
    start, end = job.reward_window(True, WINDOW), job.reward_window(False, WINDOW)
    assert start is not None and end is not None
    assert end - start >= MIN_GAIN, f"rewards per step: {job.rewards}"
