"""The tenant API (api_svc/) served from a thread of the test process, on a free port."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from api_svc.server import ApiSettings, serve
from common.runtime.config import SharedSettings


@contextmanager
def api_server(settings: SharedSettings, limits: ApiSettings | None = None) -> Iterator[str]:
    """Serve the API for `settings` (its Kafka, Redis and bus key) with `limits` (host and
    port are its own); yields its base URL."""
    started = threading.Event()
    port: list[int] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failure: list[BaseException] = []

    def ready(bound: int) -> None:
        port.append(bound)
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(
                serve(
                    settings,
                    (limits or ApiSettings()).model_copy(update={"host": "127.0.0.1", "port": 0}),
                    ready=ready,
                    stop=stop,
                )
            )
        except BaseException as exc:
            failure.append(exc)
            started.set()

    thread = threading.Thread(target=run, name="tenant-api", daemon=True)
    thread.start()
    if not started.wait(60) or failure:
        raise RuntimeError(f"the tenant API did not start: {failure}")
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
