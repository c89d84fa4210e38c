"""`python -m env_svc`: environments, episodes and flow control (no torch needed)."""

from __future__ import annotations

import sys

from common.runtime.config import EnvServiceSettings
from common.runtime.entrypoint import serve, start_up_check
from common.runtime.service import exit_code, start_settings


def main(argv: list[str] | None = None) -> int:
    """Run the service; with `--check`, start it up to the point of connecting (settings,
    imports, tokenizer, environments) and exit 0: what an image must be able to do."""
    check = start_up_check(argv)
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
    return serve(service, shared, settings.metrics_port)


if __name__ == "__main__":
    sys.exit(exit_code("env_svc", main))
