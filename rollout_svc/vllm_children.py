"""vLLM's engine processes die with the process that started them: a vLLM general plugin.

`AsyncLLM` runs its scheduler ("EngineCore") in a child process, which on a CPU starts one
more worker process (docs/architecture.md, "vLLM on CPU"). Nothing in vLLM 0.32 ends the
engine core when its parent dies without shutting it down (`kill -9`, an OOM kill, a test
runner stopped by SIGTERM): it lives on, reparented to PID 1, holding the model, its KV
cache and its share of the cores. The embedded stack restarts a rollout_svc that died, so
each crash would leave one more behind (found: a stopped test run left an EngineCore at 37%
of a core).

Loaded by vLLM in each of its processes (entry point `vllm.general_plugins`,
pyproject.toml). In the ones `multiprocessing` started (the engine core, its workers) a
daemon thread checks once a second that the parent is still the one that started it, and
sends the process SIGTERM when it is not; vLLM's engine core shuts down on SIGTERM, and its
workers on theirs or when their death pipe closes. (Not `PR_SET_PDEATHSIG`: it fires when
the *thread* that started the child ends, and rollout_svc builds the engine in a pool
thread.) The process that created the engine (rollout_svc, a test) is left as it is.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

PLUGIN_NAME = "marlaas_die_with_parent"
POLL_S = 1.0
_watching_in: int | None = None
"""The pid whose watcher runs (a forked child inherits this module's state, not the thread)."""


def register() -> None:
    """The plugin's entry point: in a vLLM child process, watch the parent."""
    global _watching_in
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None or _watching_in == os.getpid():
        return
    _watching_in = os.getpid()
    threading.Thread(
        target=_die_with, args=(parent.pid,), name="marlaas-parent-watch", daemon=True
    ).start()


def _die_with(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
