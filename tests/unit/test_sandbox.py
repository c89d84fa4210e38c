"""The code sandbox as an attacker would try it (issue 41): every program of
env_svc/sandbox/probes.py is hostile.

Each must be contained (the model reads why), leave no process behind, and keep the host's
secrets, files and network out of reach, while another job's episodes go on beside it. Needs
bubblewrap (`make test` installs it); as root, as in CI, each run has its own uid (the compose
run tries the same programs in env_svc's container, as its uid 1000).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from env_svc.calls import EnvCalls
from env_svc.envs.arithmetic import ArithmeticEnv
from env_svc.protocol import finish
from env_svc.sandbox import Sandbox, SandboxUnavailableError, python_tool
from env_svc.sandbox.probes import (
    CANARY,
    LIMITS,
    Bait,
    Probe,
    attempt,
    bait,
    probes,
    runs_processes,
)


@pytest.fixture(scope="module")
def baited() -> Iterator[Bait]:
    """A secret in this process's environment and a readable file of its own, as a real
    replica has (its Redis password, its state directory), a port it listens on and a process
    of its own."""
    with bait() as held_out:
        yield held_out


def hostile(held_out: Bait) -> dict[str, Probe]:
    return {probe.name: probe for probe in probes(held_out)}


@pytest.mark.parametrize("name", sorted(hostile(Bait(Path("x"), 0, 0))))
async def test_a_hostile_program_is_contained_and_leaves_nothing_behind(
    name: str, baited: Bait
) -> None:
    assert await attempt(hostile(baited)[name], Sandbox(LIMITS), baited) == []


async def test_other_episodes_complete_while_hostile_programs_run(
    baited: Bait,
) -> None:
    """Every hostile program at once on one replica's sandbox, and another job's episodes
    (a synchronous environment, in the replica's workers) all finish meanwhile."""
    sandbox = Sandbox(LIMITS, slots=16)
    programs = [probe.program for probe in hostile(baited).values()]
    env, calls = ArithmeticEnv(), EnvCalls(timeout_s=30, workers=4)
    finished: list[float] = []

    async def other_job() -> None:
        loop = asyncio.get_running_loop()
        for index in range(20):
            state, _ = env.reset(env.task_for(0, index))
            step = await calls.run("episode", partial(env.step, state, "12"))
            assert step.done and step.reward is not None
            finished.append(loop.time())

    try:
        results, _ = await asyncio.gather(
            asyncio.gather(*(sandbox.run_python(code) for code in programs)), other_job()
        )
        ended = asyncio.get_running_loop().time()
    finally:
        calls.close()
    assert len(finished) == 20
    assert max(finished) < ended  # while the sleeper, at least, still held its slot
    assert all(CANARY not in r.text() for r in results)
    assert runs_processes() == set()


def test_code_is_never_run_without_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = Sandbox(LIMITS)
    sandbox.bwrap = ""  # as on a machine without bubblewrap
    with pytest.raises(RuntimeError, match="needs bubblewrap"):
        python_tool(LIMITS, sandbox)
    with pytest.raises(RuntimeError, match="no code is run"):
        finish(sandbox.run_python("print(1)"), awaits=True)


async def test_a_plain_program_prints_and_its_directory_starts_empty() -> None:
    result = await Sandbox(LIMITS).run_python("import os\nprint(os.listdir('.'), 2 ** 100)")
    assert result.text() == "[] 1267650600228229401496703205376"


async def test_where_no_proc_can_be_mounted_runs_get_none_and_every_program_is_contained(
    baited: Bait,
) -> None:
    """In a container whose /proc has masked paths (Docker's), bubblewrap cannot mount a /proc
    of the run's own: the sandbox then gives runs none (never the container's)."""
    sandbox = Sandbox(LIMITS)
    sandbox.check()
    sandbox.proc = False  # as the first run found it in such a container
    for probe in hostile(baited).values():
        assert await attempt(probe, sandbox, baited) == [], probe.name
    assert "No such file" in (await sandbox.run_python("open('/proc/self/environ')")).text()


def test_a_sandbox_that_cannot_start_runs_nothing_and_says_why() -> None:
    sandbox = Sandbox(LIMITS)
    sandbox.bwrap = "/usr/bin/false"  # as bubblewrap refused by a seccomp profile
    with pytest.raises(SandboxUnavailableError, match=r"cannot start here.*no code is run"):
        python_tool(LIMITS, sandbox)


def test_as_one_uid_the_probes_count_an_escaped_daemon_and_not_a_neighbour() -> None:
    """Not root (env_svc's uid in a container), the probes count their own descendants
    (`runs_processes`): an orphan that left its parent still counts (they are its subreaper),
    a process of the same uid started beside them (the container's healthcheck) does not."""
    neighbour = subprocess.Popen(["sleep", "30"])
    found = subprocess.run(
        [sys.executable, "-c",
         "import os, subprocess\n"
         "from env_svc.sandbox.probes import _become_subreaper, _descendants\n"
         "_become_subreaper()\n"
         "daemon = subprocess.run(['sh', '-c', 'setsid sleep 30 >/dev/null 2>&1 & echo $!'],\n"
         "                        capture_output=True, text=True).stdout.strip()\n"
         "print(daemon, sorted(_descendants(os.getpid())))\n"
         "os.kill(int(daemon), 9)"],
        capture_output=True, text=True, check=True, timeout=30,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[2])},
    )  # fmt: skip
    neighbour.kill()
    daemon, counted = found.stdout.split(" ", 1)
    assert counted.strip() == f"[{daemon}]"
