"""The embedded stack's child processes: start them, watch them, restart them, stop them.

Children get SIGTERM if this process dies, so none is left behind. `Supervisor` keeps them
running as compose's `restart: unless-stopped` does: a service that exits (a crash, an OOM
kill, a `kill -9`) is started again after a back-off that grows with its recent restarts, so
one service's crash no longer stops every tenant's jobs. A child that keeps failing fast
(`max_restarts` within `window_s`) is given up with its last log lines: that is a bug to fix,
not a blip to ride out; so is a child that cannot be restarted (the in-memory broker: a new
one would have lost every topic).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

from common.files.artifacts import PRIVATE_FILE, PRIVATE_UMASK
from common.runtime.backoff import Backoff

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class StackError(RuntimeError):
    """The local stack could not start; the message says which part and why."""


_LOWEST_PORT = 10_000
"""Ports handed out lie between this and the kernel's ephemeral range."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody holds right now, below the ephemeral range.

    A port is picked here and bound later by the process that serves on it (rollout_svc binds
    its chat port after its engine has started, ~20 s on). A port from the ephemeral range
    (what binding port 0 gives) can meanwhile become the local end of any outbound connection,
    a service's Kafka or Redis client, and then nobody can listen on it (CI saw `marlaas up`'s
    rollout_svc fail to bind its chat port five times running). The kernel never picks a port
    below that range on its own, so only another explicit bind can take one there."""
    low, _ = _ephemeral_range()
    for _ in range(64):
        port = random.randrange(_LOWEST_PORT, low) if low > _LOWEST_PORT + 1000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise StackError(f"no free TCP port on 127.0.0.1 between {_LOWEST_PORT} and {low}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGTERM when we die.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ChildServer:
    """A server process this stack started."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _log_file: IO[bytes] = field(repr=False)
    metrics_url: str | None = None
    """Where a service serves /metrics, /healthz and /readyz; None for the servers."""
    respawn: Callable[[], ChildServer] | None = field(default=None, repr=False)
    """Starts a replacement with the same command and settings; None: cannot be restarted
    (the in-memory broker would come back empty)."""

    def check_alive(self) -> None:
        if (code := self.process.poll()) is not None:
            raise StackError(
                f"{self.name} exited with code {code}; last log lines:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close_log(self) -> None:
        self._log_file.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", self.name, timeout_s)
                self.process.kill()
                self.process.wait()
        self._log_file.close()


def spawn(
    name: str,
    argv: list[str],
    log_path: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> ChildServer:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(  # the child's log, closed by ChildServer
        os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE), "ab"
    )
    process = subprocess.Popen(
        argv,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=env,
        umask=PRIVATE_UMASK,
        preexec_fn=_die_with_parent,
    )
    log.info("started %s (pid %d), log %s", name, process.pid, log_path)
    return ChildServer(name, process, log_path, log_file)


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    """Restarts of one child within `window_s` before the stack gives up on it."""
    window_s: float = 120.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0


class Supervisor:
    """Watches `children` (a list it updates in place: a restarted child replaces the dead
    one) until cancelled; raises StackError when it gives up on one."""

    def __init__(
        self,
        children: list[ChildServer],
        policy: RestartPolicy | None = None,
        *,
        on_restart: Callable[[str], Awaitable[None]] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self.children = children
        self.policy = policy or RestartPolicy()
        self.restarts: dict[str, int] = {}
        self._recent: dict[str, list[float]] = {}
        self._on_restart = on_restart
        self._poll_s = poll_s

    async def run(self) -> None:
        while True:
            for index, child in enumerate(list(self.children)):
                code = child.process.poll()
                if code is not None:
                    self.children[index] = await self._restart(child, code)
            await asyncio.sleep(self._poll_s)

    async def _restart(self, child: ChildServer, code: int) -> ChildServer:
        if child.respawn is None:
            child.check_alive()  # raises StackError with its log tail
        now = time.monotonic()
        recent = [t for t in self._recent.get(child.name, []) if now - t < self.policy.window_s]
        if len(recent) >= self.policy.max_restarts:
            raise StackError(
                f"{child.name} exited (code {code}) {len(recent) + 1} times within "
                f"{self.policy.window_s:.0f}s; not restarting it again. Last log lines:\n"
                f"{child.log_tail()}"
            )
        backoff = Backoff(self.policy.first_delay_s, self.policy.max_delay_s, jitter=0.0)
        backoff.failures = len(recent)
        delay = backoff.next_delay()
        log.warning(
            "%s exited with code %d; restarting it in %.0fs (restart %d)",
            child.name,
            code,
            delay,
            self.restarts.get(child.name, 0) + 1,
        )
        await asyncio.sleep(delay)
        child.close_log()
        assert child.respawn is not None
        replacement = child.respawn()
        self._recent[child.name] = [*recent, time.monotonic()]
        self.restarts[child.name] = self.restarts.get(child.name, 0) + 1
        if self._on_restart is not None:
            try:
                await self._on_restart(child.name)
            except Exception as exc:  # counting restarts must never stop the supervision
                log.warning("restart of %s not counted: %r", child.name, exc)
        return replacement


T = TypeVar("T")


async def unless_stack_fails(work: Awaitable[T], watch: Awaitable[None]) -> T:
    """The result of `work`, unless `watch` (the stack's supervision, or a check of its
    children while it starts) raises first; `watch` is cancelled either way."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(watch)
    done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    watch_task.cancel()
    if work_task not in done:
        work_task.cancel()
        watch_task.result()  # raises the supervisor's StackError
    return work_task.result()
