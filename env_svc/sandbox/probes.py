"""The code sandbox as an attacker would try it: hostile programs, and what each must get.

    python -m env_svc.sandbox.probes        # in env_svc's image, host or container

runs every probe in this process's sandbox and prints, for each, `contained` or what went
wrong; it exits 1 if any was not contained. An operator's check of a host or an image: the
compose run (tests/compose/) runs it in env_svc's container, as its uid and under its seccomp
profile; tests/unit/test_sandbox.py runs each probe on the test machine (as root there).

A probe is contained when the model is told what stopped it, neither the canary variable in
the process's environment nor the canary file beside it shows in its output, nothing was
written outside its directory, and no process of its outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from env_svc.sandbox.runner import (
    MAX_SLOTS,
    Sandbox,
    SandboxLimits,
    SandboxUnavailableError,
    _processes_of,
    sandbox_uid,
)
from env_svc.sandbox.seccomp import ARCHES
from env_svc.sandbox.tool import python_tool

CANARY = "marlaas-canary-7f3a"
CANARY_VARIABLE = "MARLAAS_SANDBOX_CANARY"
LIMITS = SandboxLimits(cpu_s=2, wall_s=4.0, memory_bytes=256 * 2**20, output_bytes=4096)
RISKY_CALLS: tuple[str, ...] = ("ptrace", "bpf", "io_uring_setup", "mount", "keyctl")
RISKY_CALLS += ("perf_event_open", "userfaultfd", "setns", "init_module", "process_vm_readv")
RISKY = {arch: {n: spec.numbers[n] for n in RISKY_CALLS} for arch, spec in ARCHES.items()}
"""Calls the code has no use for, by number on each architecture: each must fail with EPERM."""
OUTSIDE = Path("/usr/evil")
"""Where the probe that writes outside its directory tries to."""


@dataclass(frozen=True, slots=True)
class Probe:
    name: str
    program: str
    told: tuple[str, ...]
    """The reply must hold one of these (what the model is told)."""


@dataclass(frozen=True, slots=True)
class Bait:
    secret: Path
    """A readable file of the process's own, holding `CANARY` (as env_svc's credentials)."""
    port: int
    """A port it listens on, on the loopback (as the broker and Redis do)."""
    victim: int
    """The pid of a process of its own (as env_svc is) that no run may kill."""


RESOURCE_PROBES: dict[str, tuple[str, str]] = {
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
}
"""Programs that exhaust a resource, by name: each with what the model must be told (one of
several, split by `|`)."""


def _escape_probes(bait: Bait) -> dict[str, tuple[str, str]]:
    """Programs that reach for what is outside the sandbox: `bait`'s secrets, its port, its
    process, the host's files, network and kernel."""
    secret, port = bait.secret, bait.port
    return {
        "reads env_svc's variables": (
            "import os\nprint(dict(os.environ))\n"
            "for pid in os.listdir('/proc'):\n"
            "    if pid.isdigit():\n"
            "        print(open(f'/proc/{pid}/environ', 'rb').read())",
            "'HOME': '/sandbox'",
        ),
        "reads env_svc's files": (f"print(open({str(secret)!r}).read())", "FileNotFoundError"),
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
            f"open({str(OUTSIDE)!r}, 'w').write('x')",
            "OSError: [Errno 30] Read-only file system",
        ),
        "fills the disk": (
            "for i in range(1000):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)",
            "No space left on device",
        ),
        "escapes into a namespace of its own": (
            "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "if libc.unshare(0x10000000):  # CLONE_NEWUSER: root in it, the kernel's ns code\n"
            "    print('refused', os.strerror(ctypes.get_errno()))",
            "refused Operation not permitted",
        ),
        "calls the kernel's riskier interfaces": (
            "import ctypes, os, platform\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"numbers = {RISKY!r}[platform.machine()]\n"
            "refused = [n for n, nr in numbers.items()\n"
            "           if libc.syscall(nr, 0, 0, 0, 0, 0) == -1 and ctypes.get_errno() == 1]\n"
            "print(f'refused {len(refused)} of {len(numbers)}')",
            f"refused {len(RISKY_CALLS)} of {len(RISKY_CALLS)}",
        ),
        "kills env_svc": (f"import os\nos.kill({bait.victim}, 9)", "ProcessLookupError"),
    }


