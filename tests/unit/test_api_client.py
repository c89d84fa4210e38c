"""marlaas/api_client.py and marlaas/client.py: what a tenant or operator gives them, checked."""

from __future__ import annotations

import asyncio

import pytest

from marlaas.api_client import TenantClient


@pytest.mark.parametrize(
    "given",
    ["http://api:8080", "http://api:8080/", "http://api:8080/v1", "http://api:8080/v1/"],
)
def test_the_api_url_works_with_or_without_its_v1(given: str) -> None:
    """`marlaas up` prints the address with /v1; the CLI took it and asked for /v1/v1/..."""
    client = TenantClient(given, "mlk_key")
    try:
        assert client.url == "http://api:8080"
        assert str(client._http.base_url) == "http://api:8080/v1/"
    finally:
        asyncio.run(client.__aexit__())


def test_an_api_url_without_a_key_is_refused() -> None:
    with pytest.raises(ValueError, match="MARLAAS_API_KEY is not"):
        TenantClient("http://api:8080", "")


def test_a_job_whose_environment_no_env_svc_serves_is_refused_by_name() -> None:
    from common.wire.messages import EnvSettings, JobSpec
    from marlaas.client import EnvironmentNotServedError, refuse_unserved

    specs = [
        JobSpec(job_id=f"j{i}", tenant="acme", env=EnvSettings(name=name))
        for i, name in enumerate(["arithmetic", "no-such-env"])
    ]
    refuse_unserved(specs, None)  # no replica up to say: env_svc checks it when it comes
    refuse_unserved(specs[:1], {"arithmetic", "calculator"})
    with pytest.raises(EnvironmentNotServedError) as caught:
        refuse_unserved(specs, {"calculator", "arithmetic"})
    assert str(caught.value) == (
        "job 'j1': unknown environment 'no-such-env'; the deployment's env_svc serves "
        "arithmetic, calculator"
    )
