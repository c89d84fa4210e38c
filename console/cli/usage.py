"""`marlaas usage [TENANT...]`: what each tenant's and job's work cost the stack (tokens
generated, episodes, trainer seconds, evaluation tokens, stored bytes: common/state/usage.py),
as a table, JSON or CSV. With an API key: the key's tenant, through the tenant API."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from common.runtime.config import SharedSettings, load
from common.state.usage import TenantUsage, usage_csv
from console.cli.support import console, one_line_errors, options, run, say, tenant_client
from console.operator_client import OperatorClient
from console.status.usage import usage_table


@one_line_errors
def usage(
    tenants: Annotated[
        list[str] | None, typer.Argument(help="Tenants to show; default: every tenant.")
    ] = None,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV: tenant,job,<counts>.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Usage per tenant and job: tokens, episodes, trainer seconds, evaluation tokens and
    stored bytes, counted where the work happened. A tenant's row `*` is its total (jobs
    whose records expired included)."""
    found = run(_usage(tenants or []))
    if as_csv:
        say(usage_csv([row for tenant in found for row in tenant.rows()]).rstrip("\n"))
    elif as_json:
        say(json.dumps([{"tenant": t.tenant, **t.as_map()} for t in found], indent=2))
    else:
        console.print(usage_table(found))


async def _usage(tenants: list[str]) -> list[TenantUsage]:
    if (api := tenant_client()) is not None:
        async with api:
            return [await api.usage()]
    async with OperatorClient(
        load(SharedSettings), connect_timeout_s=options.connect_timeout_s
    ) as client:
        names = tenants or sorted(await client.store.usage.tenants())
        return [await client.usage(name) for name in names]


def register(app: typer.Typer) -> None:
    app.command()(usage)
