"""Every Redis key the store uses, named once (who writes and reads each:
docs/architecture.md, "Redis keys").

- `adapter:{job}`   hash version, uri, step, updated_at — moved only forward (Lua CAS); its
                    version is the job's trained version (common/flow.py reads it)
- `adapter-versions:{job}` hash version -> uri of every published version
- `fence:{job}`     the job's fencing epoch: incremented by each trainer taking it over
- `job:{job}`       hash spec (wire-encoded JobSpec), tenant, status, reason, created_at,
                    updated_at, samples (its G x B x (S + 1), for its tenant's quota)
- `jobs`            set of every registered job id
- `rejected:{job}`  why a job was rejected (never registered), for a week
- tenants, API keys, job owners and each tenant's jobs: common/tenants.py
- `flow:{job}`      hash of the flow-control counters (common/flow.py)
- `claims:{job}`    hash of claimed group indices not yet fully sent (common/flow.py)
- `ledger:{job}`    stream: the job's audit ledger (issued, sent, trained, dropped groups)
- `dedup:{scope}:{job}` set of ids already handled in that scope (e.g. trained groups)
- evaluations: `evals:{job}`, `evalresends:{job}`, `evalseen:{job}:{v}`, `eval:{job}:{v}`
  (common/evals.py)
- `stats:rollout:{replica}` hash of a rollout replica's numbers (RolloutReplicaStats), expiring;
  `stats-history:rollout:{replica}` the same numbers over time (a capped stream)
- `runtime:{service}:{replica}` hash of what a replica computes on and in (hardware,
  precision, why), expiring
- `stack:restarts`  hash service -> restarts by the embedded stack's supervisor

Lua scripts name some keys without declaring them (the adapter pointer read by the issue
script, a tenant's job records read by the register script): their prefixes here and there
must agree, and tests/unit/test_keyspace.py checks that they do.
"""

from __future__ import annotations

ADAPTER_PREFIX = "adapter:"
JOB_PREFIX = "job:"
JOBS = "jobs"
RESTARTS = "stack:restarts"
STATS_PREFIX = "stats:rollout:"
STATS_HISTORY_PREFIX = "stats-history:rollout:"
RUNTIME_PREFIX = "runtime:"


def adapter_key(job_id: str) -> str:
    return f"{ADAPTER_PREFIX}{job_id}"


def versions_key(job_id: str) -> str:
    return f"adapter-versions:{job_id}"


def fence_key(job_id: str) -> str:
    return f"fence:{job_id}"


def job_key(job_id: str) -> str:
    return f"{JOB_PREFIX}{job_id}"


def rejection_key(job_id: str) -> str:
    return f"rejected:{job_id}"


def flow_key(job_id: str) -> str:
    return f"flow:{job_id}"


def claims_key(job_id: str) -> str:
    """Hash of the job's claimed group indices whose first requests are not all sent yet,
    index -> when claimed (or last re-sent); env_svc's sweeper re-sends the old ones."""
    return f"claims:{job_id}"


def ledger_key(job_id: str) -> str:
    """The job's audit ledger: a Redis stream with one entry per effect on a group, each
    written by the same Lua script as the effect (console/audit.py reads it)."""
    return f"ledger:{job_id}"


def dedup_key(scope: str, job_id: str) -> str:
    return f"dedup:{scope}:{job_id}"
