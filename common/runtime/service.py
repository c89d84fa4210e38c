"""How every MARLaaS service runs: start, named tasks, stop; a crash stops all; graceful SIGTERM.

Every service also serves /metrics, /healthz and /readyz (common/runtime/health.py) on its metrics
port, from before `start()` (a long model load shows as alive but not ready) to after `stop()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from pydantic_settings import BaseSettings

from common.bus.kafka import ConsumerLoop, Handler, Producer
from common.bus.sender import Sender
from common.files.artifacts import PRIVATE_UMASK
from common.runtime.backoff import is_transient, retry_transient
from common.runtime.config import SettingsError, SharedSettings, load
from common.runtime.hardware import Hardware, Precision
from common.runtime.health import HealthServer
from common.runtime.logs import setup_logging
from common.security.access import redacted
from common.state.store import RedisStore
from common.wire.lifecycle import CONSUMED_TOPICS
from common.wire.messages import Message

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
S = TypeVar("S", bound=BaseSettings)


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

    @abstractmethod
    async def readiness(self) -> dict[str, bool]:
        """Each dependency's check by name (Kafka, Redis, the model): all True means ready.

        Called by /readyz at any time, also before `start()` finished and after `stop()`,
        so it must read what is not there yet as not ready, never raise.
        """


class Connections:
    """A service's Kafka producer and Redis store.

    Given ones (handler tests: an in-memory bus, a store over fakeredis) are used as they are
    and left open; otherwise `open()` connects to the deployment's Kafka and Redis, retrying
    for up to `connect_timeout_s`, and `close()` disconnects.
    """

    def __init__(
        self,
        shared: SharedSettings,
        client_id: str,
        *,
        producer: Sender | None = None,
        store: RedisStore | None = None,
    ) -> None:
        self._shared = shared
        self._kafka = (
            None
            if producer
            else Producer(
                shared.kafka_bootstrap,
                client_id=client_id,
                wire_schema=shared.wire_schema,
                signing=shared.signer,
            )
        )
        self.producer: Sender = producer or self._kafka  # type: ignore[assignment]
        self.store = store
        """None until `open()` connected it (readiness probes read that as not ready)."""
        self._owns_store = store is None

    async def open(self) -> None:
        if self.store is None:
            self.store = await RedisStore.connect(
                self._shared.redis_url, timeout_s=self._shared.connect_timeout_s
            )
        if self._kafka is not None:
            await self._kafka.start(timeout_s=self._shared.connect_timeout_s)

    async def close(self) -> None:
        if self._kafka is not None:
            await self._kafka.stop()
        if self.store is not None and self._owns_store:
            await self.store.close()

    def require_store(self) -> RedisStore:
        if self.store is None:
            raise RuntimeError("the service has not started: no store yet")
        return self.store

    async def consume(
        self, service: str, group_id: str, handler: Handler[M], **options: Any
    ) -> ConsumerLoop[M]:
        """Join `group_id` on the topics `service` consumes (common/wire/lifecycle.py), handing
        each message to `handler`; dead letters go out through this producer. `options` are
        `ConsumerLoop`'s (revocation callback, sticky assignment)."""
        loop = ConsumerLoop(
            bootstrap=self._shared.kafka_bootstrap,
            group_id=group_id,
            topics=CONSUMED_TOPICS[service],
            handler=handler,
            dead_letters=self.producer,
            service=service,
            session_timeout_s=self._shared.consumer_session_timeout_s,
            signing=self._shared.signer,
            **options,
        )
        await loop.start(timeout_s=self._shared.connect_timeout_s)
        return loop

    async def send(self, message: Message) -> None:
        """Send, waiting out the broker's absences (transient errors, back-off, no limit):
        a claimed group's requests, a result, a trained step's announcement or an event is
        not dropped because Kafka was briefly away."""
        await retry_transient(
            f"sending {type(message).__name__}", lambda: self.producer.send(message), logger=log
        )

    async def send_all(self, messages: Sequence[Message]) -> None:
        """Send each as `send` does, all at once: the producer batches what arrives within
        its linger, so n records cost about one round trip instead of n."""
        await asyncio.gather(*(self.send(message) for message in messages))


RUNTIME_INTERVAL_S = 20.0
"""How often a replica refreshes its `runtime:{service}:{replica}` record (kept 3 times as
long, so a stopped replica's record goes within a minute)."""


