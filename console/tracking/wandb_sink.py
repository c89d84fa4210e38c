"""Weights & Biases: a run per job, offline by default (`<root>/wandb/offline-run-*`, for
`wandb sync`), online when the deployment says so.

A job's run id is its job id, opened with `resume="allow"`: online, a later `track` resumes
the run; offline, W&B does not resume, so each `track` writes one more file of the same run
id, and `wandb sync` uploads a run's files in order of their start. W&B drops a row whose
step is below the run's last one, and evaluations arrive after the trainer has moved on
(env_svc evaluates version N while N+1 trains): so W&B's own step is a row count per job,
kept in `<root>/wandb/rows.json` so that it grows across `track` runs too, and every row
carries `adapter_version`, the x-axis `define_metric` gives `train/*` and `eval/*`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from console.tracking.runs import PROJECT, TrackedJob, installed

if TYPE_CHECKING:
    from wandb import Run

WandbMode = Literal["offline", "online"]
WANDB_MODES: tuple[WandbMode, ...] = ("offline", "online")
STEP_METRIC = "adapter_version"
"""The column every row carries: the x-axis of `train/*` and `eval/*` in W&B's charts."""
TAG_MAX_CHARS = 64
"""W&B refuses longer tags (and empty ones)."""


class WandbSink:
    """W&B runs of project `marlaas`: the job's settings and tenant as config, the tenant and
    environment as tags, each event one row (`_timestamp` the event's time), and the job's
    end as the run's exit code (0 when completed) and summary `state`."""

    name = "wandb"

    def __init__(self, root: Path, mode: str = "offline") -> None:
        self.mode = wandb_mode(mode)
        wandb = self._wandb = installed("wandb", "wandb")
        self.root = root
        if self.mode == "offline":
            # wandb-core reports its own errors to W&B unless told not to: offline stays
            # on this disk. Read when wandb-core starts, the first run of this process.
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        elif not wandb.login(prompt=False, verify=False):
            raise ValueError("W&B online needs an API key: set WANDB_API_KEY or `wandb login`")
        self._settings = wandb.Settings(
            console="off",  # the run is the job's, not this `track` process's
            silent=True,
            x_disable_stats=True,
            x_disable_meta=True,
            x_disable_machine_info=True,
            x_save_requirements=False,
            disable_git=True,
            save_code=False,
        )
        self._rows_path = root / "wandb" / "rows.json"
        self._rows: dict[str, int] = (
            json.loads(self._rows_path.read_text()) if self._rows_path.exists() else {}
        )
        self._jobs: dict[str, TrackedJob] = {}
        self._runs: dict[str, Run] = {}
        self._ended: dict[str, str] = {}
        """Jobs whose end this sink wrote, by state: an event after it reopens the run."""

    def open_run(self, job: TrackedJob) -> None:
        self._jobs[job.job_id] = job
        self._start(job)

    def log(self, job_id: str, step: int, metrics: Mapping[str, float], at: float) -> None:
        run = self._run(job_id)
        row = max(self._rows.get(job_id, 0), run.step)
        self._reserve(job_id, row + 1)
        run.log({**metrics, STEP_METRIC: step, "_timestamp": at}, step=row, commit=True)
        if job_id in self._ended:  # a completed job's last evaluation comes after its end
            self.end_run(job_id, self._ended[job_id])

    def end_run(self, job_id: str, state: str) -> None:
        run = self._run(job_id)
        run.summary["state"] = state
        self._ended[job_id] = state
        self._finish(job_id, exit_code=0 if state == "completed" else 1)

    def close(self) -> None:
        # A job still running: this file of its run ends, the next `track` writes another.
        for job_id in list(self._runs):
            self._finish(job_id, exit_code=0)

    def _run(self, job_id: str) -> Run:
        """The job's open run, or the run opened again (its end written, an event came)."""
        run = self._runs.get(job_id)
        return run if run is not None else self._start(self._jobs[job_id])

    def _start(self, job: TrackedJob) -> Run:
        self.root.mkdir(parents=True, exist_ok=True)  # else W&B writes to a temporary dir
        run = self._wandb.init(
            project=PROJECT,
            id=job.job_id,
            name=job.job_id,
            resume="allow",
            reinit="create_new",  # a run per job, several open at once
            mode=self.mode,
            dir=self.root,
            config={**job.params, "tenant": job.tenant},
            tags=[tag[:TAG_MAX_CHARS] for tag in (job.tenant, job.env) if tag],
            settings=self._settings,
        )
        run.define_metric(STEP_METRIC)
        for pattern in ("train/*", "eval/*"):
            run.define_metric(pattern, step_metric=STEP_METRIC)
        self._runs[job.job_id] = run
        return run

    def _finish(self, job_id: str, exit_code: int) -> None:
        self._runs.pop(job_id).finish(exit_code=exit_code)

    def _reserve(self, job_id: str, next_row: int) -> None:
        """Saved before the row is logged: a `track` that dies after logging it must not
        log another row at the same step."""
        self._rows[job_id] = next_row
        temporary = self._rows_path.with_suffix(".tmp")
        temporary.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(self._rows))
        temporary.replace(self._rows_path)


def wandb_mode(text: str) -> WandbMode:
    """`offline` or `online`; ValueError for W&B's other modes (disabled, shared)."""
    for mode in WANDB_MODES:
        if text == mode:
            return mode
    raise ValueError(f"W&B mode {text!r}: `marlaas track` writes W&B offline or online")
