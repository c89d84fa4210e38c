"""`marlaas tenants add | list | key | revoke | revoke-key` (the operator's) and `marlaas api`
(serve the tenant API, api_svc/)."""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import msgspec
import typer

from common.runtime.config import SharedSettings, load
from common.state.store import RedisStore
from common.state.tenants import LIMIT_NAMES, TenantLimits, TenantRecord
from console.cli.support import one_line_errors, operator_only, options, quiet_logging, run, say

T = TypeVar("T")

app = typer.Typer(
    help="Tenants, their limits and API keys (operator; writes Redis).", no_args_is_help=True
)


def _with_store(work: Callable[[RedisStore], Awaitable[T]]) -> T:
    """Run `work` on the operator's Redis connection, then close it."""
    quiet_logging()
    operator_only("tenants")

    async def go() -> T:
        store = await RedisStore.connect(
            load(SharedSettings).redis_url, timeout_s=options.connect_timeout_s
        )
        try:
            return await work(store)
        finally:
            await store.close()

    return run(go())


def _limits_line(limits: TenantLimits) -> str:
    def shown(value: object) -> str:
        return (",".join(value) or "any") if isinstance(value, tuple) else str(value)

    return " ".join(f"{name}={shown(getattr(limits, name))}" for name in LIMIT_NAMES)


def _record_line(record: TenantRecord) -> str:
    state = "active" if record.active else "revoked"
    keys = ",".join(record.key_ids) or "-"
    return f"{record.name}  {state}  keys={keys}  {_limits_line(record.limits)}"


@app.command("add")
@one_line_errors
def add(
    name: Annotated[str, typer.Argument(help="The tenant's name (as job specs carry it).")],
    max_concurrent_jobs: Annotated[int | None, typer.Option(min=1)] = None,
    max_samples_in_flight: Annotated[
        int | None,
        typer.Option(min=1, help="Sum of G x B x (S + 1) + eval.tasks over its live jobs."),
    ] = None,
    max_steps: Annotated[int | None, typer.Option(min=1)] = None,
    max_new_tokens: Annotated[int | None, typer.Option(min=1)] = None,
    max_lora_rank: Annotated[int | None, typer.Option(min=1)] = None,
    envs: Annotated[
        str | None,
        typer.Option(help="The environments its jobs may use, comma-separated ('any': all)."),
    ] = None,
    key: Annotated[
        bool, typer.Option("--key/--no-key", help="Issue an API key (shown once).")
    ] = True,
) -> None:
    """Add a tenant (or change its limits, re-activating it) and print a new API key.

    Limits not given keep their current value (a new tenant: the defaults)."""
    from common.wire.jobspec import NAME_RULE, is_name

    if not is_name(name):
        raise typer.BadParameter(f"{NAME_RULE}, got {name!r}", param_hint="NAME")
    given = {
        "max_concurrent_jobs": max_concurrent_jobs,
        "max_samples_in_flight": max_samples_in_flight,
        "max_steps": max_steps,
        "max_new_tokens": max_new_tokens,
        "max_lora_rank": max_lora_rank,
        "environments": None if envs is None else _environments(envs),
    }

    async def go(store: RedisStore) -> tuple[TenantRecord, str | None]:
        current = await store.tenants.limits(name) or TenantLimits()
        changes = {k: v for k, v in given.items() if v is not None}
        record = await store.tenants.add(name, msgspec.structs.replace(current, **changes))
        token = (await store.tenants.issue_key(name)).token if key else None
        return record, token

    record, token = _with_store(go)
    say(f"tenant {record.name}: {_limits_line(record.limits)}")
    if token is not None:
        say(f"API key (shown once; give it to the tenant): {token}")


def _environments(text: str) -> tuple[str, ...]:
    names = tuple(sorted({name.strip() for name in text.split(",") if name.strip()}))
    return () if names in ((), ("any",)) else names


@app.command("key")
@one_line_errors
def issue_key(name: Annotated[str, typer.Argument(help="The tenant.")]) -> None:
    """Issue another API key for a tenant (e.g. to rotate: then revoke-key the old one)."""

    async def go(store: RedisStore) -> str:
        return (await store.tenants.issue_key(name)).token

    say(f"API key (shown once): {_with_store(go)}")


@app.command("list")
@one_line_errors
def list_tenants() -> None:
    """Every tenant: active or revoked, its key ids and limits."""

    async def go(store: RedisStore) -> list[TenantRecord]:
        return [await store.tenants.require(n) for n in await store.tenants.names()]

    for record in _with_store(go):
        say(_record_line(record))


@app.command("revoke")
@one_line_errors
def revoke(name: Annotated[str, typer.Argument(help="The tenant.")]) -> None:
    """Revoke a tenant and all its keys (its running jobs go on: cancel them if need be)."""

    async def go(store: RedisStore) -> int:
        return await store.tenants.revoke(name)

    say(f"tenant {name} revoked ({_with_store(go)} keys)")


@app.command("revoke-key")
@one_line_errors
def revoke_key(key_id: Annotated[str, typer.Argument(help="The key id (`tenants list`).")]) -> None:
    """Revoke one API key."""

    async def go(store: RedisStore) -> str:
        return (await store.tenants.revoke_key(key_id)).tenant

    say(f"key {key_id} of tenant {_with_store(go)} revoked")


@one_line_errors
def api(
    host: Annotated[str | None, typer.Option(help="Default: MARLAAS_API_HOST, 127.0.0.1.")] = None,
    port: Annotated[int | None, typer.Option(help="Default: MARLAAS_API_PORT, 8080.")] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Build the app and exit (an image's start-up check).")
    ] = False,
) -> None:
    """Serve the tenant API (HTTP, API keys; schema at /docs) until Ctrl-C: `python -m
    api_svc`, its own deployable, in place of this process."""
    operator_only("api")
    env = dict(os.environ)
    if host is not None:
        env["MARLAAS_API_HOST"] = host
    if port is not None:
        env["MARLAAS_API_PORT"] = str(port)
    argv = [sys.executable, "-m", "api_svc", *(["--check"] if check else [])]
    os.execve(sys.executable, argv, env)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="tenants")
    root.command()(api)
