"""What a person watching sees as it happens: the live board on a terminal, one line per
step, evaluation and state change off one (a log, CI, a container)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live

from console.status.board import StatusBoard, StatusSnapshot
from console.status.render import render


async def live_view(
    board: StatusBoard,
    console: Console,
    *,
    until_done: bool,
    interval_s: float = 2.0,
    timeout_s: float | None = None,
) -> StatusSnapshot:
    """Refresh the view until Ctrl-C, or (until_done) until every job has ended and the
    final evaluations of completed ones are in.

    Raises TimeoutError when `timeout_s` passes first.

    Off a terminal (a pipe, a log file, a container) a live table would show only at the end:
    there each job's steps, evaluations and state changes are printed as lines instead.
    """
    detail = board.job_ids is not None and len(board.job_ids) == 1
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    snapshot = await board.snapshot()
    progress_log = None if console.is_terminal else ProgressLog()
    with contextlib.ExitStack() as screen:
        live = None
        if progress_log is None:
            live = screen.enter_context(
                Live(render(snapshot, detail=detail), console=console, auto_refresh=False)
            )
        while True:
            if progress_log is not None:
                for line in progress_log.new_lines(snapshot):
                    console.print(line, highlight=False, soft_wrap=True, markup=False)
            if until_done and all(row.progress.reported for row in snapshot.jobs):
                break
            if deadline is not None and time.monotonic() > deadline:
                pending = [r.progress.job_id for r in snapshot.jobs if not r.progress.reported]
                raise TimeoutError(f"jobs not finished after {timeout_s:.0f}s: {pending}")
            await asyncio.sleep(interval_s)
            snapshot = await board.snapshot()
            if live is not None:
                live.update(render(snapshot, detail=detail), refresh=True)
    return snapshot


@dataclass
class ProgressLog:
    """What changed since the last snapshot, as log lines: one per trained step, evaluation
    and state change of each job (`HH:MM:SS job: ...`)."""

    _steps: dict[str, int] = field(default_factory=dict)
    _evals: dict[str, set[int]] = field(default_factory=dict)
    _states: dict[str, str] = field(default_factory=dict)

    def new_lines(self, snapshot: StatusSnapshot) -> list[str]:
        lines = []
        for row in snapshot.jobs:
            p = row.progress
            clock = time.strftime("%H:%M:%S", time.localtime(snapshot.taken_at))
            if self._states.get(p.job_id) != row.state:
                self._states[p.job_id] = row.state
                reason = f": {p.reason}" if p.reason else ""
                lines.append(f"{clock} {p.job_id}: {row.state}{reason}")
            for index in range(self._steps.get(p.job_id, 0), len(p.rewards)):
                lines.append(
                    f"{clock} {p.job_id}: step {index + 1}/{p.max_steps} "
                    f"mean reward {p.rewards[index]:.3f}"
                )
            self._steps[p.job_id] = len(p.rewards)
            seen = self._evals.setdefault(p.job_id, set())
            for version in sorted(set(p.evals) - seen):
                metrics = p.evals[version]
                lines.append(
                    f"{clock} {p.job_id}: eval v{version} accuracy "
                    f"{metrics.get('eval_accuracy', 0.0):.3f} "
                    f"±{metrics.get('eval_accuracy_stderr', 0.0):.3f}"
                )
                seen.add(version)
        return lines
