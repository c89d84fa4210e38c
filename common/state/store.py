"""The Redis store: one client, and one part per concern reached as an attribute.

`store.jobs` is the job registry (`registry`), `store.admitted` the registered jobs this
process knows, each decoded once (`admitted`; the registry reads records through it),
`store.adapters` the adapter version pointers (`pointers`), `store.flow` each job's flow window
and audit ledger (`flow`), `store.evals` evaluation tallies (`evals`), `store.dedup` de-dup
sets (`dedup`), `store.replicas` what replicas report (`replicas`) and `store.tenants` tenants
and API keys (`tenants`), and usage per tenant and job (`usage`). Each part
lives with its concern and its Lua scripts in common/state/; every key is named in
`keyspace`. Every read-modify-write is one Lua script, so concurrent replicas cannot
interleave.

Services and their tests use this class alone: unit tests run it over fakeredis, whose Lua
runs the same scripts (tests/fakes.py), so no protocol mirrors it.
"""

from __future__ import annotations

from redis import asyncio as aioredis
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.runtime.backoff import connect_with_backoff
from common.security.access import redacted
from common.state.admitted import AdmittedJobs
from common.state.dedup import DedupSets
from common.state.evals import EvalTallies
from common.state.flow import FlowWindow
from common.state.pointers import AdapterPointers
from common.state.registry import JobRegistry
from common.state.replicas import ReplicaBoard
from common.state.tenants import TenantRegistry
from common.state.usage import UsageCounters

MAX_CONNECTIONS = 64
"""Connections one process opens to Redis at most."""
POOL_WAIT_S = 30.0
"""How long a call waits for a free connection before it fails (transient: retried)."""


class RedisStore:
    """Async access to MARLaaS' Redis state. Create with `await RedisStore.connect(url)`."""

    def __init__(self, client: aioredis.Redis, url: str) -> None:
        self._redis = client
        self.url = url
        self.admitted = AdmittedJobs(client)
        self.jobs = JobRegistry(client, self.admitted)
        self.adapters = AdapterPointers(client)
        self.flow = FlowWindow(client)
        self.evals = EvalTallies(client)
        self.dedup = DedupSets(client)
        self.replicas = ReplicaBoard(client)
        self.tenants = TenantRegistry(client)
        self.usage = UsageCounters(client)

    @classmethod
    async def connect(cls, url: str, *, timeout_s: float = 60.0) -> RedisStore:
        """Connect, retrying with back-off while Redis does not answer."""

        async def attempt() -> aioredis.Redis:
            # A replica handles many records at once (common/bus/dispatch.py): a caller past the
            # pool's connections waits for one rather than failing (redis-py's default pool
            # raises MaxConnectionsError, which the bus then retried with growing back-offs).
            pool = aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=MAX_CONNECTIONS,
                timeout=POOL_WAIT_S,
                socket_connect_timeout=2.0,
            )
            client = aioredis.Redis.from_pool(pool)
            try:
                await client.ping()
            except RedisAuthenticationError as exc:  # not a network blip: no use retrying
                await client.aclose()
                raise PermissionError(
                    f"Redis at {redacted(url)} refused the login: {exc}"
                ) from None
            except BaseException:
                await client.aclose()
                raise
            return client

        client = await connect_with_backoff(
            "Redis",
            redacted(url),
            attempt,
            timeout_s=timeout_s,
            retry_on=(RedisConnectionError, RedisTimeoutError, OSError),
        )
        return cls(client, url)

    @property
    def client(self) -> aioredis.Redis:
        """The Redis client itself, for what no method covers (tests, repairs)."""
        return self._redis

    async def ping(self) -> None:
        """Raises when Redis does not answer (readiness probes)."""
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()
