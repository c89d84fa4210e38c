"""Redis least privilege (common/security/access.py) against a real Valkey started with
the generated aclfile: each principal can run the store operations its process uses, and
nothing else; anonymous clients get nothing. Plus the embedded stack's wiring of it."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from redis import asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from common.runtime.config import SharedSettings, stack_env_file
from common.security.access import (
    PRINCIPALS,
    Principal,
    new_passwords,
    redis_url_for,
    valkey_acl_lines,
)
from common.state.dedup import COMMANDS, DROPPED, TRAINED
from common.state.store import RedisStore
from common.state.tenants import QuotaError, TenantLimits
from common.wire.lifecycle import SERVICES, RolloutReplicaStats
from common.wire.messages import EnvSettings, JobSpec, RLSettings, new_id
from console.stack.children import ChildServer, free_port
from console.stack.infra import start_valkey
from console.stack.local import LocalStack
from env_svc.service import working_state_keys as env_working_state
from trainer_svc.roster import working_state_keys as trainer_working_state

pytestmark = pytest.mark.kafka

SERVICE_USERS: tuple[Principal, ...] = (*SERVICES, "api")


@dataclass
class AclValkey:
    port: int
    passwords: dict[str, str]
    server: ChildServer

    def url(self, principal: Principal) -> str:
        return redis_url_for(
            f"redis://127.0.0.1:{self.port}/0", principal, self.passwords[principal]
        )


@pytest.fixture(scope="module")
def acl_valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclValkey]:
    """A Valkey of its own (the tests try FLUSHALL and SHUTDOWN on it) with the aclfile."""
    root = tmp_path_factory.mktemp("acl-valkey")
    passwords = new_passwords()
    aclfile = root / "users.acl"
    aclfile.write_text("\n".join(valkey_acl_lines(passwords)) + "\n")
    port = free_port()
    valkey = AclValkey(port, passwords, start_valkey(port, root / "data", root / "log", aclfile))

    async def ready() -> None:
        store = await RedisStore.connect(valkey.url("operator"), timeout_s=30)
        await store.close()

    asyncio.run(ready())
    yield valkey
    valkey.server.stop()


@asynccontextmanager
async def store_as(valkey: AclValkey, principal: Principal) -> AsyncIterator[RedisStore]:
    store = await RedisStore.connect(valkey.url(principal), timeout_s=10)
    try:
        yield store
    finally:
        await store.close()


@asynccontextmanager
async def client_as(valkey: AclValkey, principal: Principal) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(valkey.url(principal))
    try:
        yield client
    finally:
        await client.aclose()


def resp(port: int, *words: str) -> bytes:
    """One command as raw RESP from an unauthenticated connection; the server's exact reply."""
    command = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(command.encode())
        return conn.recv(256)


def spec(job_id: str, tenant: str) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant=tenant,
        base_model="smollm2-135m-instruct",
        env=EnvSettings(name="arithmetic", params={"max_operand": 9}),
        rl=RLSettings(group_size=2, groups_per_step=1, max_staleness=0),
    )


async def registered_job(valkey: AclValkey) -> tuple[str, str]:
    """A tenant (with limits) and a registered job of it, set up by the operator."""
    tenant, job_id = f"t{new_id()[:8]}", f"acl-{new_id()}"
    async with store_as(valkey, "operator") as operator:
        await operator.tenants.add(tenant, TenantLimits())
        assert await operator.jobs.register(spec(job_id, tenant))
    return tenant, job_id


# --- no anonymous access --------------------------------------------------------------


def test_anonymous_clients_get_noauth(acl_valkey: AclValkey) -> None:
    assert resp(acl_valkey.port, "GET", "jobs").startswith(b"-NOAUTH")
    assert resp(acl_valkey.port, "SET", "x", "1").startswith(b"-NOAUTH")
    assert resp(acl_valkey.port, "PING").startswith(b"-NOAUTH")


async def test_anonymous_and_wrong_password_clients_are_refused(acl_valkey: AclValkey) -> None:
    base = f"redis://127.0.0.1:{acl_valkey.port}/0"
    for url in (f"{base}?protocol=2", redis_url_for(base, "api", "x" * 32)):
        client = aioredis.Redis.from_url(url)
        try:
            with pytest.raises(AuthenticationError):
                await client.get("jobs")
        finally:
            await client.aclose()


# --- each can do its work ---------------------------------------------------------------


