"""Each service's HTTP endpoints on one port: /metrics, /healthz, /readyz.

- `/metrics`: the Prometheus text format of the default registry (common/runtime/metrics.py); with
  no job or tenant label unless `tenant_labels` (`MARLAAS_METRICS_TENANT_LABELS`).
- `/healthz`: liveness, 200 whenever the event loop answers (it serves this very request).
- `/readyz`: readiness, 200 when every check passes, else 503; the JSON body names each
  check (`{"ready": false, "checks": {"kafka": true, "redis": false, ...}}`).

A minimal HTTP/1.1 server on asyncio (one request per connection), so the core package
needs no web framework; scrapers and probes send nothing more than a GET.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from common.runtime.metrics import WithoutJobLabels

if TYPE_CHECKING:
    from common.state.store import RedisStore

log = logging.getLogger(__name__)

Readiness = Callable[[], Awaitable[dict[str, bool]]]

CHECK_TIMEOUT_S = 2.0
"""How long one readiness check may take before it counts as failed."""
_READINESS_TIMEOUT_S = 5.0
_REQUEST_TIMEOUT_S = 5.0
_MAX_HEADER_LINES = 100
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
_TEXT = "text/plain; charset=utf-8"
_JSON = "application/json"


async def check(probe: Awaitable[object], timeout_s: float = CHECK_TIMEOUT_S) -> bool:
    """True when `probe` completes within `timeout_s` without raising."""
    try:
        await asyncio.wait_for(probe, timeout_s)
    except Exception as exc:
        log.debug("readiness probe failed: %r", exc)
        return False
    return True


async def redis_ready(store: RedisStore | None) -> bool:
    """Redis answers a PING in time."""
    if store is None:
        return False
    return await check(store.ping())


class HealthServer:
    """Serves /metrics, /healthz and /readyz on `host:port` (port 0: a free one); /metrics
    labels per-job series with their job and tenant only with `tenant_labels`."""

    def __init__(
        self,
        readiness: Readiness,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        registry: CollectorRegistry = REGISTRY,
        tenant_labels: bool = False,
    ) -> None:
        self.host = host
        self._requested_port = port
        self._readiness = readiness
        self._metrics: Collector = registry if tenant_labels else WithoutJobLabels(registry)
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The port it listens on (the chosen one when asked for 0)."""
        if self._server is None:
            raise RuntimeError("health server not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self.host, self._requested_port, reuse_address=True
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> HealthServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(_read_head(reader), _REQUEST_TIMEOUT_S)
            parts = request_line.split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                return  # not HTTP: close without an answer
            method, target = parts[0], parts[1]
            status, content_type, body = await self._respond(method, target.split("?", 1)[0])
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode("ascii") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # a client that went away or sent garbage gets no answer
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass

    async def _respond(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, _TEXT, b"only GET and HEAD\n"
        match path:
            case "/metrics":
                return 200, CONTENT_TYPE_LATEST, generate_latest(self._metrics)
            case "/healthz":
                return 200, _TEXT, b"ok\n"
            case "/readyz":
                checks = await self._checks()
                ready = all(checks.values())
                body = json.dumps({"ready": ready, "checks": checks}).encode() + b"\n"
                return (200 if ready else 503), _JSON, body
            case _:
                return 404, _TEXT, b"not found; try /metrics, /healthz or /readyz\n"

    async def _checks(self) -> dict[str, bool]:
        try:
            checks = await asyncio.wait_for(self._readiness(), _READINESS_TIMEOUT_S)
        except Exception as exc:
            log.warning("readiness checks failed: %r", exc)
            return {"readiness_checks": False}
        # An empty set of checks must not read as "all passed".
        return checks or {"readiness_checks": False}


async def _read_head(reader: asyncio.StreamReader) -> str:
    """The request line; the headers after it are read and ignored (no request has a body)."""
    request_line = (await reader.readline()).decode("latin-1")
    for _ in range(_MAX_HEADER_LINES):
        if (await reader.readline()) in (b"\r\n", b"\n", b""):
            break
    return request_line
