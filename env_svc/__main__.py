"""`python -m env_svc`: environments, episodes and flow control (no torch needed)."""

from __future__ import annotations

import asyncio
import sys

from common.config import EnvServiceSettings, SharedSettings, load
from common.logs import setup_logging
from common.service import log_settings, run_service


def main() -> int:
    shared, settings = load(SharedSettings), load(EnvServiceSettings)
    setup_logging(shared.log_level, shared.log_format)
    log_settings(shared, settings)
    from common.models import resolve_base_model
    from env_svc.episodes import ChatTokenizer
    from env_svc.service import EnvService

    tokenizer_dir = settings.tokenizer_dir or resolve_base_model(
        shared.base_model, shared.cache_dir
    )
    tokenizer = ChatTokenizer.from_dir(tokenizer_dir)
    service = EnvService(shared, settings, tokenizer)
    return asyncio.run(
        run_service(service, metrics_port=settings.metrics_port, metrics_host=shared.metrics_host)
    )


if __name__ == "__main__":
    sys.exit(main())
