"""Usage per tenant and job: what each one's work cost the shared stack, counted where the
work happens and kept in Redis for the API, the console and `marlaas usage`.

- rollout_svc: tokens its engine generated, by what for: a training episode's turn
  (`tokens`), an evaluation's (`eval_tokens`), a chat completion or a judge's answer for the
  job (`chat_tokens`). Every generation the engine finishes is counted once, so the counts of
  all jobs (and `unattributed`: base-model chats of no job) add up to the tokens the engine
  reports (`RolloutReplicaStats.generated_tokens`);
- env_svc: finished episodes, training (`episodes`) and evaluation (`eval_episodes`);
- trainer_svc: its compute seconds spent on the job (`trainer_s`: a step's pass shared among
  jobs is split by their tokens), and the bytes of each adapter version it published
  (`stored_bytes`: published versions are kept for export; checkpoints are pruned).

A process adds to a `UsageMeter` in memory and flushes it every `FLUSH_EVERY_S` (and when it
stops) in one transaction per flush: `usage:{job}` (with its tenant) and `tenant-usage:{tenant}`,
which outlives its jobs' records (an ended job's usage is kept `JOB_USAGE_TTL_S` after its last
count; the tenant's total is never lost to that). A process killed between flushes loses at
most its last `FLUSH_EVERY_S` of counts; a redelivered record is work done again and counted
again.
"""

from __future__ import annotations

import asyncio
import csv
import io
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Protocol

from common.state.keyspace import UNATTRIBUTED_USAGE, tenant_usage_key, usage_key
from common.state.redis_part import RedisPart, text, texts

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 2.0
JOB_USAGE_TTL_S = 90 * 24 * 3600
"""A job's own counts stay this long after its last one (a billing period and more)."""
FLOAT_FIELDS = frozenset({"trainer_s"})


@dataclass
class Usage:
    """One job's or tenant's counts (zeros where nothing was counted)."""

    tokens: int = 0
    """Tokens generated for its training episodes."""
    eval_tokens: int = 0
    chat_tokens: int = 0
    """Tokens of chat completions with its adapters, and of a judge's answers for it."""
    episodes: int = 0
    eval_episodes: int = 0
    trainer_s: float = 0.0
    """Trainer compute seconds (its share of each pass it was in)."""
    stored_bytes: int = 0
    """Bytes of its published adapter versions."""

    @classmethod
    def of(cls, stored: Mapping[str, str]) -> Usage:
        found = cls()
        for name in USAGE_FIELDS:
            if name in stored:
                value = float(stored[name])
                setattr(found, name, value if name in FLOAT_FIELDS else int(value))
        return found

    @property
    def generated_tokens(self) -> int:
        """Every token the engine generated for it."""
        return self.tokens + self.eval_tokens + self.chat_tokens

    def as_map(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in USAGE_FIELDS}


USAGE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Usage))


@dataclass
class _Pending:
    tenant: str
    counts: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))


