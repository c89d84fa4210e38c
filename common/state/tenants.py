"""Tenants: their API keys, their limits (quotas), and the rule that checks a job against them.

A tenant is a name (`jobspec.NAME_RULE`) with limits set by the operator
(`marlaas tenants add|limits|list|revoke`) and API keys that the tenant API (api_svc/)
accepts. Keys look like `mlk_<key id>_<secret>`; only the SHA-256 of the secret is stored
(keys are 256 random bits, so a slow hash buys nothing), and a key is checked with a
constant-time comparison. Redis keys (named here; common/state/keyspace.py lists the rest):

- `tenant:{name}`   hash limits (JSON of `TenantLimits`), created_at, revoked_at
- `tenants`         set of every tenant name
- `apikey:{key id}` hash tenant, secret_sha256, created_at, revoked_at
- `tenant-keys:{name}` set of the tenant's key ids
- `owner:{job}`     the tenant a job id is bound to, set once (the API when it accepts a
                    submission, env_svc at a job's first acceptance otherwise)
- `tenant-jobs:{name}` set of the tenant's registered jobs (the quota's count)

Limits are enforced where a job is accepted (env_svc, atomically with its registration:
common/state/registry.py `register`), so jobs produced to Kafka directly by the operator obey
them too; the API asks the same rule first (`check_quota`) only to answer sooner. A tenant
the operator never added has no limits beyond the bounds on every job field
(common/wire/jobspec.py): only the operator's own Kafka producers can send its jobs, since tenants
never hold Kafka credentials.
`marlaas tenants add` starts a tenant at `TenantLimits()`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

import msgspec

from common.state.keyspace import (
    TENANTS,
    api_key_key,
    tenant_key,
    tenant_keys_key,
)
from common.state.redis_part import RedisPart, text, texts
from common.wire.messages import JobSpec

KEY_PREFIX = "mlk_"
_KEY_ID_BYTES = 6
_SECRET_BYTES = 32


class TenantLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one tenant may use at once; the operator sets them per tenant."""

    max_concurrent_jobs: int = 4
    """Jobs registered and not ended (pending, running, paused)."""
    max_samples_in_flight: int = 1024
    """Sum over those jobs of G x B x (S + 1) + eval.tasks: the episodes each may have open
    (issued and not yet trained, common/state/flow.py, and one evaluation), i.e. its share of the
    rollout engine's queue."""
    max_steps: int = 1000
    """`rl.max_steps` of any one job."""
    max_new_tokens: int = 512
    """`rl.sampling.max_new_tokens` of any one job."""
    max_lora_rank: int = 16
    """`lora.rank` of any one job (the rollout engine's own maximum applies as well)."""
    environments: tuple[str, ...] = ()
    """The environments its jobs may use; empty: any the deployment has."""


LIMIT_NAMES = tuple(TenantLimits.__struct_fields__)


class QuotaError(ValueError):
    """A job beyond its tenant's limits; the text names the limit."""


def samples_in_flight(spec: JobSpec) -> int:
    """The episodes a job may have open at once: G x B x (S + 1) issued and not yet trained,
    and one evaluation's `eval.tasks` (a job evaluates one version at a time:
    common/state/evals.py)."""
    rl = spec.rl
    return rl.group_size * rl.groups_per_step * (rl.max_staleness + 1) + spec.eval.tasks


def job_limit_problems(spec: JobSpec, limits: TenantLimits) -> list[str]:
    """The per-job limits the spec exceeds, each naming the limit (the counts over the
    tenant's other jobs are checked where the job is registered)."""
    checks = [
        ("max_steps", spec.rl.max_steps, "rl.max_steps"),
        ("max_new_tokens", spec.rl.sampling.max_new_tokens, "rl.sampling.max_new_tokens"),
        ("max_lora_rank", spec.lora.rank, "lora.rank"),
        ("max_samples_in_flight", samples_in_flight(spec), "G x B x (S + 1) + eval.tasks"),
    ]
    problems = [
        f"quota {name}: {field} {value} exceeds the limit {getattr(limits, name)} of tenant "
        f"{spec.tenant!r}"
        for name, value, field in checks
        if value > getattr(limits, name)
    ]
    if limits.environments and spec.env.name not in limits.environments:
        problems.append(
            f"quota environments: tenant {spec.tenant!r} may use "
            f"{', '.join(limits.environments)}; not {spec.env.name!r}"
        )
    return problems


def quota_problem(
    code: int, spec: JobSpec, limits: TenantLimits, live_jobs: int, live_samples: int
) -> str:
    """What the count limit the job would take its tenant past says, given which one the
    rule found (`code`: -1 jobs, -2 samples; common/state/registry.py), the tenant's jobs that have
    not ended and their samples in flight."""
    if code == -1:
        return (
            f"quota max_concurrent_jobs: tenant {spec.tenant!r} has {live_jobs} jobs that have "
            f"not ended; its limit is {limits.max_concurrent_jobs}"
        )
    return (
        f"quota max_samples_in_flight: tenant {spec.tenant!r}'s jobs have {live_samples} "
        f"samples in flight and this one adds {samples_in_flight(spec)} "
        f"(G x B x (S + 1) + eval.tasks); its limit is {limits.max_samples_in_flight}"
    )


def encode_limits(limits: TenantLimits) -> bytes:
    return msgspec.json.encode(limits)


def decode_limits(raw: bytes | str) -> TenantLimits:
    return msgspec.json.decode(raw, type=TenantLimits)


# --- API keys -------------------------------------------------------------------------


class ApiKey(msgspec.Struct, frozen=True):
    key_id: str
    secret: str

    @property
    def token(self) -> str:
        """What the tenant is given, once: `mlk_<key id>_<secret>`."""
        return f"{KEY_PREFIX}{self.key_id}_{self.secret}"


