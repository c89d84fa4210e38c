"""The usage table (`marlaas usage`, the demo's end): a row per job, then its tenant's total."""

from __future__ import annotations

from rich.table import Table

from common.state.usage import USAGE_FIELDS, TenantUsage, Usage


def usage_table(found: list[TenantUsage]) -> Table:
    table = Table("tenant", "job", *(name.replace("_", " ") for name in USAGE_FIELDS))
    for tenant in found:
        for tenant_name, job_id, counts in tenant.rows():
            table.add_row(tenant_name, job_id, *_cells(counts), end_section=job_id == "*")
    return table


def _cells(counts: Usage) -> list[str]:
    return [
        f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"
        for value in counts.as_map().values()
    ]
