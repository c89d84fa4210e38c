"""Tenancy in the services' handlers: a job id stays with its first tenant, limits are
enforced where a job is accepted, and an adapter update must be the trainer's own."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import msgspec
import pytest

from common.state.audit import Audit
from common.state.keyspace import (
    ACTIVE_JOBS,
    ACTIVE_SINCE,
    dedup_key,
    eval_seen_key,
    eval_tally_key,
    evals_key,
    flow_key,
    job_key,
    ledger_key,
    owner_key,
    tenant_load_key,
)
from common.state.redis_part import texts
from common.state.registry import ENDED_TTL_S, REJECTION_TTL_S
from common.state.tenants import QuotaError, TenantLimits
from common.wire.codec import encode
from common.wire.messages import (
    EnvSettings,
    EvalSettings,
    Event,
    GenerationRequest,
    JobCommand,
    JobSpec,
    MessageDecodeError,
    Topic,
    new_id,
    result_for,
)
from env_svc.chat_template import ChatTokenizer
from env_svc.jobs.admission import ForeignJobError
from tests.fakes import Backend, Inbox, KafkaBackend
from tests.handler_kit import (
    GatedEngine,
    adapter_update,
    adapter_uri,
    env_service,
    events,
    job_spec,
    rollout_service,
)


async def test_a_job_id_stays_with_the_tenant_that_sent_it_first(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    service = env_service(backend, tokenizer)
    jobs = Inbox(Topic.JOBS)
    spec = job_spec("owned", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    await jobs.hand(service.handle, spec)
    assert (await backend.store.jobs.claim_id(spec.job_id, None)).owner == "acme"
    hijack = msgspec.structs.replace(spec, tenant="mallory")
    broken = msgspec.structs.replace(hijack, env=EnvSettings(name="no-such-env"))
    for attempt in (hijack, broken):
        with pytest.raises(ForeignJobError, match="belongs to tenant 'acme'"):
            await jobs.hand(service.handle, attempt)  # the consumer loop dead-letters it
    # A spec that does not decode, naming the taken id: no `rejected` event either.
    raw = encode(hijack).replace(b"group_size", b"group_sizf")
    await service.on_undecodable(Topic.JOBS, raw, MessageDecodeError(Topic.JOBS, "typo"))
    sent = await backend.sent(Topic.EVENTS, spec.job_id, expect=1)
    assert [e.event for e in events(sent, "accepted")] == ["accepted"]
    assert not events(sent, "rejected")
    record = await backend.store.jobs.get(spec.job_id)
    assert record is not None and record.spec.tenant == "acme" and record.status == "running"


async def test_a_tenants_limits_are_enforced_where_jobs_are_accepted(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    service = env_service(backend, tokenizer)
    jobs = Inbox(Topic.JOBS)
    tenant = f"small-{id(backend)}"
    await backend.store.tenants.add(
        tenant, TenantLimits(max_concurrent_jobs=1, max_samples_in_flight=8, max_steps=5)
    )

    def spec(name: str, **rl: int) -> JobSpec:
        made = job_spec(name, group_size=2, groups_per_step=1, max_staleness=1, max_steps=2)
        return msgspec.structs.replace(
            made, tenant=tenant, rl=msgspec.structs.replace(made.rl, **rl)
        )

    first, second, long, wide = (
        spec("first"),
        spec("second"),
        spec("long", max_steps=6),
        spec("wide", group_size=8),
    )
    for job in (first, second, long, wide):
        await jobs.hand(service.handle, job)
    reasons = {}
    for job in (second, long, wide):
        (rejected,) = events(await backend.sent(Topic.EVENTS, job.job_id, expect=1), "rejected")
        reasons[job.job_id] = rejected.reason
    assert reasons[second.job_id].startswith("quota max_concurrent_jobs: tenant")
    assert "its limit is 1" in reasons[second.job_id]
    assert "quota max_steps: rl.max_steps 6 exceeds the limit 5" in reasons[long.job_id]
    assert (
        "quota max_samples_in_flight: G x B x (S + 1) + eval.tasks 16 exceeds the limit 8"
        in (reasons[wide.job_id])
    )
    assert events(await backend.sent(Topic.EVENTS, first.job_id, expect=1), "accepted")


async def test_rollout_loads_only_the_adapters_the_trainer_published(backend: Backend) -> None:
    engine = GatedEngine()
    service = rollout_service(backend, engine)
    job = job_spec("adapters", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    other = job_spec("other", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    await backend.store.adapters.publish(other.job_id, 1, adapter_uri(other.job_id, 1), 1)
    forged = [
        adapter_update(job.job_id, 1),  # never published
        msgspec.structs.replace(  # another job's published adapter, under this job
            adapter_update(job.job_id, 1), uri=adapter_uri(other.job_id, 1)
        ),
        msgspec.structs.replace(adapter_update(job.job_id, 1), uri="/etc"),  # any path
    ]
    for update in forged:
        await service.on_adapter(update)
    assert engine.loaded == [] and job.job_id not in service.latest
    await backend.store.adapters.publish(job.job_id, 1, adapter_uri(job.job_id, 1), 1)
    await service.on_adapter(adapter_update(job.job_id, 1))  # the trainer's own
    assert [(a.job_id, a.version) for a in engine.loaded] == [(job.job_id, 1)]


async def test_the_operator_restricts_a_tenants_environments(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    service = env_service(backend, tokenizer)
    tenant = f"narrow-{id(backend)}"
    await backend.store.tenants.add(tenant, TenantLimits(environments=("calculator",)))
    spec = msgspec.structs.replace(
        job_spec("arith", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1),
        tenant=tenant,
    )
    await Inbox(Topic.JOBS).hand(service.handle, spec)
    (rejected,) = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=1), "rejected")
    assert rejected.reason == (
        f"quota environments: tenant {tenant!r} may use calculator; not 'arithmetic'"
    )


@pytest.mark.parametrize(
    "path", ["/proc/self/environ", "/etc/passwd", "/dev/zero", "../globex/secret.jsonl"]
)
async def test_env_svc_rejects_a_dataset_path_out_of_the_tenants_folder(
    backend: Backend,
    tokenizer: ChatTokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    (tmp_path / "globex").mkdir()
    (tmp_path / "globex" / "secret.jsonl").write_text('{"question": "q", "answer": "s3cr3t"}\n')
    monkeypatch.setenv("MARLAAS_DATA_DIR", str(tmp_path))
    service = env_service(backend, tokenizer)
    made = job_spec("data", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1)
    spec = msgspec.structs.replace(
        made, env=EnvSettings(name="dataset", params={"path": path, "match": "number"})
    )
    await Inbox(Topic.JOBS).hand(service.handle, spec)
    (rejected,) = events(await backend.sent(Topic.EVENTS, spec.job_id, expect=1), "rejected")
    assert rejected.reason.startswith("environment 'dataset': bad param 'path': ")
    assert "s3cr3t" not in rejected.reason and str(tmp_path) not in rejected.reason
    assert await backend.store.jobs.get(spec.job_id) is None
    # The id's binding to its tenant ends with the rejection's record: no key left forever.
    assert 0 < await backend.store.client.ttl(owner_key(spec.job_id)) <= REJECTION_TTL_S


async def test_a_spec_sent_again_under_a_running_jobs_id_never_locks_its_tenant_out(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    service = env_service(backend, tokenizer)
    jobs = Inbox(Topic.JOBS)
    tenant = f"again-{id(backend)}"
    spec = msgspec.structs.replace(
        job_spec("again", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2),
        tenant=tenant,
    )
    # Rejected first (straight to Kafka, no API to refuse the taken id), then sent right.
    await jobs.hand(service.handle, msgspec.structs.replace(spec, env=EnvSettings(name="nope")))
    assert 0 < await backend.store.client.ttl(owner_key(spec.job_id)) <= REJECTION_TTL_S
    await jobs.hand(service.handle, spec)
    # Registered: the id is the tenant's for as long as the job's record stays.
    assert await backend.store.client.ttl(owner_key(spec.job_id)) == -1
    # Its tenant's limits lowered, then the spec redelivered (a restart) or sent again broken.
    await backend.store.tenants.add(tenant, TenantLimits(max_steps=1))
    for again in (spec, msgspec.structs.replace(spec, env=EnvSettings(name="nope"))):
        await jobs.hand(service.handle, again)
    sent = await backend.sent(Topic.EVENTS, spec.job_id, expect=2)
    assert len(events(sent, "rejected")) == len(events(sent, "accepted")) == 1
    assert await backend.store.client.ttl(owner_key(spec.job_id)) == -1
    # A rejection recorded under the id anyway (an undecodable spec) leaves the binding be.
    await backend.store.jobs.record_rejection(spec.job_id, "late")
    assert await backend.store.client.ttl(owner_key(spec.job_id)) == -1
    record = await backend.store.jobs.get(spec.job_id)
    assert record is not None and record.status == "running" and record.spec.rl.max_steps == 2


async def test_a_replayed_command_changes_nothing(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """pause, resume, then the pause record again (a replay of a signed record, or a
    redelivery): the job stays running (issue 24)."""
    service = env_service(backend, tokenizer)
    jobs = Inbox(Topic.JOBS)
    spec = job_spec("replay", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    await jobs.hand(service.handle, spec)
    pause = JobCommand(command_id=new_id(), job_id=spec.job_id, action="pause")
    resume = JobCommand(command_id=new_id(), job_id=spec.job_id, action="resume")
    for command in (pause, resume, pause):
        await jobs.hand(service.handle, command)
    record = await backend.store.jobs.get(spec.job_id)
    assert record is not None and record.status == "running"
    sent = await backend.sent(Topic.EVENTS, spec.job_id, expect=3)
    assert [e.event for e in sent if isinstance(e, Event)] == ["accepted", "paused", "resumed"]


async def test_a_job_record_older_than_its_rejection_is_remembered_is_refused(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """A rejected job's id and reason are kept a week; a replay of its spec after that (a
    consumer group's offsets lost with a long outage re-reads the topic) would have started
    a job that was refused. A job or command record older than that is refused by its age,
    with the reason (a dead letter); within the week the job's record and the rejection
    de-duplicate it."""
    service = env_service(backend, tokenizer)
    spec = job_spec("old", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    jobs = Inbox(Topic.JOBS)
    old = dataclasses.replace(
        jobs.delivery(), timestamp_ms=int((time.time() - REJECTION_TTL_S - 3600) * 1000)
    )
    for record in (spec, JobCommand(command_id=new_id(), job_id=spec.job_id, action="cancel")):
        with pytest.raises(ValueError, match="past the 7 days a job's id and rejection"):
            await service.handle(record, old)
    assert await backend.store.jobs.get(spec.job_id) is None
    await jobs.hand(service.handle, spec)  # sent again: a job
    assert await backend.store.jobs.get(spec.job_id) is not None


async def test_a_replayed_result_of_a_finished_evaluation_is_not_counted(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """A result of an evaluation that has finished, or whose state went with its ended job
    (a replay), counts nothing and brings back no state without an expiry."""
    service = env_service(backend, tokenizer)
    spec = msgspec.structs.replace(
        job_spec("replayed", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2),
        eval=EvalSettings(tasks=1),
    )
    await Inbox(Topic.JOBS).hand(service.handle, spec)
    sent = await backend.sent(Topic.PROMPTS, spec.job_id, expect=3)
    (request,) = [r for r in sent if isinstance(r, GenerationRequest) and "/eval0/" in r.episode_id]
    completion = [*tokenizer.encode("0"), tokenizer.eos_token_id]
    result = result_for(
        request, completion_token_ids=completion, logprobs=[-0.1] * len(completion),
        adapter_version=0, finish_reason="stop",
    )  # fmt: skip
    results = Inbox(Topic.ROLLOUTS)
    await results.hand(service.handle, result)
    assert (await backend.store.evals.tally(spec.job_id, 0)).episodes == 1
    client = backend.store.client
    await client.delete(eval_tally_key(spec.job_id, 0), dedup_key("results", spec.job_id))
    await results.hand(service.handle, result)  # its evaluation finished: not counted
    await client.delete(evals_key(spec.job_id), eval_seen_key(spec.job_id, 0))
    await results.hand(service.handle, result)  # its state gone (expired): nor here
    assert not await client.exists(eval_tally_key(spec.job_id, 0), eval_seen_key(spec.job_id, 0))
    events = await backend.sent(Topic.EVENTS, spec.job_id, expect=2)
    assert [e.event for e in events if isinstance(e, Event)] == ["accepted", "eval"]


async def test_an_ended_jobs_environment_leaves_the_cache(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    service, other = env_service(backend, tokenizer), env_service(backend, tokenizer)
    jobs = Inbox(Topic.JOBS)
    spec = job_spec("ends", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    await jobs.hand(service.handle, spec)
    assert spec.job_id in service.environments.by_job
    await other.environments.get(spec)  # another replica, which ran one of its episodes
    await jobs.hand(
        service.handle, JobCommand(command_id=new_id(), job_id=spec.job_id, action="cancel")
    )
    await service.sweep_claims()
    assert spec.job_id not in service.environments.by_job
    # Its working state expires in a week; later sweeps skip it. It never published an
    # adapter (nothing to export), so its record and owner binding expire with it.
    client = backend.store.client
    for key in (ledger_key, flow_key, job_key, owner_key):
        assert 0 < await client.ttl(key(spec.job_id)) <= ENDED_TTL_S, key
    assert spec.job_id not in await backend.store.jobs.active_ids()  # no sweep visits it
    await other.sweep_claims()  # nor keeps its environment
    assert spec.job_id not in other.environments.by_job
    # Its audit is kept in the record, for when the ledger has gone.
    summary = await backend.store.jobs.audit_summary(spec.job_id)
    assert summary is not None
    kept = Audit.from_json(summary)
    assert (kept.status, kept.issued, kept.ok) == ("cancelled", 1, True)
    assert kept.to_json() == summary


async def test_only_a_job_that_trained_stays_for_good(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """Submitted and cancelled in a loop, jobs that never trained leave nothing that lasts:
    their records expire with their state and a sweep a week on takes them out of the
    listings; a job with a published adapter stays (its exports)."""
    service, store = env_service(backend, tokenizer), backend.store
    jobs, tenant = Inbox(Topic.JOBS), f"churn-{new_id()[:6]}"
    made = job_spec("churn", group_size=2, groups_per_step=1, max_staleness=0, max_steps=2)
    churned, trained = (
        msgspec.structs.replace(made, job_id=f"{tenant}-{name}", tenant=tenant)
        for name in ("churned", "trained")
    )
    for spec in (churned, trained):
        await jobs.hand(service.handle, spec)
    await store.adapters.publish(trained.job_id, 1, adapter_uri(trained.job_id, 1), 1)
    for spec in (churned, trained):
        cancel = JobCommand(command_id=new_id(), job_id=spec.job_id, action="cancel")
        await jobs.hand(service.handle, cancel)
    await service.sweep_claims()
    client = store.client
    assert 0 < await client.ttl(job_key(churned.job_id)) <= ENDED_TTL_S
    assert await client.ttl(job_key(trained.job_id)) == -1
    assert await client.ttl(owner_key(trained.job_id)) == -1
    listed = {churned.job_id, trained.job_id}
    assert listed <= set(await store.jobs.of_tenant(tenant))  # listed while its record lasts
    assert await store.jobs.drop_expired_listings() == 0  # not due yet
    a_week_on = time.time() + ENDED_TTL_S + 1
    await client.delete(job_key(churned.job_id))  # as Redis expires it then
    assert await store.jobs.drop_expired_listings(now=a_week_on) >= 1
    assert await store.jobs.of_tenant(tenant) == [trained.job_id]
    assert churned.job_id not in await store.jobs.ids()
    assert trained.job_id in await store.jobs.ids()


async def test_a_tenants_quota_is_counted_from_registration_to_its_end(backend: Backend) -> None:
    """The quota reads the tenant's two counters (`tenant-load:{tenant}`): a job counts from
    its registration until its move to a terminal status, once, however many jobs the tenant
    ever had; a deployment whose Redis predates the counters fills them once."""
    store, tenant = backend.store, f"load-{new_id()[:6]}"
    job = job_spec("load", group_size=2, groups_per_step=2, max_staleness=1, max_steps=2)
    specs = [msgspec.structs.replace(job, job_id=f"{tenant}-{i}", tenant=tenant) for i in range(5)]
    limits = TenantLimits(max_concurrent_jobs=3, max_samples_in_flight=1000)
    for spec in specs[:3]:
        assert await store.jobs.register(spec, status="running", limits=limits)
    with pytest.raises(QuotaError, match="has 3 jobs that have not ended"):
        await store.jobs.check_quota(specs[3], limits)
    assert await store.jobs.set_status(specs[0].job_id, "completed")
    assert not await store.jobs.set_status(specs[0].job_id, "cancelled")  # ended once
    await store.jobs.check_quota(specs[3], limits)
    assert await store.jobs.register(specs[3], status="running", limits=limits)
    assert await store.jobs.register(specs[4], status="completed")  # ended: no load
    load = await store.client.hgetall(tenant_load_key(tenant))
    assert texts(load) == {"jobs": "3", "samples": str(3 * 8)}
    assert set(await store.jobs.active_ids()) >= {s.job_id for s in specs}
    # A Redis from before the counters and the active set (every tenant's: the store may be
    # shared with other tests): filled once, from the records.
    loads = [key async for key in store.client.scan_iter(match=tenant_load_key("*"))]
    await store.client.delete(*loads, ACTIVE_JOBS, ACTIVE_SINCE)
    assert await store.jobs.backfill_active() is not None
    assert await store.jobs.backfill_active() is None
    load = await store.client.hgetall(tenant_load_key(tenant))
    assert texts(load) == {"jobs": "3", "samples": str(3 * 8)}
    assert set(await store.jobs.active_ids()) >= {s.job_id for s in specs}


async def test_no_quota_check_or_sweep_walks_a_tenants_history(
    backend: Backend, tokenizer: ChatTokenizer
) -> None:
    """A tenant with 200 ended jobs: the quota's script reads one hash (Valkey's command
    counts: it looped over all 200 job records before), and env_svc's sweep visits none of
    them once they are retired."""
    if not isinstance(backend, KafkaBackend):
        pytest.skip("command counts are Valkey's (INFO commandstats)")
    store, tenant = backend.store, f"history-{new_id()[:6]}"
    job = job_spec("old", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1)
    for i in range(200):
        spec = msgspec.structs.replace(job, job_id=f"{tenant}-{i}", tenant=tenant)
        await store.jobs.register(spec, status="running")
        await store.jobs.set_status(spec.job_id, "completed")
    service = env_service(backend, tokenizer)
    await service.sweep_claims()  # retires what has ended (their evaluations are done)
    assert not {f"{tenant}-{i}" for i in range(200)} & set(await store.jobs.active_ids())

    async def hmget_calls() -> int:
        stats = await store.client.info("commandstats")
        return int(stats.get("cmdstat_hmget", {}).get("calls", 0))

    before = await hmget_calls()
    await store.jobs.check_quota(msgspec.structs.replace(job, tenant=tenant), TenantLimits())
    assert await hmget_calls() - before == 1
