"""What a service sees of Kafka's producer and of Redis: two small protocols.

Services are written against these, not against aiokafka or redis-py, so each service's
handlers run unchanged on the real `Producer` / `RedisStore` and, in unit tests, on an
in-memory bus and a store over fakeredis (tests/fakes.py): the same scenarios run on both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from common.evals import EvalTally
from common.flow import DroppedGroup, FlowState, IssuedGroup
from common.lifecycle import JobState, RolloutReplicaStats
from common.messages import JobSpec, Message
from common.store import AdapterPointer, JobRecord
from common.tenants import TenantLimits, TenantRegistry


class Sender(Protocol):
    """Produces a message to the topic its type belongs to (common.bus.Producer)."""

    async def send(self, message: Message) -> None: ...


class StateStore(Protocol):
    """The Redis state the services read and write (common.store.RedisStore)."""

    async def ping(self) -> None: ...

    async def close(self) -> None: ...

    # adapter pointers
    async def publish_adapter(
        self,
        job_id: str,
        version: int,
        uri: str,
        step: int,
        trained_groups: Sequence[str] = (),
        *,
        epoch: int = 0,
    ) -> bool: ...

    async def take_over(self, job_id: str) -> int: ...

    async def published_uri(self, job_id: str, version: int) -> str | None: ...

    async def adapter(self, job_id: str) -> AdapterPointer | None: ...

    async def adapters(self) -> dict[str, AdapterPointer]: ...

    # job registry
    async def register_job(
        self, spec: JobSpec, status: JobState = "pending", *, limits: TenantLimits | None = None
    ) -> bool: ...

    async def bind_owner(self, job_id: str, tenant: str) -> str: ...

    async def owner(self, job_id: str) -> str | None: ...

    async def record_rejection(self, job_id: str, reason: str) -> None: ...

    @property
    def tenants(self) -> TenantRegistry: ...

    async def job(self, job_id: str) -> JobRecord | None: ...

    async def set_job_status(self, job_id: str, status: JobState, reason: str = "") -> bool: ...

    # flow control
    async def try_issue_group(
        self, job_id: str, *, max_staleness: int, groups_per_step: int, max_groups: int
    ) -> IssuedGroup | None: ...

    async def finish_claim(self, job_id: str, index: int) -> None: ...

    async def flow(self, job_id: str) -> FlowState: ...

    async def take_stale_claims(self, job_id: str, older_than_s: float) -> list[IssuedGroup]: ...

    async def job_ids(self) -> list[str]: ...

    async def record_dropped_group(
        self, job_id: str, group_id: str, *, invalid: bool, kind: str = "dropped"
    ) -> DroppedGroup: ...

    # replica stats
    async def put_replica_stats(
        self, replica: str, stats: RolloutReplicaStats, *, ttl_s: int
    ) -> None: ...

    async def replica_stats(self) -> dict[str, RolloutReplicaStats]: ...

    async def put_runtime(
        self, service: str, replica: str, fields: Mapping[str, str], *, ttl_s: int
    ) -> None: ...

    # de-duplication
    async def dropped_among(self, job_id: str, group_ids: Sequence[str]) -> set[str]: ...

    # evaluations
    async def claim_eval(self, job_id: str, version: int) -> bool: ...

    async def take_stale_evals(self, job_id: str, older_than_s: float) -> list[int]: ...

    async def record_eval(
        self,
        job_id: str,
        version: int,
        episode_id: str,
        *,
        reward: float,
        solved: bool,
        components: Mapping[str, float],
    ) -> int: ...

    async def eval_tally(self, job_id: str, version: int) -> EvalTally: ...

    async def count_eval_resend(self, job_id: str, version: int) -> int: ...

    async def finish_eval(self, job_id: str, version: int) -> None: ...

    async def mark_seen(self, scope: str, job_id: str, item_id: str) -> bool: ...

    async def seen(self, scope: str, job_id: str, item_id: str) -> bool: ...

    async def last_activity(self, job_id: str) -> float | None: ...

    async def live_groups(self, job_id: str) -> list[str]: ...
