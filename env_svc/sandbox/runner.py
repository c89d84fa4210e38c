"""Model-written code in a sandbox: its own namespaces, an empty filesystem view, rlimits.

Each run is one `bwrap` (bubblewrap) process, started as a uid of its own when env_svc is
root (a pool of `SANDBOX_UID_BASE` + slot), in a new session and process group:

- **namespaces** (`--unshare-all`): its own network (no interface but a loopback no one
  listens on: neither the broker, Redis nor the internet is reachable), pids (it sees only
  its own processes; /proc is its own, or there is none where none can be mounted, as in a
  Docker container), IPC, UTS, cgroup and user namespaces;
- **system calls** (`--seccomp`, env_svc/sandbox/seccomp.py): no namespaces of its own, no
  mounts, ptrace, BPF, keyrings, io_uring, modules and the like;
- **filesystem**: nothing of the host but /usr read-only (the system's programs and
  libraries, where the interpreter comes from) and an empty tmpfs of `disk_bytes` as its
  working directory, gone with the run: no /etc, /home, /root, /work, no env_svc files,
  state or credentials, no /proc of other processes;
- **environment**: cleared (`--clearenv`): none of env_svc's variables; `python -I` ignores
  PYTHON* variables and the user's site directory;
- **rlimits**, set before bwrap starts and inherited: CPU seconds, address space, file size,
  open files, no core files; and processes, set inside (`LAUNCHER`): counted in the run's own
  user namespace, so a run as env_svc's own uid (not root, as in compose) is bounded too;
- **time and output**: past `wall_s`, or once stdout and stderr pass `output_bytes`, the
  whole group is killed (bwrap dies, its pid namespace's init with it, and the kernel kills
  every process left in the namespace); any process still running as the run's uid after
  that is killed too.

What it does not stop: reading what /usr holds (world-readable system files), spending the
CPU it is given (the host's scheduler shares it), and kernel exploits through the calls it
may still make. docs/architecture.md, "The code sandbox".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from env_svc.sandbox.seccomp import filter_program

log = logging.getLogger(__name__)

SANDBOX_UID_BASE = 1_000_000
MAX_SLOTS = 64
"""Run n (of this process's slots) runs as uid and gid `sandbox_uid(n)` when env_svc is root:
a range of its own per process (by pid, unique among live processes), so that two replicas on
one host neither share a process limit nor kill each other's runs."""
PYTHON = "/usr/bin/python3"
"""The interpreter inside: under /usr, the only part of the host the sandbox sees."""
LAUNCHER = (
    "import os, resource, sys\n"
    "n = int(sys.argv[1])\n"
    "resource.setrlimit(resource.RLIMIT_NPROC, (n, n))\n"
    "os.execv(sys.executable, [sys.executable, '-I', '-c', sys.argv[2]])"
)
"""Runs first inside the sandbox: the process limit, set in the run's own user namespace, counts
the run's processes only (the kernel keeps the count per user namespace), whichever uid runs
it, then the code in a fresh interpreter."""


class SandboxUnavailableError(RuntimeError):
    """This machine cannot isolate code (no bwrap, no user namespaces): nothing is run."""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
    """Address space (RLIMIT_AS); the interpreter alone takes ~30 MiB of it."""
    file_bytes: int = 16 * 2**20
    """Largest file it may write (RLIMIT_FSIZE)."""
    disk_bytes: int = 32 * 2**20
    """Size of its working directory (a tmpfs)."""
    processes: int = 16
    open_files: int = 64
    wall_s: float = 10.0
    output_bytes: int = 16 * 2**10
    """stdout and stderr together; past it the run is killed."""
    code_bytes: int = 64 * 2**10


@dataclass(frozen=True, slots=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """None when the sandbox killed it (`killed` says why)."""
    killed: str = ""
    """"wall-clock limit", "output limit" or "" (a limit the kernel enforces shows in the
    exit code and stderr: a signal, MemoryError, "File too large", ...)."""
    cpu_s: int = 0
    """The CPU limit it ran under (named when the kernel ended it for that)."""

    def text(self) -> str:
        """What the model reads: its output and, when it did not end well, why."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(f"stderr:\n{self.stderr.rstrip()}")
        if self.killed:
            parts.append(f"killed: {self.killed}")
        elif self.exit_code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
            parts.append(f"killed: CPU time limit ({self.cpu_s} s)")
        elif self.exit_code:
            parts.append(f"exit code {self.exit_code}{_signal_name(self.exit_code)}")
        return "\n".join(parts) if parts else "(no output)"


class Sandbox:
    """Runs code, at most `slots` runs at once (each its own uid when root). One per process
    (`shared_sandbox`): runs of every job draw on the same uids."""

    def __init__(self, limits: SandboxLimits | None = None, *, slots: int = 16) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in [1, {MAX_SLOTS}], not {slots}")
        self.limits = limits or SandboxLimits()
        self._free = set(range(slots))
        self.bwrap = shutil.which("bwrap") or ""
        self.proc = True
        """Whether runs get a /proc of their own. Off where none can be mounted (a container
        whose /proc has masked paths, as Docker's are): the runs then have no /proc at all,
        never the container's."""
        self._filter = b""
        """The code's own seccomp filter (env_svc/sandbox/seccomp.py), set by `check`."""
        self._trial: str | None = None
        """None: not tried yet; "": a run starts here; else why none does."""
        self._trial_lock = threading.Lock()

    def check(self) -> None:
        """Raise `SandboxUnavailableError` unless code can be run isolated here: bubblewrap,
        the interpreter, and a first run that starts (tried once, before any other)."""
        if not self.bwrap:
            raise SandboxUnavailableError(
                "the code sandbox needs bubblewrap (`apt-get install bubblewrap`); "
                "no code is run without it"
            )
        if not Path(PYTHON).exists():
            raise SandboxUnavailableError(f"the code sandbox needs {PYTHON} (Debian's python3)")
        with self._trial_lock:
            if self._trial is None:
                try:
                    self._filter = filter_program()
                except ValueError as exc:
                    self._trial = f"{exc}; no code is run"
                else:
                    self._trial = self._try_a_run()
        if self._trial:
            raise SandboxUnavailableError(self._trial)

    def _try_a_run(self) -> str:
        """Start `true` in the sandbox, with a /proc of its own, else without one: "" when it
        runs, else bubblewrap's reason. No run is in flight meanwhile (`check` comes first)."""
        root = os.geteuid() == 0
        refused = ""
        for proc in (True, False):
            self.proc = proc
            with self._filter_fd() as fd:
                done = subprocess.run(
                    self._bwrap_argv(["/usr/bin/true"], self.limits, fd),
                    env={},
                    capture_output=True,
                    text=True,
                    timeout=30,
                    pass_fds=(fd,),
                    preexec_fn=_confine(self.limits, sandbox_uid(0) if root else None),
                )
            if done.returncode == 0:
                if refused:
                    log.warning("code sandbox: %s; its runs get no /proc", refused)
                return ""
            refused = done.stderr.strip()[-300:]
            if "proc" not in refused:
                break
        return (
            f"the code sandbox cannot start here: {refused} (in a container, env_svc needs the "
            "seccomp profile deploy/seccomp/env-sandbox.json); no code is run"
        )

    async def run_python(self, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
        """Run `code` with `python3 -I` under `limits` (default: this sandbox's); never
        raises for what the code does."""
        self.check()
        limits = limits or self.limits
        if len(code.encode()) > limits.code_bytes:
            return SandboxResult("", "", None, f"code over {limits.code_bytes} bytes")
        while not self._free:  # noqa: ASYNC110 - every uid in use; a process-wide object, no loop-bound primitive
            await asyncio.sleep(0.01)
        slot = min(self._free)
        self._free.discard(slot)
        try:
            command = [PYTHON, "-I", "-c", LAUNCHER, str(limits.processes), code]
            return await self._run(command, sandbox_uid(slot), limits)
        finally:
            self._free.add(slot)

    async def _run(self, command: list[str], uid: int, limits: SandboxLimits) -> SandboxResult:
        root = os.geteuid() == 0
        with self._filter_fd() as fd:
            process = await asyncio.create_subprocess_exec(
                *self._bwrap_argv(command, limits, fd),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={},
                start_new_session=True,
                pass_fds=(fd,),
                preexec_fn=_confine(limits, uid if root else None),
            )
        budget = [limits.output_bytes]
        out: list[bytes] = []
        err: list[bytes] = []
        killed = ""
        try:
            async with asyncio.timeout(limits.wall_s):
                await asyncio.gather(
                    _read(process, process.stdout, budget, out),
                    _read(process, process.stderr, budget, err),
                )
                await process.wait()
            if budget[0] < 0:
                killed = f"output limit ({limits.output_bytes} bytes)"
        except TimeoutError:
            killed = f"wall-clock limit ({limits.wall_s:g} s)"
        finally:
            await _kill(process, uid if root else None)
        return SandboxResult(
            b"".join(out)[: limits.output_bytes].decode(errors="replace"),
            b"".join(err)[: limits.output_bytes].decode(errors="replace"),
            None if killed else process.returncode,
            killed,
            cpu_s=limits.cpu_s,
        )

    @contextlib.contextmanager
    def _filter_fd(self) -> Iterator[int]:
        """A pipe's read end holding the code's seccomp filter, for bubblewrap to read."""
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, self._filter)  # a few hundred bytes: within a pipe's buffer
            os.close(write_end)
            yield read_end
        finally:
            os.close(read_end)

    def _bwrap_argv(self, command: list[str], limits: SandboxLimits, filter_fd: int) -> list[str]:
        argv = [self.bwrap, "--die-with-parent", "--new-session", "--unshare-all", "--as-pid-1"]
        # A user namespace always (not only "try"); the code's own filter refuses it any
        # namespace, mount or other call it has no use for (env_svc/sandbox/seccomp.py).
        argv += ["--unshare-user", "--seccomp", str(filter_fd), "--clearenv"]
        argv += ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            target = Path("/") / link
            if target.is_symlink():  # merged /usr (Debian 12): the same links inside
                argv += ["--symlink", os.readlink(target), f"/{link}"]
            elif target.is_dir():
                argv += ["--ro-bind", str(target), f"/{link}"]
        argv += ["--proc", "/proc", "--dev", "/dev"] if self.proc else ["--dev", "/dev"]
        argv += [
            "--size",
            str(self.limits.disk_bytes),
            "--tmpfs",
            "/sandbox",
            "--chdir",
            "/sandbox",
        ]
        argv += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox"]
        argv += ["--setenv", "LANG", "C.UTF-8", "--"]
        return argv + command


def sandbox_uid(slot: int, pid: int | None = None) -> int:
    """The uid of a process's run in `slot` (default: this process's)."""
    return SANDBOX_UID_BASE + (os.getpid() if pid is None else pid) * MAX_SLOTS + slot


_SHARED: Sandbox | None = None


def shared_sandbox() -> Sandbox:
    """This process's sandbox."""
    global _SHARED
    if _SHARED is None:
        _SHARED = Sandbox()
    return _SHARED


def _confine(limits: SandboxLimits, uid: int | None) -> Callable[[], None]:
    """What the child does before it becomes bwrap: rlimits, and its own uid when root."""

    def confine() -> None:
        for which, value in (
            (resource.RLIMIT_AS, limits.memory_bytes),
            (resource.RLIMIT_FSIZE, limits.file_bytes),
            (resource.RLIMIT_NOFILE, limits.open_files),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(which, (value, value))
        # SIGXCPU at the limit, SIGKILL a second later if it is caught.
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))

    return confine


async def _read(
    process: asyncio.subprocess.Process,
    stream: asyncio.StreamReader | None,
    budget: list[int],
    into: list[bytes],
) -> None:
    """Read `stream` to its end into `into`; once both streams together pass the budget,
    kill the run (both streams then end) and keep nothing more."""
    assert stream is not None
    while chunk := await stream.read(4096):
        if budget[0] < 0:
            continue  # killed: read on to the end, or the pipe (and wait()) stays open
        budget[0] -= len(chunk)
        into.append(chunk)
        if budget[0] < 0:
            _kill_group(process)


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """Kill what runs inside: bwrap's child is pid 1 of the run's pid namespace, and the
    kernel kills every process of a namespace whose pid 1 dies. bwrap, still alive, reaps
    it and exits (killed first, it would leave its child to the host's init, a zombie
    until that reaps it). Without a child (not started yet, or gone) the group is killed."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    try:
        inside = [int(pid) for pid in children.read_text().split()]
    except (OSError, ValueError):
        inside = []
    for pid in inside:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not inside:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


async def _kill(process: asyncio.subprocess.Process, uid: int | None) -> None:
    """Kill the run (`_kill_group`), let its pipes end and bwrap exit (killed outright
    after 2 s), then kill any process still running as the run's uid."""
    if process.returncode is None:
        _kill_group(process)
    for stream in (process.stdout, process.stderr):
        if stream is not None:  # unread output would keep the pipe, and wait(), open
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    while await stream.read(65536):
                        pass
    try:
        async with asyncio.timeout(2):
            await process.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
    if uid is not None:
        for _ in range(50):
            left = _processes_of(uid)
            if not left:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.02)
        log.error("sandbox uid %d: processes %s outlived the run", uid, left)


def _processes_of(uid: int) -> list[int]:
    """Pids of the live (not zombie) processes running as `uid`."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                status = Path(entry.path, "status").read_text()
                uids = next(line for line in status.splitlines() if line.startswith("Uid:"))
                if int(uids.split()[1]) == uid and "\nState:\tZ" not in status:
                    found.append(int(entry.name))
    return found


def _signal_name(exit_code: int) -> str:
    """bwrap reports a child killed by signal n as 128 + n."""
    if exit_code > 128:
        with contextlib.suppress(ValueError):
            return f" ({signal.Signals(exit_code - 128).name})"
    return ""
