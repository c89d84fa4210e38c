"""A process that started others dies by `kill -9`: none of them outlives it.

- vLLM's engine processes, started by whoever holds a `RolloutEngine`
  (rollout_svc/vllm_children.py); real vLLM CPU engine on the tiny random model.
- The embedded stack's children (broker, Redis, the services and their engine), started by
  whoever holds a `LocalStack` (console/stack/children.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.files.models import tiny_model
from tests.processes import alive, cmdline, descendants_of

HOLD_ENGINE = """
import asyncio, sys
from rollout_svc.engine import RolloutEngine
from rollout_svc.engine_settings import EngineSettings

async def main() -> None:
    engine = RolloutEngine(EngineSettings(sys.argv[1], max_loras=1, max_lora_rank=8))
    await engine.start()
    print("ready", flush=True)
    await asyncio.sleep(3600)

if __name__ == "__main__":  # vLLM's children are spawned: they re-import this file
    asyncio.run(main())
"""
HOLD_STACK = """
import asyncio, sys
from pathlib import Path
from common.runtime.config import SharedSettings
from common.wire.lifecycle import SERVICES
from console.stack.local import LocalStack

async def main() -> None:
    settings = SharedSettings(state_dir=Path(sys.argv[2]), base_model=sys.argv[1])
    async with LocalStack(settings, services=SERVICES, use_existing_from_env=False):
        print("ready", flush=True)
        await asyncio.sleep(3600)

if __name__ == "__main__":
    asyncio.run(main())
"""
GRACE_S = 60.0
"""Time the children get to stop after their parent died (the services stop gracefully)."""


def kill_9_leaves_nothing(script: str, *args: str, tmp_path: Path) -> None:
    """Run `script` until it prints "ready", kill it with SIGKILL, and check that every
    process it had started is gone within GRACE_S."""
    path = tmp_path / "holder.py"
    path.write_text(script)
    holder = subprocess.Popen(
        [sys.executable, str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    started: set[int] = set()
    try:
        assert holder.stdout is not None
        # Until it is up or it died (pytest-timeout bounds it); vLLM logs to stdout too.
        lines = []
        while (line := holder.stdout.readline()) and line.strip() != "ready":
            lines.append(line)
        assert line, "the holder did not start:\n" + "".join(lines[-20:])
        started = set(descendants_of(holder.pid))
        assert started, "the holder started no process"

        holder.send_signal(signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + GRACE_S
        while (living := {p for p in started if alive(p)}) and (time.monotonic() < deadline):
            time.sleep(0.5)
        names = {p: cmdline(p)[:100] for p in living}
        assert not living, f"processes outlived their parent by {GRACE_S:.0f}s: {names}"
    finally:
        holder.kill()
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_engine_outlives_no_kill_9_of_its_process(tmp_path: Path) -> None:
    kill_9_leaves_nothing(HOLD_ENGINE, str(tiny_model()), tmp_path=tmp_path)


def test_an_embedded_stack_outlives_no_kill_9_of_its_process(tmp_path: Path) -> None:
    """Issue 26's note: after a benchmark holding a stack was stopped, its services went on
    (vLLM generating) for minutes, reparented to PID 1."""
    state_dir = tmp_path / "state"
    kill_9_leaves_nothing(HOLD_STACK, str(tiny_model()), str(state_dir), tmp_path=tmp_path)
