"""console/status/render.py: the live board as a person reads it on a 120-column terminal."""

from __future__ import annotations

import time

from rich.console import Console

from console.status.board import JobRow, ServiceLag, StatusSnapshot
from console.status.render import render
from marlaas.jobwatch import JobProgress

ENVS = ("arithmetic", "calculator", "countdown", "code_tasks")


def snapshot() -> StatusSnapshot:
    rows = []
    for index, env in enumerate(ENVS):
        progress = JobProgress(f"globex-{env}-1a2b3c4d", "globex", env, 12)
        progress.rewards, progress.steps = [0.125, 0.5, 0.625], 3
        progress.evals = {
            0: {"eval_accuracy": 0.4375, "eval_accuracy_stderr": 0.0620},
            8: {"eval_accuracy": 0.8125, "eval_accuracy_stderr": 0.0488},
        }
        rows.append(JobRow(progress, "completed" if index else "running", 16))
    runtime = {"precision": "bfloat16", "hardware": "Intel Xeon 6/167, 1 core, AMX"}
    return StatusSnapshot(
        jobs=rows,
        lags=[ServiceLag("trainer_svc", "marlaas-trainer", 1)],
        replicas=[],
        taken_at=time.time(),
        runtimes={("trainer_svc", "host-1"): runtime},
    )


def test_four_jobs_fit_120_columns_with_every_value_whole() -> None:
    """The boxed table with a progress bar cut `calculator` to `calcul…` and the accuracies
    to `0.81±0…` at 120 columns."""
    console = Console(width=120, record=True, color_system=None)
    console.print(render(snapshot()))
    lines = console.export_text().splitlines()
    assert "…" not in "\n".join(lines)
    assert all(len(line) <= 120 for line in lines)
    for env in ENVS:
        (line,) = [line for line in lines if f"globex-{env}-1a2b3c4d" in line]
        assert f" {env} " in line and "0.44→0.81±0.05 v8" in line and " 3/12 " in line