def new_api_key() -> ApiKey:
    return ApiKey(secrets.token_hex(_KEY_ID_BYTES), secrets.token_urlsafe(_SECRET_BYTES))


def parse_api_key(token: str) -> ApiKey | None:
    """The key id and secret of a presented token, or None when it is not shaped like one."""
    if not token.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = token.removeprefix(KEY_PREFIX).partition("_")
    if not sep or len(key_id) != 2 * _KEY_ID_BYTES or not secret:
        return None
    return ApiKey(key_id, secret)


def secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_digest: str) -> bool:
    return hmac.compare_digest(secret_digest(secret), stored_digest)


# --- the registry ---------------------------------------------------------------------


class UnknownTenantError(KeyError):
    def __init__(self, tenant: str) -> None:
        super().__init__(tenant)
        self.tenant = tenant

    def __str__(self) -> str:
        return f"unknown tenant {self.tenant!r} (marlaas tenants add {self.tenant})"


class UnknownKeyError(KeyError):
    def __init__(self, key_id: str) -> None:
        super().__init__(key_id)
        self.key_id = key_id

    def __str__(self) -> str:
        return f"no API key {self.key_id!r} (`marlaas tenants list` shows each tenant's key ids)"


@dataclass(frozen=True)
class TenantRecord:
    name: str
    limits: TenantLimits
    created_at: float
    revoked_at: float
    key_ids: tuple[str, ...]

    @property
    def active(self) -> bool:
        return not self.revoked_at


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    tenant: str
    created_at: float
    revoked_at: float


class TenantRegistry(RedisPart):
    """Tenants, their limits and API keys in Redis (the operator's CLI writes them; the tenant
    API and env_svc read them)."""

    async def add(self, tenant: str, limits: TenantLimits) -> TenantRecord:
        """Create the tenant, or set its limits and re-activate it."""
        now = time.time()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(tenant_key(tenant), "created_at", now)
            pipe.hset(
                tenant_key(tenant), mapping={"limits": encode_limits(limits), "revoked_at": 0}
            )
            pipe.sadd(TENANTS, tenant)
            await pipe.execute()
        return await self.require(tenant)

    async def get(self, tenant: str) -> TenantRecord | None:
        fields = texts(await self._redis.hgetall(tenant_key(tenant)))
        if not fields:
            return None
        key_ids = [text(m) for m in await self._redis.smembers(tenant_keys_key(tenant))]
        return TenantRecord(
            name=tenant,
            limits=decode_limits(fields["limits"]),
            created_at=float(fields.get("created_at", 0)),
            revoked_at=float(fields.get("revoked_at", 0)),
            key_ids=tuple(sorted(key_ids)),
        )

    async def require(self, tenant: str) -> TenantRecord:
        if (record := await self.get(tenant)) is None:
            raise UnknownTenantError(tenant)
        return record

    async def names(self) -> list[str]:
        return sorted(text(m) for m in await self._redis.smembers(TENANTS))

    async def limits(self, tenant: str) -> TenantLimits | None:
        """The tenant's limits; None for a tenant with no record (only the operator's own
        Kafka producers can send its jobs: tenants never hold Kafka credentials)."""
        raw = await self._redis.hget(tenant_key(tenant), "limits")
        return None if raw is None else decode_limits(raw)

    async def revoke(self, tenant: str) -> int:
        """Revoke the tenant and every key of it; returns how many keys were revoked. Its
        running jobs go on (the operator cancels them if they should not)."""
        record = await self.require(tenant)
        now = time.time()
        await self._redis.hset(tenant_key(tenant), "revoked_at", now)
        for key_id in record.key_ids:
            await self._redis.hset(api_key_key(key_id), "revoked_at", now)
        return len(record.key_ids)

    async def issue_key(self, tenant: str) -> ApiKey:
        """A new API key for an active tenant; the token is shown once, never stored."""
        record = await self.require(tenant)
        if not record.active:
            raise ValueError(f"tenant {tenant!r} is revoked; `marlaas tenants add` re-activates")
        key = new_api_key()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                api_key_key(key.key_id),
                mapping={
                    "tenant": tenant,
                    "secret_sha256": secret_digest(key.secret),
                    "created_at": time.time(),
                    "revoked_at": 0,
                },
            )
            pipe.sadd(tenant_keys_key(tenant), key.key_id)
            await pipe.execute()
        return key

    async def revoke_key(self, key_id: str) -> KeyRecord:
        if not await self._redis.exists(api_key_key(key_id)):
            raise UnknownKeyError(key_id)
        await self._redis.hset(api_key_key(key_id), "revoked_at", time.time())
        record = await self._key(key_id)
        assert record is not None
        return record

    async def authenticate(self, token: str) -> str | None:
        """The tenant of a presented API key; None for a malformed, unknown or revoked key,
        or one of a revoked tenant."""
        key = parse_api_key(token)
        if key is None:
            return None
        fields = texts(await self._redis.hgetall(api_key_key(key.key_id)))
        if not fields or float(fields.get("revoked_at", 0)):
            return None
        if not secret_matches(key.secret, fields.get("secret_sha256", "")):
            return None
        tenant = fields["tenant"]
        revoked = await self._redis.hget(tenant_key(tenant), "revoked_at")
        if revoked is None or float(revoked):
            return None
        return tenant

    async def _key(self, key_id: str) -> KeyRecord | None:
        fields = texts(await self._redis.hgetall(api_key_key(key_id)))
        if not fields:
            return None
        return KeyRecord(
            key_id=key_id,
            tenant=fields["tenant"],
            created_at=float(fields["created_at"]),
            revoked_at=float(fields["revoked_at"]),
        )
