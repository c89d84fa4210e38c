"""`python -m env_svc`: environments, episodes and flow control (no torch needed)."""

from __future__ import annotations

import asyncio
import sys

from common.runtime.config import EnvServiceSettings
from common.runtime.service import exit_code, run_service, start_settings


def main(argv: list[str] | None = None) -> int:
    """Run the service; with `--check`, start it up to the point of connecting (settings,
    imports, tokenizer, environments) and exit 0: what an image must be able to do."""
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    shared, settings = start_settings(EnvServiceSettings, check=check)
    from common.files.models import resolve_tokenizer
    from env_svc.chat_template import ChatTokenizer
    from env_svc.protocol import available_environments
    from env_svc.service import EnvService

    tokenizer_dir = resolve_tokenizer(shared.base_model, shared.cache_dir, settings.tokenizer_dir)
    tokenizer = ChatTokenizer.from_dir(tokenizer_dir)
    service = EnvService(shared, settings, tokenizer)
    if check:
        environments = ", ".join(available_environments())
        print(f"env_svc start-up check passed: tokenizer {tokenizer_dir}; {environments}")
        return 0
    return asyncio.run(
        run_service(
            service,
            metrics_port=settings.metrics_port,
            metrics_host=shared.metrics_host,
            metrics_tenant_labels=shared.metrics_tenant_labels,
        )
    )


if __name__ == "__main__":
    sys.exit(exit_code("env_svc", main))