async def test_env_svc_runs_its_store_operations(acl_valkey: AclValkey) -> None:
    tenant, first = await registered_job(acl_valkey)
    job_id = f"acl-{new_id()}"
    async with store_as(acl_valkey, "operator") as operator:
        await operator.adapters.publish(job_id, 1, "file:///a/v1", 1)
        await operator.replicas.put_stats("r-env", RolloutReplicaStats(max_model_len=512), ttl_s=60)
    async with store_as(acl_valkey, "env_svc") as env:
        limits = await env.tenants.limits(tenant)
        assert limits == TenantLimits()
        claim = await env.jobs.claim_id(job_id, tenant)
        assert claim.owner == tenant and claim.bound_now and claim.record is None
        assert (await env.jobs.claim_id(job_id, None)).owner == tenant
        # The quota script reads the tenant's other job (`first`) without declaring it.
        assert await env.jobs.register(spec(job_id, tenant), limits=limits)
        assert {first, job_id} <= set(await env.jobs.ids())
        assert await env.jobs.set_status(job_id, "running")
        assert job_id in await env.jobs.active_ids()
        await env.jobs.backfill_active()  # once per deployment, maybe by another test before
        record = await env.jobs.get(job_id)
        assert record is not None and record.status == "running"
        issued = await env.flow.try_issue_group(
            job_id, max_staleness=0, groups_per_step=1, max_groups=9
        )
        assert issued is not None and issued.trained_version == 1
        assert [g.index for g in await env.flow.take_stale_claims(job_id, older_than_s=-1)] == [0]
        await env.flow.finish_claim(job_id, issued.index)
        assert await env.evals.claim(job_id, 0)
        assert await env.evals.take_stale(job_id, older_than_s=-1) == [0]
        assert await env.evals.record(job_id, 0, "e0", reward=1.0, solved=True, components={})
        assert (await env.evals.tally(job_id, 0)).solved == 1
        assert await env.evals.count_resend(job_id, 0) == 1
        assert not await env.evals.claim(job_id, 2)  # waits behind v0's
        assert await env.evals.seen(job_id, 0) == {"e0"}
        assert await env.evals.finish(job_id, 0) == 2
        assert await env.evals.start_waiting(job_id) is None
        await env.evals.abandon(job_id)
        assert await env.evals.versions(job_id) == {0: "done", 2: "done"}
        assert await env.dedup.mark_seen("results", job_id, "req-1")
        assert await env.dedup.seen("results", job_id, "req-1")
        assert await env.adapters.published_uri(job_id, 1) == "file:///a/v1"
        assert await env.dedup.mark_seen(COMMANDS, job_id, "command-1")
        await env.jobs.expire_after_end(env_working_state(job_id, [0, 2]))  # its own keys only
        await env.jobs.retire(job_id)
        assert job_id not in await env.jobs.active_ids()
        assert (await env.replicas.stats())["r-env"].max_model_len == 512
        await env.ping()


async def test_trainer_svc_runs_its_store_operations(acl_valkey: AclValkey) -> None:
    _, job_id = await registered_job(acl_valkey)
    async with store_as(acl_valkey, "trainer_svc") as trainer:
        assert (await trainer.jobs.get(job_id)) is not None
        epoch = await trainer.adapters.take_over(job_id)
        assert await trainer.adapters.publish(job_id, 1, "file:///a/v1", 1, ["g0"], epoch=epoch)
        pointer = await trainer.adapters.get(job_id)
        assert pointer is not None and pointer.version == 1
        dropped = await trainer.flow.record_dropped_group(job_id, "g1", invalid=True)
        assert dropped.counted and dropped.failed_in_a_row == 1
        assert await trainer.dedup.dropped_among(job_id, ["g0", "g1"]) == {"g1"}
        assert await trainer.dedup.seen(TRAINED, job_id, "g0")
        await trainer.jobs.expire_after_end(trainer_working_state(job_id))
        assert await trainer.dedup.seen(DROPPED, job_id, "g1")
        assert await trainer.flow.live_groups(job_id) == []
        assert await trainer.flow.last_activity(job_id) is not None
        assert [e["kind"] for e in await trainer.flow.ledger(job_id)] == ["trained", "dropped"]
        assert (await trainer.flow.state(job_id)).dropped_groups == 1
        assert await trainer.jobs.set_status(job_id, "completed")


