"""What each service's `python -m` entry point does around building its service: read whether
it was asked for its start-up check, and run the built service with its health and metrics
endpoints as the deployment's settings place them."""

from __future__ import annotations

import asyncio
import sys

from common.runtime.config import SharedSettings
from common.runtime.service import Service, run_service


def start_up_check(argv: list[str] | None = None) -> bool:
    """Whether `--check` is among the arguments (default: the process's): start up to the
    point of connecting and exit 0, what an image must be able to do."""
    return "--check" in (sys.argv[1:] if argv is None else argv)


def serve(service: Service, shared: SharedSettings, metrics_port: int) -> int:
    """Run `service` until it stops (`run_service`), its /metrics, /healthz and /readyz on
    `metrics_port` of the deployment's metrics host; the process's exit code."""
    return asyncio.run(
        run_service(
            service,
            metrics_port=metrics_port,
            metrics_host=shared.metrics_host,
            metrics_tenant_labels=shared.metrics_tenant_labels,
        )
    )
