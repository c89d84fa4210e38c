"""marlaas/api_client.py: the tenant API's address as a user gives it."""

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