def runtime_fields(hardware: Hardware, precision: Precision | None) -> dict[str, str]:
    """What `marlaas status` shows of a replica: its hardware and its precision, with why."""
    fields = {"hardware": hardware.describe(), "machine_class": hardware.machine_class}
    if precision is not None:
        fields |= {"precision": precision.dtype, "why": precision.reason}
    return fields


async def announce_runtime(
    connections: Connections,
    service: str,
    replica: str,
    fields: Callable[[], Mapping[str, str]],
    stopping: asyncio.Event,
) -> None:
    """Keep `fields()` in Redis as this replica's runtime record until `stopping` is set. A
    Redis away for a while skips a refresh, no more: this is telemetry."""
    while not stopping.is_set():
        try:
            await connections.require_store().replicas.put_runtime(
                service, replica, fields(), ttl_s=int(3 * RUNTIME_INTERVAL_S)
            )
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("%s runtime record not refreshed (%r)", service, exc)
        await wait_any(stopping, timeout_s=RUNTIME_INTERVAL_S)


async def wait_any(*events: asyncio.Event, timeout_s: float) -> bool:
    """Until one of `events` is set or `timeout_s` has passed; whether one is set. A
    service's periodic task sleeps so, on its stop event too: a plain sleep kept it past
    `request_stop`, and the service's stop waited out its whole grace period for it."""
    waits = {asyncio.ensure_future(event.wait()) for event in events}
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return any(event.is_set() for event in events)


def exit_code(service: str, main: Callable[[], int]) -> int:
    """Run a service's `main`; a bad setting is one line on stderr per variable (naming the
    values it takes) and exit code 2, not a traceback."""
    try:
        return main()
    except SettingsError as exc:
        for line in str(exc).splitlines():
            print(f"{service}: {line}", file=sys.stderr)
        return 2


def start_settings(settings_type: type[S], *, check: bool = False) -> tuple[SharedSettings, S]:
    """A service's two settings blocks at start: the umask made private (what the service
    writes is its user's alone), settings loaded, the bus key required unless this is a
    start-up `check` (before anything slow, so a wrong deployment fails at once), logging set
    up, and both blocks logged."""
    os.umask(PRIVATE_UMASK)
    shared, settings = load(SharedSettings), load(settings_type)
    if not check:
        shared.require_bus_key()
    setup_logging(shared.log_level, shared.log_format)
    log_settings(shared, settings)
    return shared, settings


def log_settings(*settings: BaseSettings) -> None:
    """Each settings block as JSON, with no secret in it (the bus key is a SecretStr; a
    Redis URL's password is masked)."""
    for block in settings:
        fields = block.model_dump(mode="json")
        if isinstance(fields.get("redis_url"), str):
            fields["redis_url"] = redacted(fields["redis_url"])
        log.info("%s: %s", type(block).__name__, json.dumps(fields))


async def run_service(
    service: Service,
    *,
    grace_s: float = 30.0,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    metrics_tenant_labels: bool = False,
) -> int:
    """Run until SIGTERM/SIGINT or until any task ends; returns the process exit code.

    A task that raises or returns stops the whole service (exit code 1): a half-working
    replica is worse than a restarted one. With a `metrics_port` (0: a free one) the
    service's health endpoints are up the whole time; /readyz also requires `start()` to
    have returned and no stop to have begun ("serving"); /metrics names jobs and tenants
    only with `metrics_tenant_labels`.
    """
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    serving = asyncio.Event()

    async def readiness() -> dict[str, bool]:
        return {"serving": serving.is_set() and not stopping.is_set(), **await service.readiness()}

    health: HealthServer | None = None
    if metrics_port is not None:
        health = HealthServer(
            readiness, host=metrics_host, port=metrics_port, tenant_labels=metrics_tenant_labels
        )
        await health.start()
        log.info("%s: metrics and health on %s", service.name, health.url)
    try:
        await service.start()
        serving.set()
        return await _serve(service, stopping, serving, grace_s)
    finally:
        if health is not None:
            await health.stop()


async def _serve(
    service: Service, stopping: asyncio.Event, serving: asyncio.Event, grace_s: float
) -> int:
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
    serving.clear()  # /readyz says 503 from the moment the service winds down
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
