"""Every Redis key the store uses, named once (who writes and reads each:
docs/architecture.md, "Redis keys").

- `adapter:{job}`   hash version, uri, step, updated_at — moved only forward (Lua CAS); its
                    version is the job's trained version (common/state/flow.py reads it)
- `adapter-versions:{job}` hash version -> uri of every published version
- `fence:{job}`     the job's fencing epoch: incremented by each trainer taking it over
- `job:{job}`       hash spec (wire-encoded JobSpec), tenant, status, reason, created_at,
                    updated_at, samples (its G x B x (S + 1) + eval.tasks, for its tenant's quota)
- `jobs`            set of every registered job id (listings; no sweep or script walks it)
- `active-jobs`     set of the jobs env_svc's sweep still visits: registered, and not yet
                    ended with their evaluations done (then their state expires)
- `unkept-jobs`     sorted set `{tenant}/{job}` -> when the record of an ended job that
                    never published an adapter expires: then its entries in `jobs` and
                    `tenant-jobs:{tenant}` go too (env_svc's sweep)
- `tenant-load:{name}` hash jobs, samples: the tenant's jobs not ended and their samples in
                    flight, moved by registration and by the move to a terminal status (the
                    quota's counters)
- `rejected:{job}`  why a job was rejected (never registered), for a week
- `tenant:{name}`, `tenants`, `apikey:{key id}`, `tenant-keys:{name}`, `owner:{job}`,
  `tenant-jobs:{name}`: tenants, their API keys, job owners and each tenant's jobs
  (common/state/tenants.py)
- `flow:{job}`      hash of the flow-control counters (common/state/flow.py)
- `claims:{job}`    hash of claimed group indices not yet fully sent (common/state/flow.py)
- `ledger:{job}`    stream: the job's audit ledger (issued, sent, trained, dropped groups)
- `dedup:{scope}:{job}` set of ids already handled in that scope (e.g. trained groups)
- evaluations: `evals:{job}`, `evalresends:{job}`, `evalseen:{job}:{v}`, `eval:{job}:{v}`
  (common/state/evals.py)
- `stats:rollout:{replica}` hash of a rollout replica's numbers (RolloutReplicaStats), expiring;
  `stats-history:rollout:{replica}` the same numbers over time (a capped stream)
- `runtime:{service}:{replica}` hash of what a replica computes on and in (hardware,
  precision, why; env_svc's: the environments it serves), expiring
- `stack:restarts`  hash service -> restarts by the embedded stack's supervisor
- `usage:{job}`     hash of the job's usage counts and its tenant; `tenant-usage:{tenant}` the
                    tenant's, outliving its jobs; `usage-unattributed` work of no job
                    (common/state/usage.py)

A job's working state (ledger, de-dup sets, flow, claims, evaluation keys) expires a week
after the job ends (`registry.ENDED_TTL_S`); its record and adapter pointers stay if it
published an adapter (something to export), else its record and owner binding go too.

Each family is a `Key`: `flow_key("j")` is `flow:j`, `flow_key.prefix` is `flow:`. Lua
scripts name some keys without declaring them (the adapter pointer read by the issue
script, a tenant's job records read by the quota rule): tests/unit/test_keyspace.py checks
that their prefixes agree with these.
"""

from __future__ import annotations


class Key:
    """A family of Redis keys: a prefix, then the ids joined by ':'."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, *ids: str | int) -> str:
        return self.prefix + ":".join(str(i) for i in ids)


adapter_key = Key("adapter:")
versions_key = Key("adapter-versions:")
fence_key = Key("fence:")
job_key = Key("job:")
JOBS = "jobs"
ACTIVE_JOBS = "active-jobs"
ACTIVE_SINCE = "active-jobs-since"
UNKEPT_JOBS = "unkept-jobs"
"""Set once `active-jobs` and the `tenant-load` counters were filled from `jobs` (a
deployment whose Redis predates them: `JobRegistry.backfill_active`)."""
rejection_key = Key("rejected:")
flow_key = Key("flow:")
claims_key = Key("claims:")
"""Hash of the job's claimed group indices whose first requests are not all sent yet,
index -> when claimed (or last re-sent); env_svc's sweeper re-sends the old ones."""
ledger_key = Key("ledger:")
"""The job's audit ledger: a Redis stream with one entry per effect on a group, each written
by the same Lua script as the effect (common/state/audit.py reads it)."""
dedup_key = Key("dedup:")
"""(scope, job)"""
evals_key = Key("evals:")
eval_resends_key = Key("evalresends:")
eval_seen_key = Key("evalseen:")
"""(job, version)"""
eval_tally_key = Key("eval:")
"""(job, version)"""
tenant_key = Key("tenant:")
TENANTS = "tenants"
api_key_key = Key("apikey:")
tenant_keys_key = Key("tenant-keys:")
owner_key = Key("owner:")
tenant_jobs_key = Key("tenant-jobs:")
tenant_load_key = Key("tenant-load:")
stats_key = Key("stats:rollout:")
stats_history_key = Key("stats-history:rollout:")
runtime_key = Key("runtime:")
"""(service, replica)"""
RESTARTS = "stack:restarts"
usage_key = Key("usage:")
tenant_usage_key = Key("tenant-usage:")
UNATTRIBUTED_USAGE = "usage-unattributed"