async def test_rollout_svc_runs_its_store_operations(acl_valkey: AclValkey) -> None:
    _, job_id = await registered_job(acl_valkey)
    async with store_as(acl_valkey, "trainer_svc") as trainer:
        await trainer.adapters.publish(job_id, 1, "file:///a/v1", 1)
    async with store_as(acl_valkey, "rollout_svc") as rollout:
        assert (await rollout.adapters.all())[job_id].uri == "file:///a/v1"
        pointer = await rollout.adapters.get(job_id)
        assert pointer is not None and pointer.version == 1
        assert await rollout.adapters.published_uri(job_id, 1) == "file:///a/v1"
        assert (await rollout.jobs.get(job_id)) is not None
        await rollout.replicas.put_stats("r-acl", RolloutReplicaStats(busy_s=1.0), ttl_s=60)
    async with store_as(acl_valkey, "api") as api:
        assert [s.busy_s for s in (await api.replicas.stats_history())["r-acl"]] == [1.0]


async def test_api_runs_its_store_operations(acl_valkey: AclValkey) -> None:
    tenant, job_id = await registered_job(acl_valkey)
    async with store_as(acl_valkey, "operator") as operator:
        key = await operator.tenants.issue_key(tenant)
        await operator.adapters.publish(job_id, 1, "file:///a/v1", 1)
    async with store_as(acl_valkey, "api") as api:
        assert await api.tenants.authenticate(key.token) == tenant
        record = await api.tenants.get(tenant)
        assert record is not None and record.key_ids == (key.key_id,)
        assert await api.tenants.limits(tenant) == TenantLimits()
        assert await api.jobs.of_tenant(tenant) == [job_id]
        new_job = f"acl-{new_id()}"
        assert (await api.jobs.claim_id(new_job, None)).owner is None
        assert (await api.jobs.claim_id(new_job, tenant)).bound_now
        claim = await api.jobs.claim_id(job_id, None)  # reads the record, undeclared
        assert claim.owner is None and claim.record is not None
        assert job_id in await api.jobs.ids()
        record_of_job = await api.jobs.get(job_id)
        assert record_of_job is not None
        assert (await api.adapters.get(job_id)) is not None
        assert await api.adapters.published_uri(job_id, 1) == "file:///a/v1"
        assert [e["kind"] for e in await api.flow.ledger(job_id)] == ["trained"]
        # The count-limit rule, read-only: the tenant's one live job fills a limit of one.
        spec = msgspec.structs.replace(record_of_job.spec, job_id=new_job)
        await api.jobs.check_quota(spec, TenantLimits())
        with pytest.raises(QuotaError, match=r"max_concurrent_jobs: tenant .* has 1 jobs"):
            await api.jobs.check_quota(spec, TenantLimits(max_concurrent_jobs=1))


# --- and nothing else -------------------------------------------------------------------

Attempt = Callable[[RedisStore, aioredis.Redis, str], Awaitable[object]]

DENIED: dict[str, tuple[tuple[Principal, ...], Attempt]] = {
    "publish an adapter": (
        ("env_svc", "rollout_svc", "api"),
        lambda store, _, job: store.adapters.publish(job, 9, "file:///evil", 9),
    ),
    "write an adapter pointer": (
        ("env_svc", "rollout_svc", "api"),
        lambda _, raw, job: raw.hset(f"adapter:{job}", "uri", "file:///evil"),
    ),
    "record a published version": (
        ("env_svc", "rollout_svc", "api"),
        lambda _, raw, job: raw.hset(f"adapter-versions:{job}", "9", "file:///evil"),
    ),
    "take a job over": (
        ("env_svc", "rollout_svc", "api"),
        lambda store, _, job: store.adapters.take_over(job),
    ),
    "read an API key": (
        ("env_svc", "rollout_svc", "trainer_svc"),
        lambda _, raw, job: raw.hgetall("apikey:0123456789ab"),
    ),
    "write a tenant": (
        SERVICE_USERS,
        lambda store, _, job: store.tenants.add(f"t{job[-8:]}", TenantLimits()),
    ),
    "register a job": (
        ("rollout_svc", "trainer_svc", "api"),
        lambda store, _, job: store.jobs.register(spec(job, "acme")),
    ),
    "change a job's status": (
        ("rollout_svc", "api"),
        lambda store, _, job: store.jobs.set_status(job, "cancelled"),
    ),
    "bind a job's owner": (
        ("rollout_svc", "trainer_svc"),
        lambda store, _, job: store.jobs.claim_id(job, "acme"),
    ),
    "count a restart": (
        SERVICE_USERS,
        lambda store, _, job: store.replicas.count_restart("env_svc"),
    ),
    "FLUSHALL": (SERVICE_USERS, lambda _, raw, job: raw.flushall()),
    "FLUSHDB": (SERVICE_USERS, lambda _, raw, job: raw.flushdb()),
    "CONFIG SET": (SERVICE_USERS, lambda _, raw, job: raw.config_set("appendonly", "no")),
    "ACL SETUSER": (SERVICE_USERS, lambda _, raw, job: raw.acl_setuser("x", enabled=True)),
    "ACL LIST": (SERVICE_USERS, lambda _, raw, job: raw.acl_list()),
    "KEYS": (SERVICE_USERS, lambda _, raw, job: raw.keys("*")),
    "CLIENT LIST": (SERVICE_USERS, lambda _, raw, job: raw.client_list()),
    "SWAPDB": (SERVICE_USERS, lambda _, raw, job: raw.swapdb(0, 1)),
    "SHUTDOWN": (SERVICE_USERS, lambda _, raw, job: raw.execute_command("SHUTDOWN", "NOSAVE")),
    "SCRIPT FLUSH": (SERVICE_USERS, lambda _, raw, job: raw.script_flush()),
    "FUNCTION FLUSH": (SERVICE_USERS, lambda _, raw, job: raw.function_flush()),
}


