"""Who is asking, and which jobs are theirs: the API's one door.

A request's tenant is the one its API key belongs to (401 without a valid key). Another
tenant's job is answered exactly like a job that does not exist (404), so a key reveals
nothing of other tenants.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Annotated, TypeVar

from fastapi import Depends, HTTPException, Request

from api_svc.limits import TenantGate, bearer_token, vouch
from api_svc.views import JobView
from common.runtime.config import SharedSettings
from common.state.evals import DONE
from common.state.registry import JobRecord
from marlaas import Client as MarlaasClient
from marlaas import JobStateError
from marlaas.export import HELD_OUT_METRICS

T = TypeVar("T")


def _client(request: Request) -> MarlaasClient:
    client: MarlaasClient = request.app.state.client
    return client


def _settings(request: Request) -> SharedSettings:
    settings: SharedSettings = request.app.state.settings
    return settings


Client = Annotated[MarlaasClient, Depends(_client)]
"""The operator-side client the app holds open (its Kafka, Redis and artifacts)."""
Settings = Annotated[SharedSettings, Depends(_settings)]


async def _tenant_of(request: Request) -> str:
    """The tenant of the request's API key; 401 without a valid one."""
    if not (token := api_key(request)):
        raise unauthorized("no API key: send `Authorization: Bearer <key>`")
    tenant = await _client(request).store.tenants.authenticate(token)
    if tenant is None:
        raise unauthorized("API key not valid (unknown, revoked, or its tenant revoked)")
    vouch(request.scope)
    gate(request).admit(tenant)
    return tenant


def gate(request: Request) -> TenantGate:
    """The app's per-tenant request rate and open streams (api_svc/limits.py)."""
    held: TenantGate = request.app.state.gate
    return held


def api_key(request: Request) -> str:
    """The request's API key (`Authorization: Bearer <key>`); "" without one."""
    return bearer_token(request.headers.get("authorization", ""))


Tenant = Annotated[str, Depends(_tenant_of)]
"""The tenant of the request's API key."""


async def owned(client: MarlaasClient, job_id: str, tenant: str) -> JobRecord | None:
    """The tenant's job (None: bound to it but not registered yet); 404 otherwise."""
    claim = await client.store.jobs.claim_id(job_id, None)  # one round trip: binds nothing
    if claim.owner != tenant:
        raise HTTPException(404, f"no job {job_id!r} of tenant {tenant!r}")
    record = claim.record
    if record is not None and record.spec.tenant != tenant:  # registered by the operator
        raise HTTPException(404, f"no job {job_id!r} of tenant {tenant!r}")
    return record


async def records_of(client: MarlaasClient, tenant: str) -> list[JobRecord]:
    """The tenant's registered jobs' records (its listing's, each checked to be its own)."""
    records = []
    for job_id in await client.store.jobs.of_tenant(tenant):
        record = await client.store.jobs.get(job_id)
        if record is not None and record.spec.tenant == tenant:
            records.append(record)
    return records


async def registered(client: MarlaasClient, job_id: str, tenant: str) -> JobRecord:
    """The tenant's job, accepted by env_svc; 409 while it is not (or was rejected)."""
    if (record := await owned(client, job_id, tenant)) is None:
        raise HTTPException(409, f"job {job_id!r} is not accepted yet (or was rejected)")
    return record


VIEWED_EVAL_METRICS = (*HELD_OUT_METRICS, "eval_reward")
"""A job view's held-out results of each evaluated version."""


async def view_of(client: MarlaasClient, record: JobRecord) -> JobView:
    job_id = record.spec.job_id
    pointer = await client.store.adapters.get(job_id)
    evals = {}
    for version, state in sorted((await client.store.evals.versions(job_id)).items()):
        if state == DONE:
            metrics = (await client.store.evals.tally(job_id, version)).metrics()
            evals[str(version)] = {name: metrics[name] for name in VIEWED_EVAL_METRICS}
    return JobView.of(record, pointer.version if pointer else 0, evals)


async def conflict_on(call: Awaitable[T]) -> T:
    """A command that does not apply to the job's state, or an export with nothing to
    export, is the caller's 409, with the reason."""
    try:
        return await call
    except (JobStateError, FileNotFoundError, ValueError) as exc:
        raise HTTPException(409, str(exc)) from None
    except TimeoutError as exc:
        raise HTTPException(504, str(exc)) from None


def unauthorized(message: str) -> HTTPException:
    return HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})
