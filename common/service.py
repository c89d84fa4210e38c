"""How every MARLaaS service runs: start, named tasks, stop; a crash stops all; graceful SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from typing import Any

from pydantic_settings import BaseSettings

log = logging.getLogger(__name__)


class Service(ABC):
    """A long-running process that only reads and writes Kafka topics (and Redis)."""

    name: str

    @abstractmethod
    async def start(self) -> None:
        """Connect and load; raise to refuse starting."""

    @abstractmethod
    def tasks(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The coroutines that make up the service, by name; none is expected to return."""

    @abstractmethod
    async def stop(self) -> None:
        """Commit what is durable, leave consumer groups, close connections."""

    @abstractmethod
    def request_stop(self) -> None:
        """Ask the tasks to wind down (e.g. stop polling); `stop()` follows."""


def log_settings(*settings: BaseSettings) -> None:
    for block in settings:
        log.info("%s: %s", type(block).__name__, block.model_dump_json())


async def run_service(service: Service, *, grace_s: float = 30.0) -> int:
    """Run until SIGTERM/SIGINT or until any task ends; returns the process exit code.

    A task that raises or returns stops the whole service (exit code 1): a half-working
    replica is worse than a restarted one.
    """
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    await service.start()
    tasks = {asyncio.create_task(coro, name=name) for name, coro in service.tasks().items()}
    signalled = asyncio.create_task(stopping.wait(), name="signal")
    done, _ = await asyncio.wait(tasks | {signalled}, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    for task in done - {signalled}:
        exit_code = 1
        if task.cancelled():
            log.error("%s: task %s was cancelled; stopping", service.name, task.get_name())
        elif (exc := task.exception()) is not None:
            log.error("%s: task %s crashed; stopping", service.name, task.get_name(), exc_info=exc)
        else:
            log.error("%s: task %s ended unexpectedly; stopping", service.name, task.get_name())
    log.info("%s: stopping (grace %.0fs)", service.name, grace_s)
    service.request_stop()
    try:
        await asyncio.wait_for(_drain(tasks), grace_s)
    except TimeoutError:
        log.warning("%s: tasks did not finish in %.0fs; cancelling them", service.name, grace_s)
    for task in tasks | {signalled}:
        task.cancel()
    await asyncio.gather(*tasks, signalled, return_exceptions=True)
    await service.stop()
    log.info("%s: stopped", service.name)
    return exit_code


async def _drain(tasks: set[asyncio.Task[None]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