@pytest.mark.parametrize(
    ("principal", "what"),
    [(p, what) for what, (principals, _) in DENIED.items() for p in principals],
)
async def test_a_principal_cannot_do_what_it_does_not_need(
    acl_valkey: AclValkey, principal: Principal, what: str
) -> None:
    _, job_id = await registered_job(acl_valkey)
    attempt = DENIED[what][1]
    async with store_as(acl_valkey, principal) as store, client_as(acl_valkey, principal) as raw:
        # NOPERM; a script's own call that is refused comes back as "ACL failure in script".
        with pytest.raises((NoPermissionError, ResponseError), match=r"(?i)permission"):
            await attempt(store, raw, job_id)
    async with store_as(acl_valkey, "operator") as operator:
        assert await operator.jobs.get(job_id) is not None, "the data is all still there"


async def test_the_operator_may_do_anything(acl_valkey: AclValkey) -> None:
    async with client_as(acl_valkey, "operator") as raw:
        assert await raw.execute_command("ACL", "WHOAMI") in (b"operator", "operator")
        assert len(await raw.acl_list()) == len(PRINCIPALS) + 1  # and `default`, off


# --- the embedded stack -----------------------------------------------------------------


async def test_the_stack_runs_valkey_with_users_and_keeps_their_passwords(
    local_stack: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`marlaas up`'s Valkey: private files, the operator in stack.env, each principal's own
    URL, no anonymous access; a restarted stack on the same state dir keeps the passwords."""
    monkeypatch.setenv("MARLAAS_KAFKA_BOOTSTRAP", local_stack.kafka_bootstrap)
    monkeypatch.delenv("MARLAAS_REDIS_URL", raising=False)
    urls: dict[str, str] = {}
    for _ in range(2):
        stack = LocalStack(SharedSettings(state_dir=tmp_path, connect_timeout_s=30))
        async with stack:
            for path in (
                stack.redis_passwords_file,
                tmp_path / "valkey" / "users.acl",
                stack_env_file(tmp_path),
            ):
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
            env_file = stack_env_file(tmp_path).read_text()
            assert f"MARLAAS_REDIS_URL={stack.redis_url}\n" in env_file
            assert stack.redis_url == stack.redis_url_for("operator")
            port = int(stack.redis_url.rsplit(":", 1)[1].split("/")[0])
            assert resp(port, "GET", "jobs").startswith(b"-NOAUTH")
            for principal in PRINCIPALS:
                url = stack.redis_url_for(principal)
                assert url.startswith(f"redis://{principal}:")
                if principal in urls:  # the same password as before the restart
                    assert url.split("@")[0] == urls[principal].split("@")[0]
                urls[principal] = url
                client = aioredis.Redis.from_url(url)
                try:
                    assert await client.ping()
                finally:
                    await client.aclose()
    assert set(json.loads((tmp_path / "redis-passwords.json").read_text())) == set(PRINCIPALS)