class UsageMeter:
    """Counts added in memory (`add`, no I/O: safe on any hot path) and flushed to Redis."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}

    def add(self, job_id: str, tenant: str, **counts: float) -> None:
        """Add `counts` (fields of `Usage`) to the job's; a job id "" is unattributed work."""
        unknown = set(counts) - set(USAGE_FIELDS)
        if unknown:
            raise ValueError(f"not usage fields: {sorted(unknown)}")
        pending = self._pending.get(job_id)
        if pending is None:
            pending = self._pending[job_id] = _Pending(tenant)
        pending.tenant = pending.tenant or tenant
        for name, value in counts.items():
            pending.counts[name] += value

    async def flush(self, counters: UsageCounters) -> None:
        """Write what was added since the last flush; kept for the next one if Redis fails."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        try:
            await counters.add({job: (p.tenant, dict(p.counts)) for job, p in pending.items()})
        except Exception:
            for job_id, kept in pending.items():  # back in, with anything added meanwhile
                self.add(job_id, kept.tenant, **kept.counts)
            raise

    async def run(
        self,
        counters: Callable[[], UsageCounters],
        stopping: asyncio.Event,
        every_s: float = FLUSH_EVERY_S,
    ) -> None:
        """Flush every `every_s` until `stopping`, then once more."""
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), timeout=every_s)
            except TimeoutError:
                pass
            try:
                await self.flush(counters())
            except Exception as exc:  # Redis away: the counts wait for the next flush
                log.warning("usage not written yet: %r", exc)


async def flush_usage(meter: UsageMeter, store: HasUsage | None) -> None:
    """The last flush of a stopping process (nothing when it has no store, or Redis fails:
    logged)."""
    if store is None:
        return
    try:
        await meter.flush(store.usage)
    except Exception as exc:
        log.warning("usage of the last %g s lost: %r", FLUSH_EVERY_S, exc)


class HasUsage(Protocol):
    @property
    def usage(self) -> UsageCounters: ...


class UsageCounters(RedisPart):
    """`store.usage`: the counts in Redis."""

    async def add(self, counts: Mapping[str, tuple[str, Mapping[str, float]]]) -> None:
        """Add each job's (tenant, counts) to the job's and its tenant's, in one transaction."""
        async with self._redis.pipeline(transaction=True) as pipe:
            for job_id, (tenant, numbers) in counts.items():
                keys = (
                    [usage_key(job_id), tenant_usage_key(tenant)]
                    if job_id
                    else [UNATTRIBUTED_USAGE]
                )
                for name, value in numbers.items():
                    for key in keys:
                        if name in FLOAT_FIELDS:
                            pipe.hincrbyfloat(key, name, value)
                        else:
                            pipe.hincrby(key, name, int(value))
                if job_id:
                    pipe.hset(usage_key(job_id), "tenant", tenant)
                    pipe.expire(usage_key(job_id), JOB_USAGE_TTL_S)
            await pipe.execute()

    async def of_jobs(self, job_ids: Iterable[str]) -> dict[str, Usage]:
        """Each job's counts (zeros for a job with none)."""
        ids = list(job_ids)
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(usage_key(job_id))
            stored = await pipe.execute()
        return {
            job_id: Usage.of(texts(found or {})) for job_id, found in zip(ids, stored, strict=True)
        }

    async def of_tenant(self, tenant: str) -> Usage:
        return Usage.of(texts(await self._redis.hgetall(tenant_usage_key(tenant)) or {}))

    async def tenants(self) -> list[str]:
        """The tenants with usage counted."""
        return [
            text(key).removeprefix(tenant_usage_key.prefix)
            async for key in self._redis.scan_iter(match=f"{tenant_usage_key.prefix}*", count=500)
        ]

    async def generated_tokens(self) -> int:
        """Every token counted as generated: every tenant's and the unattributed ones (what
        the engines report generating, once each service's last counts are flushed)."""
        counted = (await self.unattributed()).generated_tokens
        for tenant in await self.tenants():
            counted += (await self.of_tenant(tenant)).generated_tokens
        return counted

    async def unattributed(self) -> Usage:
        return Usage.of(texts(await self._redis.hgetall(UNATTRIBUTED_USAGE) or {}))


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's total and its jobs' counts (jobs whose record is gone are in the total
    only)."""

    tenant: str
    total: Usage
    jobs: dict[str, Usage]

    def as_map(self) -> dict[str, object]:
        """The total and each job's counts, as JSON takes them."""
        return {
            "total": self.total.as_map(),
            "jobs": {job_id: usage.as_map() for job_id, usage in sorted(self.jobs.items())},
        }

    def rows(self) -> list[tuple[str, str, Usage]]:
        """(tenant, job, usage) per job, then the tenant's total (job "*")."""
        return [(self.tenant, job_id, usage) for job_id, usage in sorted(self.jobs.items())] + [
            (self.tenant, "*", self.total)
        ]


def usage_csv(rows: Iterable[tuple[str, str, Usage]]) -> str:
    """(tenant, job, usage) rows as CSV with a header: `tenant,job,<fields>`."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["tenant", "job", *USAGE_FIELDS])
    for tenant, job_id, usage in rows:
        writer.writerow([tenant, job_id, *(_cell(getattr(usage, n)) for n in USAGE_FIELDS)])
    return out.getvalue()


def _cell(value: float) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
