"""The tenant API: what a tenant does with MARLaaS, over HTTP, with an API key.

Tenants never hold Kafka or Redis credentials. They present `Authorization: Bearer <key>`
(`marlaas tenants add NAME` issues one); the API finds the tenant from the key
(common/state/tenants.py), and every job command and read checks that the job is that tenant's:
another tenant's job is answered exactly like one that does not exist (404), so a key
reveals nothing of other tenants. Submissions are stamped with the key's tenant, bound to it
(`owner:{job}`) before they are produced to `marlaas.jobs`, and checked against the tenant's
limits; env_svc checks the limits again, atomically, where the job is accepted. The API
talks to Kafka and Redis with its own credentials (common/security/access.py, principal `api`).

    marlaas api                  # or python -m api_svc: serves on MARLAAS_API_HOST:MARLAAS_API_PORT
    GET  /docs, /openapi.json    # the schema (FastAPI)

Endpoints (all under /v1, all authenticated): `GET tenant`, `GET jobs`, `POST jobs`,
`GET jobs/{job}`, `POST jobs/{job}/{pause|resume|cancel}`, `GET jobs/{job}/events`
(`?follow=true`: NDJSON until the job ends), `GET jobs/{job}/episodes` (its latest finished
episodes as text), `GET jobs/{job}/export` (the adapter as a .tar.gz PEFT directory), `GET
report?job=...` (.tar.gz of the HTML report), `POST jobs/{job}/sample` (a chat completion
with the job's adapter). `/console` is the web console over them (`web/`).

A deployable of its own (its image, its compose service), beside the three services: it
imports `common/` and the client library (`marlaas`) and nothing else. `server` builds and
serves the app; `access` finds the tenant of a key and a tenant's jobs; `views` are the JSON
shapes; `routes/` the endpoints by resource; `web/` the web console.
"""
