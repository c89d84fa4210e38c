"""The code sandbox as an attacker would try it (issue 41): every program below is hostile.

Each must be contained (the model reads why), leave no process behind, and keep the host's
secrets, files and network out of reach, while another job's episodes go on beside it. Needs
bubblewrap (`make test` installs it); as root, as in CI, each run has its own uid.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from env_svc.calls import EnvCalls
from env_svc.envs.arithmetic import ArithmeticEnv
from env_svc.protocol import finish
from env_svc.sandbox import Sandbox, SandboxLimits, python_tool
from env_svc.sandbox.runner import MAX_SLOTS, _processes_of, sandbox_uid

CANARY = "marlaas-canary-7f3a"
LIMITS = SandboxLimits(cpu_s=2, wall_s=4.0, memory_bytes=256 * 2**20, output_bytes=4096)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A secret in env_svc's environment and a readable file of env_svc's, as a real
    replica has (its Redis password, its state directory)."""
    folder = tmp_path_factory.mktemp("env_svc_state")
    secret = folder / "redis.password"
    secret.write_text(CANARY)
    secret.chmod(0o644)
    os.environ["MARLAAS_TEST_CANARY"] = CANARY
    yield secret
    del os.environ["MARLAAS_TEST_CANARY"]


@pytest.fixture(scope="module")
def listener() -> Iterator[int]:
    """A port on the host's loopback, as the broker and Redis listen."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


def hostile(secret: Path, port: int) -> dict[str, tuple[str, str]]:
    """name -> (program, what the model must be told; alternatives split by |)."""
    return {
        "fork bomb": ("import os\nwhile True:\n    os.fork()", "Resource temporarily unavailable"),
        "thread bomb": (
            "import threading, time\n"
            "while True:\n    threading.Thread(target=time.sleep, args=(60,)).start()",
            "can't start new thread",
        ),
        "memory bomb": (
            "chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))",
            "MemoryError",
        ),
        # Its 2 s of CPU take longer than the 4 s wall clock on a loaded machine.
        "busy loop": ("while True:\n    pass", "killed: CPU time limit (2 s)|killed: wall-clock"),
        "sleeps past the limit": ("import time\ntime.sleep(3600)", "killed: wall-clock limit"),
        "prints gigabytes": ("while True:\n    print('x' * 65536)", "killed: output limit"),
        "daemon that outlives it": (
            "import os, time\n"
            "if os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\nprint('parent gone')",
            "parent gone",
        ),
        "reads env_svc's variables": (
            "import os\nprint(dict(os.environ))\n"
            "for pid in os.listdir('/proc'):\n"
            "    if pid.isdigit():\n"
            "        print(open(f'/proc/{pid}/environ', 'rb').read())",
            "'HOME': '/sandbox'",
        ),
        "reads env_svc's files": (
            f"print(open({str(secret)!r}).read())",
            "FileNotFoundError",
        ),
        "reads /etc": ("print(open('/etc/passwd').read())", "FileNotFoundError"),
        "opens a socket to the broker": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
            "ConnectionRefusedError",
        ),
        "reaches the internet": (
            "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
            "OSError: [Errno 101] Network is unreachable",
        ),
        "writes outside its directory": (
            "open('/usr/evil', 'w').write('x')",
            "OSError: [Errno 30] Read-only file system",
        ),
        "fills the disk": (
            "for i in range(1000):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)",
            "No space left on device",
        ),
        "kills env_svc": (
            f"import os\nos.kill({os.getpid()}, 9)",
            "ProcessLookupError",
        ),
    }


def processes_left() -> list[int]:
    return [pid for slot in range(MAX_SLOTS) for pid in _processes_of(sandbox_uid(slot))]


def nothing_written_outside() -> bool:
    return not Path("/usr/evil").exists()


@pytest.mark.parametrize("name", sorted(hostile(Path("x"), 0)))
async def test_a_hostile_program_is_contained_and_leaves_nothing_behind(
    name: str, secrets: Path, listener: int
) -> None:
    code, told = hostile(secrets, listener)[name]
    tool = python_tool(LIMITS)
    reply = await tool.fn(code=code)
    assert any(words in reply for words in told.split("|")), reply
    assert CANARY not in reply  # neither the variable nor the file
    assert processes_left() == []
    assert nothing_written_outside()


async def test_other_episodes_complete_while_hostile_programs_run(
    secrets: Path, listener: int
) -> None:
    """Every hostile program at once on one replica's sandbox, and another job's episodes
    (a synchronous environment, in the replica's workers) all finish meanwhile."""
    sandbox = Sandbox(LIMITS, slots=16)
    programs = [code for code, _ in hostile(secrets, listener).values()]
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
    assert processes_left() == []


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
