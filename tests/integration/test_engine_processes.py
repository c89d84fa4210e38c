"""A process holding vLLM's engine dies by `kill -9`: no engine process outlives it
(rollout_svc/vllm_children.py). Real vLLM CPU engine on the tiny random model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.models import tiny_model

HOLD_ENGINE = """
import asyncio, sys
from rollout_svc.engine import RolloutEngine

async def main() -> None:
    engine = RolloutEngine(sys.argv[1], max_loras=1, max_lora_rank=8)
    await engine.start()
    print("ready", flush=True)
    await asyncio.sleep(3600)

if __name__ == "__main__":  # vLLM's children are spawned: they re-import this file
    asyncio.run(main())
"""
GRACE_S = 30.0
"""Time the engine processes get to stop after their parent died (vLLM's shutdown)."""


def parent_of(pid: int) -> int | None:
    """The parent pid; None once the process is gone (a zombie counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])


def descendants(root: int) -> set[int]:
    found: set[int] = set()
    frontier = {root}
    while frontier:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        frontier = {p for p in pids if parent_of(p) in frontier} - found
        found |= frontier
    return found


def test_an_engine_outlives_no_kill_9_of_its_process(tmp_path: Path) -> None:
    script = tmp_path / "hold_engine.py"
    script.write_text(HOLD_ENGINE)
    holder = subprocess.Popen(
        [sys.executable, str(script), str(tiny_model())],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    engine_pids: set[int] = set()
    try:
        assert holder.stdout is not None
        # Until the engine is up or the holder died (pytest-timeout bounds it); vLLM logs to
        # stdout too.
        lines = []
        while (line := holder.stdout.readline()) and line.strip() != "ready":
            lines.append(line)
        assert line, "the engine did not start:\n" + "".join(lines[-20:])
        engine_pids = descendants(holder.pid)
        assert engine_pids, "vLLM runs its engine core in a child process"

        holder.send_signal(signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + GRACE_S
        while (alive := {p for p in engine_pids if parent_of(p) is not None}) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert not alive, f"engine processes {sorted(alive)} outlived their parent"
    finally:
        holder.kill()
        for pid in engine_pids:
            if parent_of(pid) is not None:
                os.kill(pid, signal.SIGKILL)