def probes(bait: Bait) -> list[Probe]:
    """The hostile programs, against what `bait` holds out."""
    listed = RESOURCE_PROBES | _escape_probes(bait)
    return [Probe(name, code, tuple(told.split("|"))) for name, (code, told) in listed.items()]


@contextlib.contextmanager
def bait() -> Iterator[Bait]:
    """A secret in this process's environment and a readable file of its own (as env_svc's
    credentials and state), a port it listens on, and a process of its own."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    os.environ[CANARY_VARIABLE] = CANARY
    try:
        with tempfile.TemporaryDirectory(prefix="env_svc_state") as folder:
            secret = Path(folder) / "redis.password"
            secret.write_text(CANARY)
            secret.chmod(0o644)
            yield Bait(secret, server.getsockname()[1], victim.pid)
    finally:
        del os.environ[CANARY_VARIABLE]
        victim.kill()
        victim.wait()
        server.close()


def runs_processes() -> set[int]:
    """Processes that may be a run's: of the runs' uids when root, else this process's live
    descendants (`main` makes it their subreaper, so an orphan that escaped its run is one).
    Not every process of this uid: in a container, the healthcheck's own `python -c` runs as
    env_svc's uid too, started and ended on its own clock."""
    if os.geteuid() == 0:
        return {pid for slot in range(MAX_SLOTS) for pid in _processes_of(sandbox_uid(slot))}
    return _descendants(os.getpid())


def _descendants(root: int) -> set[int]:
    """Live (not zombie) processes below `root`, from each process's parent in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                state, parent = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[:2]
                if state != "Z":
                    children.setdefault(int(parent), []).append(int(entry.name))
    found: set[int] = set()
    below = children.get(root, [])
    while below:
        pid = below.pop()
        found.add(pid)
        below += children.get(pid, [])
    return found


def _become_subreaper() -> None:
    """Orphans of this process's descendants become its children, not init's (Linux
    PR_SET_CHILD_SUBREAPER), so `runs_processes` still finds a daemon that left its run."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


async def attempt(
    probe: Probe, sandbox: Sandbox, bait: Bait, limits: SandboxLimits = LIMITS
) -> list[str]:
    """Run `probe`; what went wrong ([] when contained)."""
    before = runs_processes()
    reply = await python_tool(limits, sandbox).fn(code=probe.program)
    problems = []
    if not any(told in reply for told in probe.told):
        problems.append(f"not told {' or '.join(map(repr, probe.told))}: {reply[-300:]!r}")
    if CANARY in reply:
        problems.append("a secret leaked into its output")
    if await asyncio.to_thread(OUTSIDE.exists):
        problems.append(f"wrote {OUTSIDE}")
    if left := runs_processes() - before - {bait.victim}:
        problems.append(f"processes left behind: {sorted(left)}")
    if not _alive(bait.victim):
        problems.append(f"killed process {bait.victim} of its host")
    return problems


async def attempt_all(sandbox: Sandbox) -> dict[str, list[str]]:
    with bait() as held_out:
        return {probe.name: await attempt(probe, sandbox, held_out) for probe in probes(held_out)}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def main() -> int:
    _become_subreaper()
    sandbox = Sandbox(LIMITS)
    try:
        sandbox.check()
    except SandboxUnavailableError as exc:
        print(f"no sandbox here: {exc}")
        return 1
    outcomes = asyncio.run(attempt_all(sandbox))
    for name, problems in outcomes.items():
        print(f"{name:40} {'; '.join(problems) or 'contained'}")
    escaped = [name for name, problems in outcomes.items() if problems]
    print(f"{len(outcomes) - len(escaped)} of {len(outcomes)} hostile programs contained")
    return 1 if escaped else 0


if __name__ == "__main__":
    sys.exit(main())
