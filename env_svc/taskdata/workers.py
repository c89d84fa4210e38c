"""Child processes that run what env_svc must not run in its own: code whose time limit needs a
main thread (`math-verify` times itself out with `signal.alarm`, which fails in the worker
threads env_svc scores in) or whose memory a tenant's file decides (a parquet or arrow file
compresses far better than 64 MiB suggests).

A `Child` is one spawned process serving calls one at a time over a pipe, with an address-space
limit set before it imports anything; a call that outlives its deadline kills it (the next
call starts a fresh one), so a runaway sympy expression or decompression costs one call, never
a thread of env_svc. A child is `python -m env_svc.taskdata.workers` (not multiprocessing's
spawn, which imports the parent's main module again) and reads its calls from its stdin: it
ends when env_svc does, at the end of the call it is in.
"""

from __future__ import annotations

import logging
import os
import pickle
import resource
import select
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!Q")


class ChildTimeoutError(TimeoutError):
    """The call ran past its deadline; the child was killed."""


class ChildFailedError(RuntimeError):
    """The child died (e.g. out of its memory limit) or its call raised."""


class Child:
    """One child process (`python -m env_svc.taskdata.workers`) running `fn(*args)` per call;
    `memory_bytes` caps its address space. Started on the first call, and again after a kill."""

    def __init__(self, name: str, memory_bytes: int) -> None:
        self.name = name
        self.memory_bytes = memory_bytes
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[..., Any], *args: Any, deadline_s: float) -> Any:
        """`fn(*args)` in the child (`fn` importable by name); raises ChildTimeoutError past
        `deadline_s`, ChildFailedError when the child died or `fn` raised (its type and text)."""
        with self._lock:
            process = self._started()
            assert process.stdin is not None and process.stdout is not None
            try:
                _send(process.stdin, (fn, args))
                ready, _, _ = select.select([process.stdout], [], [], deadline_s)
                if ready:
                    ok, value = _receive(process.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                self.stop()
                raise ChildFailedError(f"{self.name}: the process died") from None
            if not ready:
                self.stop()
                raise ChildTimeoutError(f"{self.name}: past its {deadline_s:g} s")
            if not ok:
                raise ChildFailedError(value)
            return value

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(5)
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    stream.close()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is not None and self._process.poll() is None:
            return self._process
        self.stop()
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        log.debug("%s: started (pid %s)", self.name, self._process.pid)
        return self._process


class Pool:
    """`size` children taken in turn by calls from any thread; a call waits for a free one."""

    def __init__(self, name: str, size: int, memory_bytes: int) -> None:
        self._free = [Child(f"{name}-{index}", memory_bytes) for index in range(size)]
        self._ready = threading.Condition()

    def call(self, fn: Callable[..., Any], *args: Any, deadline_s: float) -> Any:
        with self._ready:
            self._ready.wait_for(lambda: bool(self._free))
            child = self._free.pop()
        try:
            return child.call(fn, *args, deadline_s=deadline_s)
        finally:
            with self._ready:
                self._free.append(child)
                self._ready.notify()


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    (length,) = _LENGTH.unpack(head)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError
    return pickle.loads(data)


def _serve(memory_bytes: int) -> None:
    """The child's loop: its memory capped first, then each call answered (ok, value) on the
    pipe that was stdout (what the code it runs prints goes to stderr)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    calls, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while True:
        try:
            fn, args = _receive(calls)
        except EOFError:
            return
        try:
            reply: tuple[bool, Any] = (True, fn(*args))
        except Exception as exc:  # the caller gets the type and the text
            reply = (False, _reason(exc))
        _send(replies, reply)


def _reason(exc: BaseException) -> str:
    """What went wrong, in a line: running out of memory wherever in the chain of causes it
    happened (libraries wrap it), else the exception's type and text."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, MemoryError):
            return f"ran out of its memory limit ({type(cause).__name__})"
        cause = cause.__cause__ or cause.__context__
    return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
